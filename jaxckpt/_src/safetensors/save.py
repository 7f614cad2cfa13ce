"""``jaxckpt.safetensors.save``: the Hugging Face layout, every process writing its slices."""

from __future__ import annotations

import collections
import math
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import nullcontext
from typing import Any

import jax
import numpy as np
import tensorstore as ts
from jax.experimental import multihost_utils

from ...errors import SafetensorsError
from .. import bits, multihost, steps
from .. import tree as tree_lib
from ..boxes import Index, bounding, extent, volume, whole, within
from ..sharding import layout, write_split
from ..storage import Location, location
from .format import (
    INDEX_FILE,
    FilePlan,
    TensorInfo,
    create_files,
    dtype_name,
    index_json,
    plan,
    write_in_place,
)
from .mapping import LeafMap, Names, Transforms, dotted, leaf_map, tensor_runs, to_reshaped

WRITE_BLOCK_BYTES = 128 << 20  # a leaf's owned parts joined into one host block up to this

Leaf = tuple[LeafMap, jax.Array | np.ndarray]  # a leaf to write, and how it maps to tensors
Part = tuple[Index, np.ndarray]  # a box of a leaf, and its data on the host


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    names: Names = None,
    transforms: Transforms = None,
    max_file_bytes: float = 5e9,
    metadata: dict[str, str] | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Writes the array leaves of ``tree`` as Hugging Face safetensors files in ``path``.

    One ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` files of at most
    ``max_file_bytes`` of data with ``model.safetensors.index.json``. Every process calls
    it; each writes the slices it owns (one replica of each, spread over the replicas) into
    the files directly, one shard at a time. On a local or shared filesystem the files are
    written in ``<path>.tmp-<id>`` and renamed into place when complete; object stores
    (``s3://``, ``gs://``) take one process, each file assembled in memory and uploaded,
    the index last. ``names``/``transforms`` as for :func:`load` (the steps inverted, in
    reverse order); ``metadata`` goes in each file's ``__metadata__``. Every leaf is checked
    before anything is written: one that is not an array (None leaves are skipped) raises
    a ``SafetensorsError`` naming it.
    """
    loc = location(path)
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{loc.url}: metadata values must be strings, got {metadata!r}")
    leaves, specs = _save_leaves(tree, names, transforms, loc)
    dup = [n for n, c in collections.Counter(s[0] for s in specs).items() if c > 1]
    if dup:
        raise SafetensorsError(f"{loc.url}: several leaves map to tensor(s) {dup[:5]}; fix names=")
    files, placed = plan(specs, max_file_bytes, metadata)
    if not loc.is_local:
        if multihost.process_count() > 1:
            raise SafetensorsError(
                f"{loc.url}: a multi-process save needs a shared filesystem (processes write "
                "slices of one file in place); save there and copy, or save from one process"
            )
        _save_object_store(loc, leaves, files, placed, metadata)
        return
    agreed = multihost.agree(
        multihost.unique_name("safetensors"),
        {"path": loc.url, "leaves": len(specs), "files": [f.name for f in files]},
        timeout_s,
        what=loc.url,
        extra=uuid.uuid4().hex[:12],
    )
    if os.path.exists(loc.url):
        raise SafetensorsError(f"{loc.url} already exists; choose a new directory or delete it")
    lead = multihost.process_index() == 0
    with steps.committing(loc, agreed.first, marker=False) if lead else nullcontext():
        work = steps.work_dir(loc, agreed.first)
        if lead:
            create_files(work, files)
        multihost.barrier(f"jaxckpt/safetensors/{agreed.first}/created", timeout_s, what=loc.url)
        write_in_place(work, files, _writes(enumerate(leaves), placed))
        multihost.barrier(f"jaxckpt/safetensors/{agreed.first}/written", timeout_s, what=loc.url)
        if lead and len(files) > 1:
            work.write_bytes(INDEX_FILE, index_json(placed, metadata))
    multihost.barrier(f"jaxckpt/safetensors/{agreed.first}/committed", timeout_s, what=loc.url)


def _save_leaves(
    tree: Any, names: Names, transforms: Transforms, loc: Location
) -> tuple[list[Leaf], list[tuple[str, np.dtype, tuple[int, ...]]]]:
    """``(LeafMap, array)`` of every leaf, and ``(name, dtype, shape)`` of every tensor, in
    order; None leaves are skipped, any other leaf that is not an array is refused (before
    anything is written)."""
    out: list[Leaf] = []
    specs = []
    for path, v in tree_lib.flatten(tree):
        leaf = dotted(path)
        if v is None:
            continue
        if isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            raise SafetensorsError(
                f"{loc.url}: leaf {leaf!r} is a PRNG key; safetensors holds plain "
                "tensors: save jax.random.key_data(key) instead"
            )
        if not isinstance(v, (jax.Array, np.ndarray, np.generic)):
            raise SafetensorsError(
                f"{loc.url}: leaf {leaf!r} is a {type(v).__module__}.{type(v).__qualname__}, "
                "which safetensors cannot hold (it holds typed arrays); convert it with "
                "np.asarray(x, dtype) or take it out of the tree (None leaves are skipped)"
            )
        try:
            m = leaf_map(leaf, names, transforms)
            arr = v if isinstance(v, jax.Array) else np.asarray(v)
            dtype = m.cast or np.dtype(arr.dtype)
            dtype_name(dtype, f"leaf {leaf!r}")
            shape = m.tensor_shape(tuple(arr.shape))
            if m.stacked and not arr.ndim:
                raise SafetensorsError(f"leaf {leaf!r} is stacked (Stack) but a scalar")
        except SafetensorsError as e:
            raise type(e)(f"{loc.url}: {e}; nothing was written") from None
        out.append((m, arr))
        specs += [(name, dtype, shape) for name in m.names(arr.shape)]
    return out, specs


def _parts(m: LeafMap, v: jax.Array | np.ndarray, salt: int) -> Iterator[Part]:
    """``(box, host data)`` of the parts of ``v`` this process writes, one at a time. A
    NumPy leaf is written whole by one process (``salt`` spreads them). A chain of
    transforms that is not ``simple`` needs whole tensors: the leaf is gathered (every
    process takes part) and one process writes it."""
    if m.simple and isinstance(v, jax.Array):
        yield from _owned(v, salt)
        return
    writer = salt % multihost.process_count()
    if isinstance(v, jax.Array):
        # (jaxlib ships no stub for its compiled _jax.Device: mypy cannot see process_index)
        procs = {d.process_index for d in v.sharding.device_set}  # type: ignore[attr-defined]
        holders = sorted(procs)  # the same on every process
        if len(holders) == 1:  # on one process's devices: that process writes it whole
            writer = holders[0]
        else:
            v = _gather_bits(v)  # a collective: every process takes part
    if multihost.process_index() == writer:
        yield whole(v.shape), np.asarray(v)


def _gather_bits(v: jax.Array) -> np.ndarray:
    """The whole of ``v`` on every process, moved as bits (``bits``: CPU collectives quiet
    NaN payloads of narrow floats)."""
    dtype = np.dtype(v.dtype)
    if dtype == np.bool_:  # (a pred collective is not to be relied on either)
        return multihost_utils.process_allgather(v.astype(np.uint8), tiled=True).astype(bool)
    moved = multihost_utils.process_allgather(bits.to_bits([v], donate=False)[0], tiled=True)
    return np.asarray(moved).view(dtype)


def _owned(v: jax.Array, salt: int) -> Iterator[Part]:
    """``(box, host data)`` of the parts of ``v`` this process writes (one replica of each
    slice, spread over the replicas), one at a time."""
    shape, pid = tuple(v.shape), multihost.process_index()
    if not math.prod(shape):
        return
    split = write_split(v.sharding, shape, np.dtype(v.dtype).itemsize, None)
    for position, index in layout(v.sharding, shape).held_at:
        for region, group in split.parts[index]:
            if split.writer(index, group, salt) == pid:
                yield region, np.asarray(v.addressable_data(position))[within(region, index)]


def _blocks(parts: Iterable[Part], budget: int) -> Iterator[Part]:
    """The owned ``(box, data)`` parts of a leaf, joined into one block when they tile a box
    of at most ``budget`` bytes (one long write per row range, not one per row of each
    part); else as they come."""
    got = list(parts)
    block = bounding([b for b, _ in got]) if len(got) > 1 else None
    if (
        block is None
        or volume(block) != sum(volume(b) for b, _ in got)
        or volume(block) * got[0][1].itemsize > budget
    ):
        yield from got
        return
    out = np.empty(extent(block), got[0][1].dtype)
    for box, data in got:
        out[within(box, block)] = data
    yield block, out


def _writes(
    leaves: Iterable[tuple[int, Leaf]], placed: dict[str, TensorInfo]
) -> Iterator[tuple[str, int, memoryview]]:
    """``(file, offset, bytes)`` writes that put the parts of ``(salt, leaf)`` that this
    process writes in place."""
    for salt, (m, v) in leaves:
        tensors = [placed[name] for name in m.names(v.shape)]
        for box, data in _blocks(_parts(m, v, salt), WRITE_BLOCK_BYTES):
            for n, (t, at) in enumerate(tensor_runs(m, box, tensors)[1]):
                block = to_reshaped(m, data[n] if m.stacked else data).astype(t.dtype, copy=False)
                raw = np.ascontiguousarray(block).reshape(-1).view(np.uint8).data
                pos = 0
                for offset, length in at:
                    yield t.file, offset, raw[pos : pos + length]
                    pos += length


def _save_object_store(
    loc: Location,
    leaves: list[Leaf],
    files: list[FilePlan],
    placed: dict[str, TensorInfo],
    metadata: dict[str, str] | None,
) -> None:
    """Each file assembled in memory and uploaded whole, then the index (one process)."""
    kv = ts.KvStore.open(loc.kvstore()).result()
    for f in files:
        buf = bytearray(f.size)
        buf[: len(f.header)] = f.header
        inside = [
            (salt, (m, v))
            for salt, (m, v) in enumerate(leaves)
            if any(placed[name].file == f.name for name in m.names(v.shape))
        ]
        for file, offset, chunk in _writes(inside, placed):
            if file == f.name:
                buf[offset : offset + len(chunk)] = chunk
        kv.write(f.name, bytes(buf)).result()
    if len(files) > 1:
        kv.write(INDEX_FILE, index_json(placed, metadata)).result()
