"""Moving bytes, not values: the dtype user data travels as between devices and processes.

A transfer between devices is an XLA program, and XLA may compute on what it moves: on CPU
its collectives carry bfloat16 and the float8s through float32, which quiets NaNs and drops
their payloads (bf16 ``7f85 -> 7fc0``); 1- and 2-bit integers crash them. A checkpoint
must give back the bytes it was given, so every move of user data (read once + move, peer
copies) bitcasts floating-point data to unsigned integers of the same width, moves those,
and bitcasts back; sub-byte types that devices can't carry safely move through host memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike

_HOST_ONLY = {
    np.dtype(t) for t in (ml_dtypes.int1, ml_dtypes.uint1, ml_dtypes.int2, ml_dtypes.uint2)
}


def carrier(dtype: DTypeLike) -> np.dtype | None:
    """The dtype ``dtype``'s data travels as between devices: unsigned integers of its width
    for floating-point types, the dtype itself for integers, bools, complex and the 4-bit
    types; None for 1- and 2-bit integers, which must move through host memory."""
    return _carrier(np.dtype(dtype))


@functools.cache
def _carrier(dtype: np.dtype) -> np.dtype | None:
    if dtype in _HOST_ONLY:
        return None
    try:
        width = int(ml_dtypes.finfo(dtype).bits)  # NumPy's floats and ml_dtypes' alike
    except (ValueError, TypeError):
        return dtype  # not a real floating-point type
    return np.dtype(f"uint{width}") if width == 8 * dtype.itemsize and width <= 64 else dtype


def to_bits(arrays: Sequence[jax.Array], donate: bool = True) -> list[jax.Array]:
    """Each array as its ``carrier`` (``donate``: the bits may reuse its buffers)."""
    return [_bitcast(a, carrier(a.dtype), donate) for a in arrays]


def from_bits(arrays: Sequence[jax.Array], dtypes: Sequence[np.dtype]) -> list[jax.Array]:
    """The inverse of ``to_bits``: each array back as ``dtypes[i]`` (donated)."""
    return [_bitcast(a, np.dtype(d)) for a, d in zip(arrays, dtypes, strict=True)]


def reshard(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` on ``sharding``, its bytes unchanged, ``x`` itself kept (not donated)."""
    if x.sharding == sharding:
        return x
    if carrier(x.dtype) is None:  # through the host, where every process holds it whole
        data = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda i: data[i])
    moved = jax.device_put(to_bits([x], donate=False), [sharding], donate=True)
    return from_bits(moved, [x.dtype])[0]


def _bitcast(x: jax.Array, dtype: np.dtype | None, donate: bool = True) -> jax.Array:
    if dtype is None:
        raise ValueError(f"{x.dtype} cannot move between devices; move it through the host")
    if x.dtype == dtype:
        return x
    return _bitcast_fn(dtype, x.sharding, donate)(x)


@functools.lru_cache(maxsize=256)
def _bitcast_fn(
    dtype: np.dtype, sharding: jax.sharding.Sharding, donate: bool
) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(
        lambda x: jax.lax.bitcast_convert_type(x, dtype),
        out_shardings=sharding,
        donate_argnums=0 if donate else (),
    )
