"""The manifest record of a live leaf (a ``LeafRecord``: shape, dtype, sharding, chunks
and who writes each), read from metadata only, so that it also describes arrays donated
since. The save (``staging.describe``) and the emergency tier's local steps use it.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import numpy as np

from ..errors import DeletedArrayError, UnsupportedLeafError
from . import multihost
from .io import arrays
from .manifest import LeafRecord, nan_bits
from .sharding import sharding_to_json, write_split

PY_TYPES = {bool: "bool", int: "int", float: "float", str: "str", type(None): "NoneType"}


def leaf_record(
    path: list,
    name: str,
    leaf: Any,
    meshes: list[dict],
    key_data: jax.Array | None = None,
    *,
    chunk_bytes: int | None = None,
    salt: int = 0,
) -> tuple[LeafRecord, Any]:
    """The record of one leaf, and the array that stores it (the key data of a PRNG key, a
    native-order NumPy array). Reads metadata only, so it also describes arrays that have
    been donated since; ``key_data``: the key's data, taken while it was alive. The chunks
    and their writers follow ``sharding.write_split`` (``salt``: the leaf's position).
    """
    if type(leaf) in PY_TYPES:
        bits = nan_bits(leaf) if type(leaf) is float else None
        typ = PY_TYPES[type(leaf)]
        return LeafRecord(path, name, "python", value=leaf, python_type=typ, float_bits=bits), None
    if isinstance(leaf, jax.Array):
        kind, impl, arr = "array", None, leaf
        if _is_key(leaf.dtype):
            impl = str(jax.random.key_impl(leaf))
            kind, arr = "prng_key", key_data if key_data is not None else jax.random.key_data(leaf)
        shape = tuple(arr.shape)
        dtype_name, stored, itemsize = stored_as(arr.dtype)
        nbytes = math.prod(shape) * itemsize
        split = write_split(arr.sharding, shape, itemsize, chunk_bytes)
        named = isinstance(arr.sharding, jax.sharding.NamedSharding)
        record = LeafRecord(
            path,
            name,
            kind,
            shape=list(shape),
            dtype=str(leaf.dtype) if impl else dtype_name,
            stored_dtype=stored if stored != dtype_name else None,
            sharding=sharding_to_json(arr.sharding, meshes),
            chunk_shape=list(split.chunks) if shape else [],
            nbytes=nbytes,
            # Named shardings: the writers follow from the saved spec, mesh and salt
            # (sharding.saved_writers), so the manifest stays O(leaves), not O(chunks).
            # Others list every chunk (cached and shared between leaves of one layout).
            chunk_writers=None
            if named or not nbytes
            else _writers(arr.sharding, shape, itemsize, chunk_bytes, salt % split.period),
            writer_salt=salt % split.period if named and nbytes else None,
            prng_impl=impl,
        )
        return record, arr
    if isinstance(leaf, (np.ndarray, np.generic)):
        host = np.asarray(leaf)
        check_numpy(host, name)
        if not host.dtype.isnative:
            host = host.astype(host.dtype.newbyteorder("="))
        _, stored, itemsize = stored_as(host.dtype)
        nbytes = host.size * itemsize
        record = LeafRecord(
            path,
            name,
            "numpy",
            shape=list(host.shape),
            dtype=host.dtype.name,
            stored_dtype=stored if stored != host.dtype.name else None,
            chunk_shape=[max(1, d) for d in host.shape],
            nbytes=nbytes,
            chunk_writers=[[[0] * host.ndim, numpy_writer(salt)]] if nbytes else None,
            scalar=isinstance(leaf, np.generic),
        )
        return record, host
    raise unsupported(leaf, name)


@functools.lru_cache(maxsize=256)
def stored_as(dtype: np.dtype) -> tuple[str, str, int]:
    """``dtype``'s name, the zarr type it is stored as (``arrays.stored_dtype``) and that
    type's itemsize. Remembered: NumPy works names out in Python, which was a third of
    describing a state of many small leaves (docs/MEASURED.md)."""
    stored = arrays.stored_dtype(np.dtype(dtype))
    return str(dtype), stored, np.dtype(stored).itemsize


@functools.lru_cache(maxsize=256)
def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def check_numpy(arr: np.ndarray, name: str) -> None:
    if arr.dtype.kind in "OUSMm" or arr.dtype.fields or arr.dtype.name.startswith("void"):
        raise UnsupportedLeafError(
            f"leaf {name!r} is a NumPy array of dtype {arr.dtype}, which jaxckpt cannot "
            "store (strings, bytes, structured, object and datetime arrays are not "
            "supported); convert it to numbers, or keep it in the custom_metadata= JSON"
        )


def check_alive(arr: jax.Array, name: str) -> None:
    """Raises where ``arr``'s bytes are gone (deleted, or donated to a computation) before
    a save could read them: jax's own error names no leaf. (An empty one has none to lose:
    its shape and dtype are all a save reads.)"""
    if arr.size and arr.is_deleted():
        raise DeletedArrayError(
            f"leaf {name!r} is a jax.Array that was deleted or donated (to a jit with "
            "donate_argnums, say) before the save read it, so its bytes are gone; save the "
            "state before the step that donates it, or take a host snapshot first "
            "(jaxckpt.stage(state)) and save that"
        )


def unsupported(leaf: Any, name: str) -> UnsupportedLeafError:
    return UnsupportedLeafError(
        f"leaf {name!r} has type {type(leaf).__module__}.{type(leaf).__qualname__}, which "
        "jaxckpt cannot store; leaves must be jax.Array, NumPy arrays or int/float/bool/str/"
        "None. Convert it, or register its class as a pytree node so its fields are leaves"
    )


def leaf_records(
    named: list[tuple[list, str, Any]], key_data: dict[int, jax.Array] | None = None
) -> tuple[list[LeafRecord], list[dict]]:
    """The records of a flattened tree (``tree.flatten_named``) and its meshes, from
    metadata only (see ``leaf_record``; ``key_data`` by leaf position)."""
    meshes: list[dict] = []
    key_data = key_data or {}
    out = [
        leaf_record(p, name, leaf, meshes, key_data.get(i))[0]
        for i, (p, name, leaf) in enumerate(named)
    ]
    return out, meshes


def numpy_writer(salt: int) -> int:
    """The process that writes a NumPy leaf (equal on every process): round-robin."""
    return salt % multihost.process_count()


@functools.lru_cache(maxsize=4096)
def _writers(
    sharding: jax.sharding.Sharding,
    shape: tuple[int, ...],
    itemsize: int,
    chunk_bytes: int | None,
    salt: int,
) -> tuple[tuple[tuple[int, ...], int], ...]:
    """(grid position, writing process) of every chunk (``chunk_writers``)."""
    return tuple(write_split(sharding, shape, itemsize, chunk_bytes).chunk_writers(salt))
