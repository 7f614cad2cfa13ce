"""Host slices onto devices: the one way a restore (from a checkpoint, from local and peer
copies, from safetensors files) turns the slices it read into a ``jax.Array``."""

from __future__ import annotations

import math

import jax
import numpy as np
from numpy.typing import DTypeLike

from . import arrays
from .boxes import Index, extent, from_slices

_ALIGN = 64  # where each copy starts in a leaf's mapping (XLA's CPU client adopts such buffers)


class Placement:
    """One array of ``shape`` and ``dtype`` on ``sharding``, built slice by slice.

    ``indices`` are the distinct slices this process's devices hold; ``put`` each one's host
    data once. The first device of a slice may adopt the host buffer (zero-copy on CPU when
    it is aligned and nothing else keeps it); its replicas are copies, so no two devices
    share memory. ``array`` works on a process that holds no slice at all (a leaf that
    lives on other processes' devices).

    On CPU devices, whose buffers are host memory, every copy of the leaf this process
    holds gets its place in one fresh huge-page mapping (``host_buffer`` gives a slice's:
    read it there): a restore's shards are often smaller than a huge page, and faulting
    them in 4 KiB pages cost more than reading them. The leaf's shards then free their
    memory together, when the last of them is gone.
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
        kind = sharding.memory_kind  # each device in the memory the sharding asks for
        self.on = {
            d: jax.sharding.SingleDeviceSharding(d, memory_kind=kind) for d in self.index_map
        }
        self._host = self._host_buffers()

    def _host_buffers(self) -> dict[Index, list[np.ndarray]]:
        """Each slice's buffer for each of its devices, in one mapping, where the devices
        adopt host buffers (CPU, whole-byte dtype) and the leaf's copies come to a huge
        page or more; else none."""
        if not self.devices or not _adopted(self.dtype):
            return {}
        if any(d.platform != "cpu" for ds in self.devices.values() for d in ds):
            return {}
        item = self.dtype.itemsize
        sizes = {i: math.prod(extent(i)) * item for i in self.devices}
        padded = {i: -(-n // _ALIGN) * _ALIGN for i, n in sizes.items()}
        total = sum(padded[i] * len(ds) for i, ds in self.devices.items())
        if total < arrays.HUGE_PAGE_MIN_BYTES or not arrays.HUGE_PAGES:
            return {}
        region, at = arrays.huge_page_bytes(total), 0
        out: dict[Index, list[np.ndarray]] = {i: [] for i in self.devices}
        # first copies first, then the replicas: where a caller puts buffers of its own
        # instead (``host_buffer`` unused), the first copies' stretch is never touched
        for k in range(max(len(ds) for ds in self.devices.values())):
            for i, ds in self.devices.items():
                if k < len(ds):
                    out[i].append(region[at : at + sizes[i]].view(self.dtype).reshape(extent(i)))
                    at += padded[i]
        return out

    def host_buffer(self, index: Index) -> np.ndarray | None:
        """Where to read slice ``index`` for ``put`` (C-contiguous, this array's dtype), or
        None where any fresh buffer will do."""
        copies = self._host.get(index)
        return copies[0] if copies else None

    @property
    def indices(self) -> list[Index]:
        return list(self.devices)

    def put(self, index: Index, data: np.ndarray) -> None:
        first, *rest = self.devices[index]
        self.placed[first] = jax.device_put(data, self.on[first], may_alias=True)
        if not rest:
            return
        if index in self._host:
            for d, copy in zip(rest, self._host[index][1:], strict=True):
                np.copyto(copy, data)
                self.placed[d] = jax.device_put(copy, self.on[d], may_alias=True)
            return
        big = data.nbytes >= arrays.HUGE_PAGE_MIN_BYTES and arrays.HUGE_PAGES
        if big and first.platform == "cpu" and _adopted(data.dtype):
            # a CPU device's copy is a host memcpy into memory XLA faults in 4 KiB pages;
            # the same copy into a buffer of ours gets huge pages, and the device adopts it
            for d in rest:
                copy = arrays.aligned_empty(data.shape, data.dtype)
                np.copyto(copy, data)
                self.placed[d] = jax.device_put(copy, self.on[d], may_alias=True)
            return
        copies = jax.device_put([self.placed[first]] * len(rest), [self.on[d] for d in rest])
        self.placed.update(zip(rest, copies, strict=True))

    def array(self) -> jax.Array:
        singles = [self.placed[d] for d in self.index_map]
        return jax.make_array_from_single_device_arrays(
            self.shape, self.sharding, singles, dtype=self.dtype
        )


def _adopted(dtype: np.dtype) -> bool:
    """Whether a CPU device adopts a host buffer of ``dtype`` as it is: whole bytes per
    element (XLA packs 1-, 2- and 4-bit types, copying them)."""
    return jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize
