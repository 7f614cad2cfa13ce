"""Host slices onto devices: the one way a restore (from a checkpoint, from local and peer
copies, from safetensors files) turns the slices it read into a ``jax.Array``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import jax
import numpy as np
from numpy.typing import DTypeLike

from . import arrays
from .boxes import Index, extent, from_slices

_ALIGN = 64  # where each copy starts in a leaf's mapping (XLA's CPU client adopts such buffers)


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
    replicas'), and the slices wait until ``array`` puts all of them in one call.
    (Faulting shards smaller than a huge page in 4 KiB pages cost more than reading them;
    a ``device_put`` per shard cost more than the rest of a restore of small ones; an
    allocation per copy, 5 % of a restore of 2000 small leaves.)
    The leaf's shards then free their memory together, when the last of them is gone.
    """

    def __init__(
        self, sharding: jax.sharding.Sharding, shape: tuple[int, ...], dtype: DTypeLike
    ) -> None:
        self.sharding, self.shape, self.dtype = sharding, shape, np.dtype(dtype)
        self.index_map = sharding.addressable_devices_indices_map(shape)
        self.devices: dict[Index, list[jax.Device]] = {}
        for device, index in self.index_map.items():
            if index is None:  # jax's annotation allows it; its shardings give every device one
                raise TypeError(f"{sharding} gives device {device} no index")
            self.devices.setdefault(from_slices(index, shape), []).append(device)
        self.placed: dict[jax.Device, jax.Array] = {}
        self._cpu = (  # the devices take host buffers of this dtype as they are
            bool(self.devices)
            and _adopted(self.dtype)
            and on_cpu(d for ds in self.devices.values() for d in ds)
        )
        self._host = self._host_buffers() if self._cpu else {}
        self._waiting: dict[Index, np.ndarray] = {}
        self._filled: set[Index] = set()  # slices whose replicas' places the reader filled
        _release_dropped()  # before this leaf's memory is filled

    def _host_buffers(self) -> dict[Index, list[np.ndarray]]:
        """Each slice's buffer for each of its devices, all in one buffer of the leaf
        (``arrays.aligned_empty``: its own huge-page mapping from 2 MiB)."""
        item = self.dtype.itemsize
        sizes = {i: math.prod(extent(i)) * item for i in self.devices}
        padded = {i: -(-n // _ALIGN) * _ALIGN for i, n in sizes.items()}
        total = sum(padded[i] * len(ds) for i, ds in self.devices.items())
        region, at = arrays.aligned_empty((total,), np.dtype(np.uint8), _ALIGN), 0
        out: dict[Index, list[np.ndarray]] = {i: [] for i in self.devices}
        # first copies first, then the replicas: where a caller puts buffers of its own
        # instead (``host_buffer`` unused), the first copies' stretch is never touched
        for k in range(max(len(ds) for ds in self.devices.values())):
            for i, ds in self.devices.items():
                if k < len(ds):
                    out[i].append(region[at : at + sizes[i]].view(self.dtype).reshape(extent(i)))
                    at += padded[i]
        return out

    def _on(self, device: jax.Device) -> jax.sharding.Sharding:
        """``device``, in the memory the sharding asks for (made when first needed: on CPU
        devices most leaves never need one)."""
        return jax.sharding.SingleDeviceSharding(device, memory_kind=self.sharding.memory_kind)

    def host_buffer(self, index: Index) -> np.ndarray | None:
        """Where to read slice ``index`` for ``put`` (C-contiguous, this array's dtype), or
        None where any fresh buffer will do."""
        copies = self._host.get(index)
        return copies[0] if copies else None

    def replica_buffers(self, index: Index) -> list[np.ndarray]:
        """Where slice ``index``'s replicas go, if any (its other devices' places): a reader
        that fills them as it reads ``host_buffer`` says so to ``put``, which then copies
        nothing."""
        return list(self._host.get(index, [])[1:])

    @property
    def indices(self) -> list[Index]:
        return list(self.devices)

    def put(self, index: Index, data: np.ndarray, replicas_filled: bool = False) -> None:
        """Slice ``index``'s host data; ``replicas_filled``: read into ``host_buffer`` and
        its ``replica_buffers`` already hold the same bytes."""
        if self._cpu:
            self._waiting[index] = data
            if replicas_filled:
                self._filled.add(index)
            return
        first, *rest = self.devices[index]
        self.placed[first] = jax.device_put(data, self._on(first), may_alias=True)
        if rest:
            copies = jax.device_put([self.placed[first]] * len(rest), [self._on(d) for d in rest])
            self.placed.update(zip(rest, copies, strict=True))

    def array(self) -> jax.Array:
        if self._waiting:
            return self._adopt_waiting()
        singles = [self.placed[d] for d in self.index_map]
        return jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, singles, dtype=self.dtype
        )

    def _adopt_waiting(self) -> jax.Array:
        """The array of the waiting slices, adopted by their CPU devices: each slice's
        first device takes its buffer, each replica a copy in its place in the leaf's
        buffer, so that no two devices share memory. One call puts them all
        (``_put_buffers``)."""
        bufs: dict[jax.Device, np.ndarray] = {}
        for index, data in self._waiting.items():
            first, *replicas = self._host[index]  # (every CPU leaf has its places)
            filled = (  # the reader's copies are of these very bytes
                index in self._filled
                and data.ctypes.data == first.ctypes.data
                and data.dtype == first.dtype
            )
            for copy in replicas if not filled else ():
                np.copyto(copy, data)
            bufs.update(zip(self.devices[index], [data, *replicas], strict=True))
        self._waiting.clear()
        self._filled.clear()
        devices = list(self.index_map)
        replicas = len(self.devices) < len(devices)
        arr = _put_buffers(
            self.shape, self.sharding, self.dtype, devices, [bufs[d] for d in devices], replicas
        )
        if arr is not None:
            return arr
        placed = jax.device_put(
            [bufs[d] for d in devices], [self._on(d) for d in devices], may_alias=True
        )
        self.placed.update(zip(devices, placed, strict=True))
        return self.array()


def _batched_put() -> Callable[..., jax.Array] | None:
    """jax's put of one array's host buffers, one per device (where
    ``make_array_from_callback`` ends), or None where this jax has none."""
    try:
        from jax._src import core  # (no public name for it)
        from jax._src.interpreters import pxla

        put = pxla.batched_device_put
    except (ImportError, AttributeError):
        return None

    def batched(shape, sharding, dtype, devices, bufs):
        aval = core.update_aval_with_sharding(core.ShapedArray(shape, dtype), sharding)
        return put(aval, sharding, bufs, devices)

    return batched


_put = _batched_put()
"""One array from a host buffer for each addressable device of a sharding (in the order of
its ``addressable_devices_indices_map``), which CPU devices adopt as they are: what
``make_array_from_callback`` does without its callback and our check of its buffers after
it, 0.25 against 0.37 s of a restore's placing of 2000 small leaves (1.0 against 1.1 s in
all). It puts the first buffer on every device of a leaf replicated on all of them."""


def _put_buffers(
    shape: tuple[int, ...],
    sharding: jax.sharding.Sharding,
    dtype: np.dtype,
    devices: list[jax.Device],
    bufs: list[np.ndarray],
    replicas: bool,
) -> jax.Array | None:
    """``_put`` of a leaf not replicated on every device (for one that is, jax puts the
    first buffer on all), or None where this jax has no ``_put``, refuses these arguments
    or, as the first leaf with replicas showed, gives several devices one buffer (the
    caller then puts the list)."""
    global _put_shares
    if _put is None or _put_shares or sharding.is_fully_replicated:
        return None
    try:
        arr = _put(shape, sharding, dtype, devices, bufs)
    except (AttributeError, TypeError):  # a jax whose private function changed
        return None
    if _put_shares is None and replicas:
        pointers = {s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}
        _put_shares = len(pointers) < len(devices)  # checked, not assumed of jax
        if _put_shares:
            return None
    return arr


_put_shares: bool | None = None
"""Whether ``_put`` gave the devices of a leaf with replicas one buffer (None: not seen)."""


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


def on_cpu(devices: Iterable[jax.Device]) -> bool:
    """Whether every one of ``devices`` is a CPU device, whose memory is host memory."""
    return all(d.platform == "cpu" for d in devices)


def _adopted(dtype: np.dtype) -> bool:
    """Whether a CPU device adopts a host buffer of ``dtype`` as it is: whole bytes per
    element (XLA packs 1-, 2- and 4-bit types, copying them)."""
    return jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize
