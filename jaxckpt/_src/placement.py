"""Host slices onto devices: the one way a restore (from a checkpoint, from local and peer
copies, from safetensors files) turns the slices it read into a ``jax.Array``."""

from __future__ import annotations

import functools
import math
import threading
import types
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from numpy.typing import DTypeLike

from .boxes import Index, extent, from_slices
from .io import arrays, linux
from .io.layout import ADOPT_ALIGN


class Placement:
    """One array of ``shape`` and ``dtype`` on ``sharding``, built slice by slice.

    ``indices`` are the distinct slices this process's devices hold; ``put`` each one's host
    data once, then take the ``array``. It works on a process that holds no slice at all (a
    leaf that lives on other processes' devices). No two devices share memory: a replica is
    a copy (a device may donate its buffer and write it).

    An accelerator gets each slice as it is put (host to device, overlapping the next
    reads), its replicas copied device to device. CPU devices, whose buffers are host
    memory, adopt the host data as it is (aligned: no copy): every copy of the leaf this
    process holds gets its place in one fresh buffer of the leaf, a huge-page mapping from
    2 MiB (``host_buffer`` gives a slice's: read it there; ``replica_buffers`` its
    replicas'), and the slices wait until ``array`` puts them with jax's own put: a leaf
    in one call, one replicated on every device a device at a time (``_try_put``).
    (Faulting shards smaller than a huge page in 4 KiB pages cost more than reading them; a
    public ``device_put`` per shard, more than the rest of a restore of small ones; an
    allocation per copy, a few % of a restore of many small leaves: docs/MEASURED.md.)
    The leaf's shards then free their memory together, when the last of them is gone.

    A small leaf on devices that copy host buffers (an accelerator; CPU devices with
    ``JAXCKPT_ADOPT=0``), one whose copies on this process come to ``WHOLE_LEAF_BYTES`` or
    less, is read into a buffer of its own too (``stage``), and put whole with jax's own
    put as its last slice arrives, each replica copied into its place first (each device
    copying its place): one call a leaf rather than a put a slice and a device-to-device
    copy a replica, the calls being most of the cost of a restore of many small leaves
    (docs/MEASURED.md).
    """

    def __init__(
        self, sharding: jax.sharding.Sharding, shape: tuple[int, ...], dtype: DTypeLike
    ) -> None:
        self.sharding, self.shape, self.dtype = sharding, shape, np.dtype(dtype)
        self.index_map = sharding.addressable_devices_indices_map(shape)
        self.devices, cpu = _slices(sharding, shape)
        self.placed: dict[jax.Device, jax.Array] = {}
        adopt = cpu and linux.switched_on(linux.ADOPT)
        self._cpu = adopt and _adopted(self.dtype)  # devices that take host buffers as they are
        # devices that copy host buffers into their own memory (not CPU ones, which keep
        # them even when told not to, nor host memory kinds, which might)
        self._copies = not cpu and sharding.memory_kind in (None, "device")
        self._whole = not self._cpu and _small(sharding, shape, self.dtype, adopt)
        self._host = self._host_buffers() if self._cpu or self._whole else {}
        self._array: jax.Array | None = None  # (a small leaf: put as its last slice came)
        self._waiting: dict[Index, tuple[np.ndarray, Sequence[np.ndarray] | None]] = {}
        _release_dropped()  # before this leaf's memory is filled

    def _host_buffers(self) -> dict[Index, list[np.ndarray]]:
        """Each slice's buffer for each of its devices, all in one buffer of the leaf
        (``arrays.aligned_empty``: its own huge-page mapping from 2 MiB)."""
        total, places = _places(self.sharding, self.shape, self.dtype.itemsize)
        region = arrays.aligned_empty((total,), np.dtype(np.uint8), ADOPT_ALIGN)
        return {
            i: [region[at : at + n].view(self.dtype).reshape(shape) for at in starts]
            for i, shape, n, starts in places
        }

    def _on(self, device: jax.Device) -> jax.sharding.Sharding:
        """``device``, in the memory the sharding asks for."""
        return _single(device, self.sharding.memory_kind)

    def host_buffer(self, index: Index) -> np.ndarray | None:
        """Where to read slice ``index`` for ``put`` (C-contiguous, this array's dtype), or
        None where any fresh buffer will do (or ``stage`` gives one)."""
        copies = self._host.get(index) if self._cpu else None
        return copies[0] if copies else None

    def replica_buffers(self, index: Index) -> list[np.ndarray]:
        """Where slice ``index``'s replicas go, if any (its other devices' places): a reader
        that fills them as it reads ``host_buffer`` says so to ``put``, which then copies
        nothing."""
        return list(self._host.get(index, [])[1:]) if self._cpu else []

    def stage(self, index: Index) -> Callable[[int], np.ndarray | None] | None:
        """For a small leaf put whole: what gives a read of slice ``index`` its place in the
        leaf's buffer as the read starts (its bytes, uint8; None once the leaf is put, or
        for a read of another size: fresh memory), as ``slices.Request.stage`` asks. Asked
        for, not held by the request, the buffer goes with the put: a request that held
        it kept every small leaf's buffer until the restore's end. None for other leaves."""
        if not self._whole:
            return None

        def place(nbytes: int) -> np.ndarray | None:
            copies = self._host.get(index)
            first = copies[0] if copies else None
            return (
                first.reshape(-1).view(np.uint8)
                if first is not None and first.nbytes == nbytes
                else None
            )

        return place

    @property
    def indices(self) -> list[Index]:
        return list(self.devices)

    def put(
        self,
        index: Index,
        data: np.ndarray,
        replicas: Sequence[np.ndarray] | None = None,
        *,
        borrowed: bool = False,
    ) -> list[jax.Array]:
        """Slice ``index``'s host data; ``replicas``: buffers that hold the same bytes
        already, one for each of its other devices (a reader that filled
        ``replica_buffers`` as it read, or mapped each copy of a chunk: ``mapped``), so that
        nothing is copied onto CPU devices. ``borrowed``: ``data``'s memory is reused once
        the copies onto the devices are done (a ``ring`` slot): no device keeps it as its
        own. Returns the arrays copied out of ``data`` (none where the slice waits for
        ``array``, which CPU devices adopt)."""
        if self._cpu or self._whole:  # put at ``array``, or a small leaf once it is all here
            held = _copied(data) if borrowed else data  # (memory that is reused: copied)
            with _waiting_lock:  # (placing threads put a leaf's slices side by side)
                self._waiting[index] = (held, replicas)
                last = self._whole and len(self._waiting) == len(self.devices)
            if last:  # (the one thread that put the last slice)
                self._array = self._adopt_waiting()
                self._host = {}  # (its buffer is jax's now: gone once the copies are done)
            return []
        first, *rest = self.devices[index]
        if borrowed and not self._copies:  # a CPU device keeps the host bytes it is given
            data = _copied(data)  # (``may_alias=False`` does not stop it: jax 0.10)
        self.placed[first] = jax.device_put(data, self._on(first), may_alias=True)
        if rest:
            copies = jax.device_put([self.placed[first]] * len(rest), [self._on(d) for d in rest])
            self.placed.update(zip(rest, copies, strict=True))
        return [self.placed[first]]

    def array(self) -> jax.Array:
        if self._array is not None:
            return self._array
        if self._waiting:
            return self._adopt_waiting()
        singles = [self.placed[d] for d in self.index_map]
        return jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, singles, dtype=self.dtype
        )

    def _adopt_waiting(self) -> jax.Array:
        """The array of the waiting slices, adopted by their CPU devices: each slice's
        first device takes its buffer, each replica a copy in its place in the leaf's
        buffer, so that no two devices share memory; each put on its device
        (``_try_put``)."""
        bufs: dict[jax.Device, np.ndarray] = {}
        for index, (data, given) in self._waiting.items():
            _, *places = self._host[index]  # (every CPU leaf has its places)
            replicas = list(given or ())
            if len(replicas) != len(places) or any(
                r.dtype != data.dtype or r.shape != data.shape for r in replicas
            ):
                replicas = places
                for copy in places:
                    np.copyto(copy, data)
            bufs.update(zip(self.devices[index], [data, *replicas], strict=True))
        self._waiting.clear()
        devices = list(self.index_map)
        ordered = [bufs[d] for d in devices]
        if len(devices) == 1 or not self.sharding.is_fully_replicated:  # the leaf in one call
            whole = _try_put(ordered, [(self.shape, self.sharding, devices, ordered)])
            if whole:
                return whole[0]
        on = [self._on(d) for d in devices]
        each = [(b.shape, s, [d], [b]) for b, s, d in zip(ordered, on, devices, strict=True)]
        singles = _try_put(ordered, each) or jax.device_put(ordered, on, may_alias=True)
        self.placed.update(zip(devices, singles, strict=True))
        return self.array()


