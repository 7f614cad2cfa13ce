"""Host slices onto devices: the one way a restore (from a checkpoint, from local and peer
copies, from safetensors files) turns the slices it read into a ``jax.Array``."""

from __future__ import annotations

import jax
import numpy as np
from numpy.typing import DTypeLike

from . import arrays
from .boxes import Index, from_slices


class Placement:
    """One array of ``shape`` and ``dtype`` on ``sharding``, built slice by slice.

    ``indices`` are the distinct slices this process's devices hold; ``put`` each one's host
    data once. The first device of a slice may adopt the host buffer (zero-copy on CPU when
    it is aligned and nothing else keeps it); its replicas are device-to-device copies (one
    batched ``device_put``), so no two devices share memory. ``array`` works on a process that holds no slice at all
    (a leaf that lives on other processes' devices).
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

    @property
    def indices(self) -> list[Index]:
        return list(self.devices)

    def put(self, index: Index, data: np.ndarray) -> None:
        first, *rest = self.devices[index]
        self.placed[first] = jax.device_put(data, self.on[first], may_alias=True)
        if not rest:
            return
        big = data.nbytes >= arrays.HUGE_PAGE_MIN_BYTES and arrays.HUGE_PAGES
        if big and first.platform == "cpu" and _adopted(data):
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


def _adopted(data: np.ndarray) -> bool:
    """Whether a CPU device adopts ``data``'s buffer as it is: whole bytes per element (XLA
    packs 1-, 2- and 4-bit types, copying them)."""
    return jax.dtypes.itemsize_bits(data.dtype) == 8 * data.dtype.itemsize
