"""Moving bytes, not values: the dtype user data travels as between devices and processes.

A transfer between devices is an XLA program, and XLA may compute on what it moves: on CPU
its collectives carry bfloat16 and the float8s through float32, which quiets NaNs and drops
their payloads (bf16 ``7f85 -> 7fc0``); 1- and 2-bit integers crash them. A checkpoint
must give back the bytes it was given, so every move of user data (read once + move, peer
copies) bitcasts floating-point data to unsigned integers of the same width, moves those,
and bitcasts back; sub-byte types that devices can't carry safely move through host memory.
"""

from __future__ import annotations

import collections
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
    return _bitcast_all(arrays, [carrier(a.dtype) for a in arrays], donate)


def from_bits(arrays: Sequence[jax.Array], dtypes: Sequence[np.dtype]) -> list[jax.Array]:
    """The inverse of ``to_bits``: each array back as ``dtypes[i]`` (donated)."""
    return _bitcast_all(arrays, [np.dtype(d) for d in dtypes], True)


def reshard(
    arrays: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]
) -> list[jax.Array]:
    """``arrays[i]`` on ``shardings[i]``, bytes unchanged, ``arrays`` themselves kept (not
    donated): bitcast (a program a device order each way), ``transfer``, bitcast back."""
    out, on_devices = list(arrays), []
    for i, (x, s) in enumerate(zip(arrays, shardings, strict=True)):
        if x.sharding == s:
            continue
        if carrier(x.dtype) is None:  # through the host, where every process has it
            out[i] = from_host(np.asarray(x), s)
        else:
            on_devices.append(i)
    if on_devices:
        sent = to_bits([arrays[i] for i in on_devices], donate=False)
        moved = transfer(sent, [shardings[i] for i in on_devices])
        back = from_bits(moved, [arrays[i].dtype for i in on_devices])
        for i, y in zip(on_devices, back, strict=True):
            out[i] = y
    return out


def transfer(
    arrays: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]
) -> list[jax.Array]:
    """``arrays`` (carriers: ``to_bits``) on ``shardings``: ``jax.device_put`` one at a time,
    which compiles one program per distinct (shape, dtype, shardings) across processes and
    none within one, each finished before the next starts: two processes of separate hosts
    that queued hundreds of moves at once could stop for good (CPU devices, gloo), and
    finishing each costs a few ms a leaf. Nothing donated: a buffer can't become one of
    another shape, and jax warns of each it could not reuse (one warning a leaf). One
    program for all the arrays compiled faster where every leaf differs but slower where
    many share a shape, as a train state's do (docs/MEASURED.md)."""
    return [
        x if x.sharding == s else jax.block_until_ready(jax.device_put(x, s))
        for x, s in zip(arrays, shardings, strict=True)
    ]


def from_host(data: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """``data`` (the same on every process) on ``sharding``, slice by slice: no transfer
    between processes, and none of the equality check across them that a NaN fails."""
    return jax.make_array_from_callback(data.shape, sharding, lambda index: data[index])


def _bitcast_all(
    arrays: Sequence[jax.Array], dtypes: Sequence[np.dtype | None], donate: bool
) -> list[jax.Array]:
    """``arrays[i]`` bitcast to ``dtypes[i]``. A leaf whose shape, dtypes and sharding no
    other leaf shares would compile a program of its own: those of the same devices go in
    one program, which compiles faster. Leaves that share them share jax's program for that
    signature (``_bitcast_one``), compiled once: a state of many leaves of few shapes
    bitcasts faster that way than in one program (docs/MEASURED.md)."""
    out = list(arrays)
    todo: list[int] = []
    for i, (x, dtype) in enumerate(zip(arrays, dtypes, strict=True)):
        if dtype is None:
            raise ValueError(f"{x.dtype} cannot move between devices; move it through the host")
        if x.dtype != dtype:
            todo.append(i)
    signature = {i: (arrays[i].shape, arrays[i].dtype, dtypes[i], arrays[i].sharding) for i in todo}
    shared = collections.Counter(signature.values())
    groups: dict[tuple, list[int]] = {}
    for i in todo:
        x, dtype = arrays[i], dtypes[i]
        if shared[signature[i]] > 1:
            out[i] = _bitcast_one(dtype, x.sharding, donate)(x)
        else:
            groups.setdefault(_devices(x.sharding), []).append(i)
    for group in groups.values():
        fn = _bitcast_fn(
            tuple(dtypes[i] for i in group), tuple(arrays[i].sharding for i in group), donate
        )
        for i, y in zip(group, fn([arrays[i] for i in group]), strict=True):
            out[i] = y
    return out


def _devices(sharding: jax.sharding.Sharding) -> tuple:
    """What one jitted call's arguments must share: their devices, in the same order."""
    order = getattr(sharding, "_device_assignment", None)  # jit compares it
    return tuple(d.id for d in order) if order is not None else (id(sharding),)


@functools.lru_cache(maxsize=256)
def _bitcast_fn(
    dtypes: tuple[np.dtype, ...], shardings: tuple[jax.sharding.Sharding, ...], donate: bool
) -> Callable[[list[jax.Array]], list[jax.Array]]:
    return jax.jit(
        lambda xs: [jax.lax.bitcast_convert_type(x, d) for x, d in zip(xs, dtypes, strict=True)],
        out_shardings=list(shardings),
        donate_argnums=0 if donate else (),
    )


@functools.lru_cache(maxsize=256)
def _bitcast_one(
    dtype: np.dtype, sharding: jax.sharding.Sharding, donate: bool
) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(
        lambda x: jax.lax.bitcast_convert_type(x, dtype),
        out_shardings=sharding,
        donate_argnums=0 if donate else (),
    )
