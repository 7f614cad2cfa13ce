"""Describing a pytree for writing, and the device->host snapshot of the owned shards.

``describe`` decides, for every leaf, its manifest record (``records.leaf_record``) and the
parts of shards this process writes (one replica of each, ``Part``). ``snapshot`` copies
those parts into host memory now (accelerator shards into pinned host memory, in one
batched ``device_put``), so an asynchronous save only needs the host copy (``HostCopies``).
``stage`` is both. On CPU devices the "copy" of a jax.Array is a zero-copy view (see
``HostCopies.snapshot``); NumPy leaves, which can be mutated, are always copied.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import multihost
from . import tree as tree_lib
from .boxes import Index, volume, whole, within
from .io import arrays, codecs
from .manifest import LeafRecord
from .records import check_alive, leaf_record, numpy_writer, stored_as
from .sharding import layout, write_split

log = logging.getLogger("jaxckpt")


@dataclass(frozen=True)
class Staged:
    """A pytree described for writing (``describe``); from ``stage``, with the shards this
    process writes already on the host.

    Pass it to ``CheckpointManager.save`` (or ``jaxckpt.save``) in place of the tree.
    """

    leaves: tuple[StagedLeaf, ...]
    meshes: list[dict]
    compression: str | None
    host_bytes: int  # bytes of host copies this handle holds (0 when not staged)


@dataclass(frozen=True)
class StagedLeaf:
    record: LeafRecord
    write: arrays.ArrayWrite | None


def _describe(
    path: list,
    name: str,
    leaf: Any,
    meshes: list[dict],
    compression: str | None,
    chunk_bytes: int | None,
    salt: int,
) -> StagedLeaf:
    if isinstance(leaf, jax.Array):
        check_alive(leaf, name)
    record, arr = leaf_record(path, name, leaf, meshes, chunk_bytes=chunk_bytes, salt=salt)
    pid = multihost.process_index()
    if record.kind == "python":
        return StagedLeaf(record, None)
    shape = tuple(record.shape)
    _, stored, itemsize = stored_as(arr.dtype)
    if record.kind == "numpy":
        mine = pid == numpy_writer(salt) and arr.size
        pieces = [(whole(shape), Part(name, arr, None, whole(shape)))] if mine else []
    elif math.prod(shape):
        split = write_split(arr.sharding, shape, itemsize, chunk_bytes)
        pieces = [
            (region, Part(name, arr.addressable_data(position), index, region))
            for position, index in layout(arr.sharding, shape).held_at
            for region, group in split.parts[index]
            if split.writer(index, group, salt) == pid
        ]
    else:
        pieces = []
    nbytes = sum(volume(region) for region, _ in pieces) * itemsize
    meta = arrays.zarr_metadata(shape, stored, record.chunk_shape or (), compression)
    return StagedLeaf(record, arrays.ArrayWrite(name, meta, pieces, pid == 0, nbytes))


class HostCopies:
    """Host snapshots of the shards a save writes; one set per manager.

    An accelerator's shards go to its pinned host memory in one batched ``device_put``: the
    DMA engine writes them there at the link's speed and the snapshot is that memory itself
    (on an H100, about ten times as fast as copies into pageable NumPy memory:
    docs/MEASURED.md). NumPy
    leaves, shards of devices without pinned host memory and shards already in host memory
    (``memory_kind`` pinned_host or unpinned_host) are copied into buffers reused across
    saves. XLA keeps the pinned memory it allocated for the process's life and reuses it
    (on a GPU, in a pool of at most ``XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB``); when it runs out,
    the shards go to the reused buffers instead, with a warning.

    ``pinned``: None (the default) takes pinned memory wherever the device has it and views a
    CPU device's buffer; True forces pinned memory (a CPU device's too), False the reused
    buffers (a CPU device's too): both for tests.
    """

    def __init__(self, pinned: bool | None = None) -> None:
        self.pinned = pinned
        self.buffers: dict[tuple, np.ndarray] = {}
        self.copies: list[_Slot] = []  # pending

    def snapshot(
        self, key: tuple, data: Any, dtype: np.dtype | None = None
    ) -> Callable[[], np.ndarray]:
        """The host snapshot of ``data`` (one device's buffer, or a NumPy array), to call
        after :meth:`run_copies` (device copies start now; ``key`` names its reused buffer).
        A CPU device buffer is host memory already and is given as a view: jax arrays are
        immutable, and while the view lives XLA will not donate the buffer to a later
        computation (it allocates a new output instead), so nothing overwrites it."""
        slot = _Slot(key, data, dtype or np.dtype(data.dtype))
        if isinstance(data, jax.Array):
            if self._to_pinned(data):
                slot.pinned = True
            elif data.platform() == "cpu" and self.pinned is None:
                view = np.asarray(data)
                return lambda: view
            else:
                data.copy_to_host_async()
        self.copies.append(slot)
        return slot.get

    def _to_pinned(self, data: jax.Array) -> bool:
        return _via_pinned(data) if self.pinned is None else self.pinned

    def makes_copy(self, data: jax.Array) -> bool:
        """Whether the snapshot of ``data`` is a copy (not a CPU device's buffer viewed)."""
        return self.pinned is not None or data.platform() != "cpu"

    def pending_bytes(self) -> int:
        """Bytes of the snapshots :meth:`run_copies` is about to make."""
        return sum(math.prod(s.data.shape) * s.dtype.itemsize for s in self.copies)

    def run_copies(self) -> None:
        """Makes every pending snapshot: the pinned ones in one batched ``device_put``,
        the rest copied into reused buffers (two threads: memcpy drops the GIL)."""
        pending, self.copies = self.copies, []
        pinned = [s for s in pending if s.pinned]
        if pinned:
            try:
                where = [_pinned_sharding(s.data) for s in pinned]
                done = jax.device_put([s.data for s in pinned], where)
                for s, host in zip(pinned, done, strict=True):
                    s.value = np.asarray(host)  # a view of the pinned memory (no copy)
            except jax.errors.JaxRuntimeError as e:  # pinned host memory exhausted, say
                log.warning("staging through pinned host memory failed (%s); copying into "
                            "pageable host buffers instead, which is slower", e)  # fmt: skip
                for s in pinned:
                    s.pinned, s.value = False, None
        rest = [s for s in pending if s.value is None]
        if not rest:
            return

        for s in rest:  # the buffers, on this thread; the copies on two
            shape = tuple(s.data.shape)
            buf = self.buffers.get(s.key)
            if buf is None or buf.shape != shape or buf.dtype != s.dtype:
                buf = self.buffers[s.key] = np.empty(shape, s.dtype)
            s.value = buf

        def copy(s: _Slot) -> None:
            np.copyto(s.get(), np.asarray(s.data), casting="equiv")  # (byte order may differ)

        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(copy, rest))


@dataclasses.dataclass(eq=False)
class _Slot:
    """One pending snapshot: its reused buffer's key, the source, and (once made) the value."""

    key: tuple
    data: Any
    dtype: np.dtype
    pinned: bool = False
    value: np.ndarray | None = None

    def get(self) -> np.ndarray:
        if self.value is None:
            raise RuntimeError(f"snapshot {self.key} read before HostCopies.run_copies")
        return self.value


def to_host(
    data: jax.Array, part: tuple[slice, ...] = (), pinned: bool | None = None
) -> np.ndarray:
    """``data[part]`` (one device's buffer) on the host, now. An accelerator's goes through
    its pinned host memory: the DMA of that part (a 1-bit type's whole buffer, which jax
    cannot slice), not jax's far slower copy of the whole buffer into pageable memory
    (docs/MEASURED.md), which jax would also keep on the array. Where pinned memory runs out, jax's
    copy it is. ``pinned``: True forces pinned memory (a CPU device's, for tests)."""
    if _via_pinned(data) if pinned is None else pinned:
        try:
            return _pinned_copies([(data, part)])[0]
        except jax.errors.JaxRuntimeError:  # pinned host memory exhausted, say
            pass
    return np.asarray(data)[part]


def to_host_all(
    gets: Sequence[Callable[[], np.ndarray]], pinned: bool | None = None
) -> list[np.ndarray]:
    """Each of ``gets`` called, except that the shard parts (``Part``) among them that go
    through pinned host memory are copied there in one batched ``device_put``. A call per
    part costs a fraction of a millisecond more than its share of a batch, which a
    synchronous save of thousands of small leaves feels (docs/MEASURED.md). ``pinned`` as
    for :func:`to_host`."""
    out: list[np.ndarray | None] = [None] * len(gets)
    batch = [
        (i, get)
        for i, get in enumerate(gets)
        if isinstance(get, Part)
        and get.index is not None
        and (_via_pinned(get.data) if pinned is None else pinned)
    ]
    if len(batch) > 1:
        try:
            copies = _pinned_copies([(part.data, part._slices()) for _, part in batch])
            for (i, _), host in zip(batch, copies, strict=True):
                out[i] = host
        except jax.errors.JaxRuntimeError:  # pinned memory exhausted: each part on its own
            pass
    return [get() if host is None else host for host, get in zip(out, gets, strict=True)]


def _pinned_copies(parts: Sequence[tuple[jax.Array, tuple[slice, ...]]]) -> list[np.ndarray]:
    """``data[part]`` of each pair, copied into its device's pinned host memory in one
    batched ``device_put`` (sliced on the device first, except 1-bit types)."""
    sources, rests = [], []
    for data, part in parts:
        sliced, rest = (data[part], ()) if part and _sliceable(data) else (data, part)
        sources.append(sliced)
        rests.append(rest)
    hosts = jax.device_put(sources, [_pinned_sharding(s) for s in sources])
    return [np.asarray(h)[rest] for h, rest in zip(hosts, rests, strict=True)]


def _sliceable(data: jax.Array) -> bool:
    """Whether jax slices ``data`` on its device: not 1-bit types (jax 0.10 fails to run
    the slice of an int1 or uint1 array); those go to the host whole and are sliced there."""
    return jax.dtypes.itemsize_bits(data.dtype) > 1


def _via_pinned(data: jax.Array) -> bool:
    """Whether ``data``'s snapshot goes through pinned host memory: an accelerator's that
    has it, unless ``data`` is in host memory already (a CPU device's buffer, or an
    offloaded one: a ``device_put`` there could hand back the array itself)."""
    if data.platform() == "cpu" or data.sharding.memory_kind in ("pinned_host", "unpinned_host"):
        return False
    return has_pinned(_device(data))


def _device(data: jax.Array) -> jax.Device:
    """The device of one device's buffer."""
    return next(iter(data.devices()))


@functools.cache
def has_pinned(device: jax.Device) -> bool:
    """Whether ``device`` has pinned host memory (GPUs and TPUs do)."""
    try:
        return any(m.kind == "pinned_host" for m in device.addressable_memories())
    except Exception:  # a backend that does not list its memories
        return False


def _pinned_sharding(data: jax.Array) -> jax.sharding.Sharding:
    """The pinned host memory of ``data``'s device."""
    return _pinned_on(_device(data))


@functools.cache
def _pinned_on(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def describe(
    tree: Any, *, compression: str | None = None, chunk_bytes: int | None = None
) -> Staged:
    """Describes ``tree`` for writing: each leaf's record and the parts this process
    writes, read from the live arrays when written (``snapshot`` copies them now)."""
    if isinstance(tree, Staged):
        return tree
    chunk_bytes = codecs.chunk_bytes_for(compression, chunk_bytes)  # (checks compression)
    meshes: list[dict] = []
    leaves = tuple(
        _describe(p, name, leaf, meshes, compression, chunk_bytes, salt)
        for salt, (p, name, leaf) in enumerate(tree_lib.flatten_named(tree))
    )
    return Staged(leaves, meshes, compression, 0)


@dataclass(frozen=True, slots=True)
class Part:
    """The part ``region`` (global coordinates) of one shard ``data`` whose box is
    ``index``, or (``index`` None) a whole NumPy leaf. Called, it gives the data to write."""

    leaf: str
    data: Any  # a jax.Array shard, or a NumPy array
    index: Index | None
    region: Index

    def __call__(self) -> np.ndarray:
        if self.index is None:
            return np.array(self.data, order="C", copy=not self.data.flags.c_contiguous)
        return to_host(self.data, self._slices())

    def _slices(self) -> tuple[slice, ...]:
        """The part's slices of the shard (none: it is the whole shard, the usual case)."""
        if self.index is None or self.region == self.index:
            return ()
        return within(self.region, self.index)

    def on_host(self, host: HostCopies) -> Callable[[], np.ndarray]:
        """The part's host snapshot made by ``host`` (pinned memory, or a buffer it reuses
        across saves; see :class:`HostCopies`), to call after ``host.run_copies``."""
        if self.index is None:  # NumPy leaves can be mutated: always copied
            return host.snapshot((self.leaf, None), self.data)
        data, part = self.data, self._slices()
        if part and host.makes_copy(data) and _sliceable(data):  # copy only this part
            data, part = data[part], ()
        get = host.snapshot((self.leaf, self.region), data)
        return (lambda: get()[part]) if part else get


def snapshot(staged: Staged, host: HostCopies) -> Staged:
    """``staged`` with the parts this process writes copied to the host now (every device
    copy started before any is awaited), so the arrays may change or be donated after."""
    leaves = []
    for leaf in staged.leaves:
        if leaf.write is not None:
            pieces = [
                (region, get.on_host(host) if isinstance(get, Part) else get)
                for region, get in leaf.write.pieces
            ]
            leaf = StagedLeaf(leaf.record, dataclasses.replace(leaf.write, pieces=pieces))
        leaves.append(leaf)
    held = host.pending_bytes()
    host.run_copies()
    return Staged(tuple(leaves), staged.meshes, staged.compression, held)


def stage(
    tree: Any,
    *,
    compression: str | None = None,
    chunk_bytes: int | None = None,
) -> Staged:
    """Starts device->host copies of the shards this process owns and returns a handle.

    Call it right after the update step; the training loop can go on while
    ``CheckpointManager.save(step, staged)`` writes the snapshot in the background. The
    handle fixes the chunking: pass the manager's ``compression`` and ``chunk_bytes`` here
    (they are what ``Options`` would use).

    >>> staged = jaxckpt.stage(state)
    >>> mgr.save(step, staged)
    """
    return snapshot(describe(tree, compression=compression, chunk_bytes=chunk_bytes), HostCopies())
