"""Describing a pytree for writing, and the device->host snapshot of the owned shards.

``describe`` decides, for every leaf, what goes into the manifest and which shards this
process writes (one replica of each). ``stage`` does the same and also copies those shards
into host memory now (``copy_to_host_async`` on all of them before any is awaited), so an
asynchronous save only needs the host copy; host buffers are reused across saves. On CPU
devices the "copy" of a jax.Array is a zero-copy view (see ``_shard_getter``); NumPy
leaves, which can be mutated, are always copied.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..errors import UnsupportedLeafError
from . import arrays, multihost
from . import tree as tree_lib
from .manifest import LeafRecord, nan_bits
from .sharding import layout, sharding_to_json, write_split

PY_TYPES = {bool: "bool", int: "int", float: "float", str: "str", type(None): "NoneType"}


@dataclass(frozen=True)
class Staged:
    """A pytree described for writing; with ``host=True`` its owned shards are on the host.

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


def leaf_record(
    path: list,
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
    name = tree_lib.path_name(path)
    if type(leaf) in PY_TYPES:
        bits = nan_bits(leaf) if type(leaf) is float else None
        typ = PY_TYPES[type(leaf)]
        return LeafRecord(path, name, "python", value=leaf, python_type=typ, float_bits=bits), None
    if isinstance(leaf, jax.Array):
        kind, impl, arr = "array", None, leaf
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            impl = str(jax.random.key_impl(leaf))
            kind, arr = "prng_key", key_data if key_data is not None else jax.random.key_data(leaf)
        shape = tuple(arr.shape)
        stored = arrays.stored_dtype(np.dtype(arr.dtype))
        itemsize = np.dtype(stored).itemsize
        nbytes = math.prod(shape) * itemsize
        split = write_split(arr.sharding, shape, itemsize, chunk_bytes)
        named = isinstance(arr.sharding, jax.sharding.NamedSharding)
        record = LeafRecord(
            path,
            name,
            kind,
            shape=list(shape),
            dtype=str(leaf.dtype),
            stored_dtype=stored if stored != str(arr.dtype) else None,
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
        arr = np.asarray(leaf)
        check_numpy(arr, name)
        if not arr.dtype.isnative:
            arr = arr.astype(arr.dtype.newbyteorder("="))
        stored = arrays.stored_dtype(arr.dtype)
        nbytes = arr.size * np.dtype(stored).itemsize
        record = LeafRecord(
            path,
            name,
            "numpy",
            shape=list(arr.shape),
            dtype=arr.dtype.name,
            stored_dtype=stored if stored != arr.dtype.name else None,
            chunk_shape=[max(1, d) for d in arr.shape],
            nbytes=nbytes,
            chunk_writers=[[[0] * arr.ndim, numpy_writer(salt)]] if nbytes else None,
            scalar=isinstance(leaf, np.generic),
        )
        return record, arr
    raise unsupported(leaf, name)


def check_numpy(arr: np.ndarray, name: str) -> None:
    if arr.dtype.kind in "OUSMm" or arr.dtype.fields or arr.dtype.name.startswith("void"):
        raise UnsupportedLeafError(
            f"leaf {name!r} is a NumPy array of dtype {arr.dtype}, which jaxckpt cannot "
            "store (strings, bytes, structured, object and datetime arrays are not "
            "supported); convert it to numbers, or keep it in the custom_metadata= JSON"
        )


def unsupported(leaf: Any, name: str) -> UnsupportedLeafError:
    return UnsupportedLeafError(
        f"leaf {name!r} has type {type(leaf).__module__}.{type(leaf).__qualname__}, which "
        "jaxckpt cannot store; leaves must be jax.Array, NumPy arrays or int/float/bool/str/"
        "None. Convert it, or register its class as a pytree node so its fields are leaves"
    )


def records(
    flat: list[tuple[list, Any]], key_data: dict[int, jax.Array] | None = None
) -> tuple[list[LeafRecord], list[dict]]:
    """The records of a flattened tree (``tree.flatten``) and its meshes, from metadata only
    (see ``leaf_record``; ``key_data`` by leaf position)."""
    meshes: list[dict] = []
    key_data = key_data or {}
    out = [leaf_record(p, leaf, meshes, key_data.get(i))[0] for i, (p, leaf) in enumerate(flat)]
    return out, meshes


def numpy_writer(salt: int) -> int:
    """The process that writes a NumPy leaf (equal on every process): round-robin."""
    return salt % multihost.process_count()


def _describe(
    path: list,
    leaf: Any,
    meshes: list[dict],
    compression: str | None,
    host: HostCopies | None,
    chunk_bytes: int | None,
    salt: int,
) -> StagedLeaf:
    record, arr = leaf_record(path, leaf, meshes, chunk_bytes=chunk_bytes, salt=salt)
    name, pid = record.name, multihost.process_index()
    if record.kind == "python":
        return StagedLeaf(record, None)
    shape, stored = tuple(record.shape), record.stored_dtype or str(arr.dtype)
    itemsize = np.dtype(stored).itemsize
    if record.kind == "numpy":
        whole = tuple((0, d) for d in shape)
        mine = pid == numpy_writer(salt) and arr.size
        pieces = [(whole, _numpy_getter(arr, host, name))] if mine else []
    elif math.prod(shape):
        split = write_split(arr.sharding, shape, itemsize, chunk_bytes)
        pieces = [
            (region, _shard_getter(arr.addressable_data(position), host, name, index, region))
            for position, index in layout(arr.sharding, shape).held_at
            for region, group in split.parts[index]
            if split.writer(index, group, salt) == pid
        ]
    else:
        pieces = []
    nbytes = sum(math.prod(b - a for a, b in idx) for idx, _ in pieces) * itemsize
    meta = arrays.zarr_metadata(shape, stored, record.chunk_shape, compression)
    return StagedLeaf(record, arrays.ArrayWrite(name, meta, pieces, pid == 0, nbytes))


class HostCopies:
    """Reusable host buffers keyed by (leaf, shard index); one set per manager."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, np.ndarray] = {}
        self.copies: list[tuple[np.ndarray, Any]] = []  # (destination, source) pending

    def snapshot(self, key: tuple, data: Any, dtype: np.dtype | None = None) -> np.ndarray:
        """A host snapshot of ``data`` (one device's buffer, or a NumPy array) in the reused
        buffer ``key``, filled by :meth:`run_copies` (device copies start now). A CPU device
        buffer is host memory already and is returned as a view: jax arrays are immutable,
        and while the view lives XLA will not donate the buffer to a later computation (it
        allocates a new output instead), so nothing overwrites it."""
        if isinstance(data, jax.Array):
            if data.platform() == "cpu":
                return np.asarray(data)
            data.copy_to_host_async()
        shape, dtype = tuple(data.shape), dtype or np.dtype(data.dtype)
        buf = self.buffers.get(key)
        if buf is None or buf.shape != shape or buf.dtype != dtype:
            buf = self.buffers[key] = np.empty(shape, dtype)
        self.copies.append((buf, data))
        return buf

    def run_copies(self) -> None:
        """Copies every pending source into its buffer (two threads: memcpy drops the GIL)."""
        pending, self.copies = self.copies, []
        if not pending:
            return

        def copy(item: tuple[np.ndarray, Any]) -> None:
            dst, src = item
            np.copyto(dst, np.asarray(src), casting="equiv")  # (byte order may differ)

        with ThreadPoolExecutor(max_workers=2) as pool:
            list(pool.map(copy, pending))


@functools.lru_cache(maxsize=4096)
def _writers(
    sharding, shape: tuple[int, ...], itemsize: int, chunk_bytes: int | None, salt: int
) -> tuple[tuple[tuple[int, ...], int], ...]:
    """(grid position, writing process) of every chunk (``chunk_writers``)."""
    return tuple(write_split(sharding, shape, itemsize, chunk_bytes).chunk_writers(salt))


def _shard_getter(
    data: jax.Array, host: HostCopies | None, name: str, index, region
) -> Callable[[], np.ndarray]:
    """The part ``region`` (global coordinates) of the shard ``data`` at ``index``."""
    part = tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(region, index, strict=True))
    if host is None:
        return lambda: np.asarray(data)[part]
    if region != index and data.platform() != "cpu":  # copy only this process's part
        data, part = data[part], ()
    snap = host.snapshot((name, region), data)[part]
    return lambda: snap


def _numpy_getter(arr: np.ndarray, host: HostCopies | None, name: str) -> Callable[[], np.ndarray]:
    if host is None:
        return lambda: np.array(arr, order="C", copy=not arr.flags.c_contiguous)
    buf = host.snapshot((name, None), arr)
    return lambda: buf


def describe(
    tree: Any,
    *,
    compression: str | None = None,
    host: HostCopies | None = None,
    chunk_bytes: int | None = None,
) -> Staged:
    """Describes ``tree`` for writing; with ``host``, also snapshots the owned shards."""
    if isinstance(tree, Staged):
        return tree
    meshes: list[dict] = []
    leaves = tuple(
        _describe(p, leaf, meshes, compression, host, chunk_bytes, salt)
        for salt, (p, leaf) in enumerate(tree_lib.flatten(tree))
    )
    held = 0
    if host is not None:
        held = sum(buf.nbytes for buf, _ in host.copies)
        host.run_copies()
    return Staged(leaves, meshes, compression, held)


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
    return describe(tree, compression=compression, host=HostCopies(), chunk_bytes=chunk_bytes)
