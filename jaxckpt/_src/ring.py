"""Host buffers a restore reads into on their way to an accelerator, reused: a ring.

An accelerator's restore reads each slice into host memory, checks it, and copies it onto
its device. Read into fresh pageable memory, every slice costs fresh pages (faulted in and
zeroed by the kernel) and a copy the driver makes into its own page-locked bounce buffers
before the DMA engine can take it. Read into ``Ring``, the slices land in one region
allocated once per process and kept, registered with the device's client
(``Client.dma_map``: page-locked, and known to XLA as such, so the copy onto the device is
a DMA straight from it, started as the slice is put and overlapped with the next reads);
a slot is reused once the copies out of it have finished (``jax.Array.is_ready``).

The region is as large as the restore's read budget (``inflight.default_budget`` when none
is given): the ring adds no host memory beyond what the budget already allows, and keeps it
after the restore. A slice larger than half the ring, or one asked for while every slot
holds a read not yet placed, reads into fresh memory as before: ``take`` never waits on a
read, only on a copy to a device that is under way, so it cannot deadlock.

CPU devices take host buffers as they are (``placement``: no copy, no ring). With
``JAXCKPT_ADOPT=0`` they are restored the way an accelerator is (each slice copied from a
ring slot onto its device), so tests and ``bench/compare.py`` run this path on CPU devices;
``JAXCKPT_RING=0`` reads into fresh memory instead (the path before the ring).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ..errors import ReadStalledError
from .io import arrays, linux
from .placement import adopts

log = logging.getLogger("jaxckpt")

SLOT_ALIGN = 4096  # each slot starts on a page: what O_DIRECT and DMA engines want


@dataclass(eq=False)
class _Slot:
    start: int
    stop: int
    moving: Sequence[jax.Array] | None = None  # given back: free once these are ready
    given: bool = False


@dataclass(eq=False)
class Ring:
    """``capacity`` bytes of host memory handed out as slots in turn (``take``) and
    reclaimed oldest first once given back (``give_back``) and copied out."""

    capacity: int
    clients: list[Any] = field(default_factory=list)  # those it is registered with (``_pin``)
    users: int = 0  # restores using it now (``for_restore``)
    region: np.ndarray = field(init=False, repr=False)
    address: int = field(init=False, repr=False)  # the region's first byte
    ready: threading.Event = field(init=False, repr=False)  # faulted in and registered
    _slots: collections.deque[_Slot] = field(init=False, repr=False)
    _at: dict[int, _Slot] = field(init=False, repr=False)  # the live slots by start
    _lock: threading.Lock = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.region = arrays.aligned_empty((self.capacity,), np.dtype(np.uint8), SLOT_ALIGN)
        self.address = int(self.region.ctypes.data)  # (asked for each slice given back)
        self.ready = threading.Event()
        self.ready.set()  # (``for_restore`` prepares a new ring on a thread: ``_prepare``)
        self._slots = collections.deque()
        self._at = {}
        self._lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        self.ready.wait()
        return bool(self.clients)

    def take(self, nbytes: int) -> np.ndarray | None:
        """A slot of ``nbytes`` (uint8, page-aligned), or None where the slice is larger
        than half the ring or every slot holds a read not yet given back (the caller then
        reads into fresh memory). Waits only for copies onto devices under way."""
        size = -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN
        if size > self.capacity // 2:
            return None
        self.ready.wait()  # (a new ring: faulted in and registered meanwhile)
        while True:
            with self._lock:
                self._reclaim()
                start = self._fit(size)
                if start is not None:
                    self._slots.append(slot := _Slot(start, start + size))
                    self._at[start] = slot
                    return self.region[start : start + nbytes]
                oldest = self._slots[0]
                if oldest.moving is None:  # a read not placed yet: never wait on it
                    return None
                moving = oldest.moving
            _wait(moving)  # (outside the lock: placing threads give back meanwhile)
            with self._lock:
                oldest.moving = ()

    def holds(self, data: np.ndarray) -> bool:
        """Whether ``data`` lies in the ring (not fresh memory)."""
        return 0 <= self._offset(data) < self.capacity

    def _offset(self, data: np.ndarray) -> int:
        return int(data.__array_interface__["data"][0]) - self.address

    def give_back(self, data: np.ndarray, moving: Iterable[jax.Array]) -> None:
        """The slot holding ``data`` (a view of it; nothing where ``data`` lies outside the
        ring: a read that got fresh memory, or where its slot was given back already) may
        be reused once each of ``moving`` (the arrays copied out of it) is ready."""
        at = self._offset(data)
        if not 0 <= at < self.capacity:
            return
        with self._lock:
            slot = self._at.get(at)  # (a restore gives back what it took, from its start)
            if slot is None:  # a view from inside its slot
                slot = next((s for s in self._slots if s.start <= at < s.stop), None)
            if slot is not None and not slot.given:
                slot.moving, slot.given = list(moving), True

    def _reclaim(self) -> None:
        """Frees the oldest slots whose copies have finished."""
        while self._slots and self._slots[0].moving is not None:
            if not all(_done(a) for a in self._slots[0].moving):
                return
            del self._at[self._slots.popleft().start]

    def _fit(self, size: int) -> int | None:
        """Where a slot of ``size`` starts: after the newest slot, or at the ring's start
        where the end has no room; None where the live slots leave no room."""
        if not self._slots:
            return 0
        oldest, newest = self._slots[0].start, self._slots[-1].stop
        if newest > oldest:  # live slots in one run: room after it and before it
            if self.capacity - newest >= size:
                return newest
            return 0 if oldest >= size else None
        return newest if oldest - newest >= size else None

    def settle(self) -> None:
        """Waits for every copy out of the ring under way now to finish and frees the slots
        given back whose copies have finished (removing any slots keeps the others in
        allocation order: all ``_fit`` needs). A slot that another restore sharing the ring
        gives back meanwhile stays until its own copies finish: its memory is not handed
        out while a device may still be reading it."""
        with self._lock:
            moving = [a for s in self._slots if s.moving for a in s.moving]
        _wait(moving)
        with self._lock:
            self._slots = collections.deque(
                s for s in self._slots if s.moving is None or not all(map(_done, s.moving))
            )
            self._at = {s.start: s for s in self._slots}

    def clear(self) -> None:
        """Frees every slot: its reads are over (no other restore uses the ring)."""
        with self._lock:
            self._slots.clear()
            self._at.clear()

    def drop_arrays(self) -> None:
        """Lets go of the arrays copied out of the ring (a retired ring keeps its memory,
        not the devices')."""
        with self._lock:
            for s in self._slots:
                s.moving = ()

    @property
    def busy(self) -> int:
        """Slots not yet reclaimed."""
        with self._lock:
            self._reclaim()
            return len(self._slots)


def _done(a: jax.Array) -> bool:
    """Whether the copy that made ``a`` has finished (an array deleted or donated since
    was ready before: jax waits for a copy before it frees or reuses its buffer)."""
    return bool(a.is_deleted() or a.is_ready())  # type: ignore[attr-defined]


def _wait(arrays_: Iterable[jax.Array]) -> None:
    for a in arrays_:
        if not a.is_deleted():
            a.block_until_ready()


_ring: Ring | None = None
_ring_lock = threading.Lock()
_retired: list[Ring] = []  # rings a stalled read may still write, kept for the process


def enabled() -> bool:
    return linux.switched_on(linux.RING)


@contextlib.contextmanager
def for_restore(budget: int, devices: Iterable[jax.Device]) -> Iterator[Ring | None]:
    """The process's ring for a restore onto ``devices`` with read budget ``budget``: one
    of at least that many bytes where no other restore uses the ring meanwhile, made (and
    registered with the devices' client) the first time and kept, pinned, for the life of
    the process; None where the devices take host buffers as they are (CPU devices,
    ``placement.adopts``) or it is switched off (``JAXCKPT_RING=0``). On the way out every
    copy out of the ring has finished (``settle``). A restore that fails lets the ring go;
    one whose read stalled retires it for good: a reader thread left behind may still
    write into it, and memory a client counts as registered must not be handed out again
    by the allocator."""
    global _ring
    devices = list(devices)
    if not enabled() or adopts(devices):
        yield None
        return
    with _ring_lock:
        ring = _ring
        if ring is None or (ring.capacity < budget and not ring.users):
            if ring is not None:  # a larger budget: the old ring is let go (idle)
                _unpin(ring)
            ring = _ring = Ring(budget)
            ring.ready.clear()
            prepare = threading.Thread(
                target=_prepare, args=(ring, devices), name="jaxckpt-ring", daemon=True
            )
            prepare.start()
        ring.users += 1
    try:
        yield ring
        ring.settle()  # the caller may donate or delete what it restored: no array kept
        with _ring_lock:
            if ring.users == 1:  # (slots a reader took and never gave back: reads over)
                ring.clear()
    except BaseException as e:
        with _ring_lock:
            if _ring is ring:
                _ring = None
            if _stalled(e) or ring.users > 1:  # (another restore's copies: left as they are)
                if ring.users == 1:
                    ring.drop_arrays()
                _retired.append(ring)
            else:
                try:
                    ring.settle()
                except Exception:  # (a device's own failure: copies may be under way still)
                    _retired.append(ring)
                else:
                    _unpin(ring)
        raise
    finally:
        with _ring_lock:
            ring.users -= 1


def _stalled(e: BaseException | None) -> bool:
    """Whether ``e`` or an error it was raised from is a stalled read's."""
    while e is not None:
        if isinstance(e, ReadStalledError):
            return True
        e = e.__cause__ or e.__context__
    return False


def _prepare(ring: Ring, devices: list[jax.Device]) -> None:
    """A new ring's memory faulted in (``arrays.populate``) and registered (``_pin``), on a
    thread of its own while the restore plans its reads on a core they leave idle (the
    first slot taken waits for it): a ring of the budget's size cost the first restore that
    much fresh memory in its reads, and registering it page-locks every page."""
    try:
        arrays.populate(ring.region)
        _pin(ring, devices)
    finally:
        ring.ready.set()


def _pin(ring: Ring, devices: list[jax.Device]) -> None:
    """Registers ``ring``'s region with the clients of ``devices`` (page-locked, copies
    out of it by DMA, with no staging copy): none for CPU devices; a client that refuses
    is logged and the ring stays pageable for it."""
    clients = {id(d.client): d.client for d in devices if d.platform != "cpu"}
    for client in clients.values():
        try:
            client.dma_map(ring.address, ring.capacity)
        except Exception as e:  # (jax raises its own runtime error)
            log.warning(
                "jaxckpt: host ring of %d bytes not registered with %s (%s): restores copy "
                "from pageable memory",
                ring.capacity,
                client.platform,
                e,
            )
        else:
            ring.clients.append(client)


def _unpin(ring: Ring) -> None:
    """Undoes ``_pin`` (every copy out of the ring finished: ``settle``); a client that
    refuses keeps the ring registered, so it is kept for the process (``_retired``)."""
    ring.ready.wait()
    for client in ring.clients:
        try:
            client.dma_unmap(ring.address)
        except Exception as e:  # (jax raises its own runtime error)
            log.warning("jaxckpt: host ring not unregistered (%s): kept", e)
            _retired.append(ring)
    ring.clients.clear()