@functools.lru_cache(maxsize=1024)
def _slices(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[Mapping[Index, tuple[jax.Device, ...]], bool]:
    """The distinct slices of ``shape`` this process's devices hold under ``sharding``, each
    with its devices, and whether there are some, all CPU devices. (Remembered: leaves of a
    state share a few shardings and shapes, and this was most of a ``Placement``'s cost:
    docs/MEASURED.md.)"""
    devices: dict[Index, list[jax.Device]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        if index is None:  # jax's annotation allows it; its shardings give every device one
            raise TypeError(f"{sharding} gives device {device} no index")
        devices.setdefault(from_slices(index, shape), []).append(device)
    out = types.MappingProxyType({i: tuple(ds) for i, ds in devices.items()})
    return out, bool(out) and on_cpu(d for ds in out.values() for d in ds)


@functools.lru_cache(maxsize=1024)
def _places(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int
) -> tuple[int, list[tuple[Index, tuple[int, ...], int, list[int]]]]:
    """Where each copy of each slice lies in one buffer of the leaf: its size in bytes and,
    per slice, its shape, bytes and each copy's start (64-byte aligned). First copies
    first, then the replicas: where a caller puts buffers of its own instead
    (``host_buffer`` unused), the first copies' stretch is never touched."""
    slices, _ = _slices(sharding, shape)
    nbytes = {i: math.prod(extent(i)) * itemsize for i in slices}
    starts: dict[Index, list[int]] = {i: [] for i in slices}
    at = 0
    for k in range(max((len(ds) for ds in slices.values()), default=0)):
        for i, ds in slices.items():
            if k < len(ds):
                starts[i].append(at)
                at += -(-nbytes[i] // ADOPT_ALIGN) * ADOPT_ALIGN
    return at, [(i, tuple(extent(i)), nbytes[i], starts[i]) for i in slices]


def _copied(data: np.ndarray) -> np.ndarray:
    """``data`` in fresh memory a CPU device can adopt."""
    out = arrays.aligned_empty(data.shape, data.dtype, ADOPT_ALIGN)
    np.copyto(out, data)
    return out


@functools.lru_cache(maxsize=4096)
def _single(device: jax.Device, memory_kind: str | None) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind=memory_kind)


def _batched_put() -> Callable[..., jax.Array] | None:
    """jax's put of host buffers, one per device, as one array (where ``device_put`` and
    ``make_array_from_callback`` end; CPU devices adopt the buffers as they are), or None
    where this jax has none."""
    try:
        from jax._src import core  # (no public name for it)
        from jax._src.interpreters import pxla

        batched = pxla.batched_device_put
    except (ImportError, AttributeError):
        return None

    def put(
        shape: tuple[int, ...],
        sharding: jax.sharding.Sharding,
        devices: list[jax.Device],
        bufs: list[np.ndarray],
    ) -> jax.Array:
        aval = core.ShapedArray(shape, bufs[0].dtype)
        return batched(core.update_aval_with_sharding(aval, sharding), sharding, bufs, devices)

    return put


_put = _batched_put()


def _try_put(bufs: list[np.ndarray], calls: list[tuple]) -> list[jax.Array] | None:
    """``_put`` of each of ``calls`` (shape, sharding, devices, buffers), or None where this
    jax has no ``_put`` or refuses the call (a private function that changed), or would
    keep a dtype of ``bufs`` that jax narrows (64-bit ones without ``jax_enable_x64``:
    ``device_put`` narrows them). The whole leaf goes in one call unless it is replicated
    on every device: jax's put of such a leaf gives every device the first buffer, and one
    buffer on several devices would let a donation on one write the others (a leaf
    replicated on some devices keeps every buffer it is given; tests/test_placement.py
    checks both). A leaf replicated everywhere goes a device at a time, still faster than
    ``device_put`` of the list and its pytree handling (docs/MEASURED.md)."""
    if _put is None or any(jax.dtypes.canonicalize_dtype(b.dtype) != b.dtype for b in bufs):
        return None
    try:
        return [_put(*call) for call in calls]
    except (AttributeError, TypeError):
        return None


def _collector() -> Callable[[], None]:
    """jaxlib's hand-back of the host buffers of arrays the program dropped, or a no-op."""
    try:
        from jax._src.lib import _jax  # (no public name for it)

        return _jax.collect_garbage
    except (ImportError, AttributeError):
        return lambda: None


_release_dropped = _collector()
"""jax frees the Python owners of the host buffers a CPU device adopted (the arrays a
program dropped) only at its next transfer. A restore that puts its leaves at the end would
fill fresh memory while a state the caller dropped before it still holds its own: twice the
memory (and, on a VM, pages that cost more to fault in than to reuse)."""


def cpu_replicas(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], dtype: DTypeLike
) -> Mapping[Index, int]:
    """For a leaf whose slices CPU devices adopt as they are (``Placement``), each distinct
    slice this process holds with its number of replicas (devices beyond the first): a
    reader that fills or maps that many more copies saves ``put`` the copying. Empty for
    any other leaf."""
    slices, cpu = _slices(sharding, shape)
    if not (cpu and linux.switched_on(linux.ADOPT) and _adopted(np.dtype(dtype))):
        return {}
    return {index: len(devices) - 1 for index, devices in slices.items()}


def on_cpu(devices: Iterable[jax.Device]) -> bool:
    """Whether every one of ``devices`` is a CPU device, whose memory is host memory."""
    return all(d.platform == "cpu" for d in devices)


def adopts(devices: Iterable[jax.Device]) -> bool:
    """Whether ``devices`` take host buffers as they are: all CPU devices, unless
    ``JAXCKPT_ADOPT=0`` has them copy each slice as an accelerator does (``ring``)."""
    return on_cpu(devices) and linux.switched_on(linux.ADOPT)


def _adopted(dtype: np.dtype) -> bool:
    """Whether a CPU device adopts a host buffer of ``dtype`` as it is: whole bytes per
    element (XLA packs 1-, 2- and 4-bit types, copying them)."""
    return jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize


_waiting_lock = threading.Lock()

WHOLE_LEAF_BYTES = 1 << 20
"""A leaf whose copies on this process come to this or less is put whole on devices that copy
host buffers (``Placement``)."""


def _small(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], dtype: np.dtype, adopt: bool
) -> bool:
    """Whether a leaf is put whole on its devices as its last slice arrives: its copies on
    this process ``WHOLE_LEAF_BYTES`` or less, on devices that copy host buffers into their
    own memory (an accelerator; CPU devices told not to adopt them), with jax's own put at
    hand and a dtype it puts as it is."""
    slices, cpu = _slices(sharding, shape)
    device_memory = sharding.memory_kind in (None, "device")
    putable = _put is not None and _adopted(dtype) and jax.dtypes.canonicalize_dtype(dtype) == dtype
    if not slices or (cpu and adopt) or not device_memory or not putable:
        return False
    return _places(sharding, shape, dtype.itemsize)[0] <= WHOLE_LEAF_BYTES
