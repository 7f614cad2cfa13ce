"""``metadata`` and ``load`` of :mod:`jaxckpt.safetensors` (its docstring says how names and
transforms work); ``save`` is in ``safetensors_save``."""

from __future__ import annotations

import collections
import difflib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ..errors import LeafNotFoundError, SafetensorsError, ShapeMismatchError
from . import tree as tree_lib
from .placement import Placement
from .safetensors_format import (
    INDEX_FILE,
    TensorInfo,
    checked,
    coalesce,
    read_header,
    runs,
)
from .safetensors_map import (
    LeafMap,
    Names,
    Transforms,
    bounding,
    dotted,
    from_reshaped,
    leaf_map,
    tensor_boxes,
    volume,
)
from .sharding import Index
from .storage import Location, location

READ_BUDGET_BYTES = 128 << 20


# --- metadata and load -------------------------------------------------------------------------


def _files(path: str | os.PathLike | Sequence) -> tuple[Location, list[str]]:
    """The directory and the ``.safetensors`` files of ``path``."""
    if isinstance(path, (list, tuple)):
        locs = [location(p) for p in path]
        parent = locs[0].parent()
        if any(p.parent() != parent for p in locs):
            raise SafetensorsError(f"{[p.url for p in locs]}: the files must share one directory")
        return parent, [p.name for p in locs]
    loc = location(path)
    if loc.name.endswith(".safetensors"):
        return loc.parent(), [loc.name]
    index = loc.read_bytes(INDEX_FILE)
    if index is not None:
        try:
            weight_map = json.loads(index)["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise SafetensorsError(f"{loc.url}/{INDEX_FILE} is not a valid index ({e})") from e
        return loc, sorted(set(weight_map.values()))
    found = [n for n in loc.list_children() if n.endswith(".safetensors")]
    if not found:
        raise SafetensorsError(
            f"{loc.url} holds no .safetensors file and no {INDEX_FILE}; pass a file, a "
            "directory in the Hugging Face layout or a list of files"
        )
    return loc, found


def _headers(path) -> tuple[Location, ts.KvStore, dict[str, TensorInfo], dict]:
    """The directory of ``path``, its kvstore, and the tensors and ``__metadata__`` of all
    its files."""
    loc, files = _files(path)
    kv = ts.KvStore.open(loc.kvstore()).result()
    tensors: dict[str, TensorInfo] = {}
    meta: dict = {}
    for f in files:
        file_tensors, file_meta = read_header(kv, f, loc.url)
        tensors.update(file_tensors)
        meta.update(file_meta)
    return loc, kv, tensors, meta


def metadata(path: str | os.PathLike | Sequence) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape, file and bytes, from the headers alone (no data read).
    ``__metadata__`` of the files is under the key ``"__metadata__"`` (a dict)."""
    _, _, tensors, meta = _headers(path)
    return {**tensors, "__metadata__": meta}


@dataclass(frozen=True)
class _Want:
    m: LeafMap
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None
    tensors: list[TensorInfo]


def load(
    path: str | os.PathLike | Sequence,
    target: Any,
    *,
    names: Names = None,
    transforms: Transforms = None,
    read_budget_bytes: int | None = None,
) -> Any:
    """Reads safetensors tensors into a pytree shaped like ``target``.

    ``path``: one file, a directory (with ``model.safetensors.index.json``, or its
    ``.safetensors`` files), or a list of files; local, ``s3://`` or ``gs://``. ``target``
    leaves: ``jax.ShapeDtypeStruct`` with a sharding, ``jax.Array``, or NumPy arrays (NumPy
    results); other leaves are returned as they are. Each process reads only the byte
    ranges its devices need, at most ``read_budget_bytes`` (default 128 MiB) in flight.
    """
    loc, kv, tensors, _ = _headers(path)
    flat = tree_lib.flatten(target)
    wants: list[_Want | None] = [
        _want(p, t, tensors, names, transforms, loc) if _is_array(t) else None for p, t in flat
    ]
    reader = _Reader(kv, loc.url, read_budget_bytes or READ_BUDGET_BYTES)
    finish = [
        reader.leaf(w) if w is not None else (lambda t=t: t)
        for w, (_, t) in zip(wants, flat, strict=True)
    ]
    reader.drain()
    return tree_lib.unflatten_like(target, [f() for f in finish])


def _is_array(t: Any) -> bool:
    return isinstance(t, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))


def _want(path, t, tensors, names, transforms, loc: Location) -> _Want:
    m = leaf_map(dotted(path), names, transforms)
    shape, dtype = tuple(t.shape), np.dtype(t.dtype)
    count = shape[0] if m.stacked and shape else 1
    found = []
    for name in m.names(count):
        info = tensors.get(name)
        if info is None:
            close = difflib.get_close_matches(name, list(tensors), n=3, cutoff=0.5)
            raise LeafNotFoundError(
                f"{loc.url}: leaf {m.leaf!r} needs tensor {name!r}, which the files do not "
                f"hold (closest: {close or sorted(tensors)[:3]}); fix names= or the target"
            )
        found.append(info)
    first = found[0]
    if any(f.shape != first.shape or f.dtype != first.dtype for f in found):
        raise ShapeMismatchError(
            f"{loc.url}: the tensors stacked into leaf {m.leaf!r} differ in shape or dtype"
        )
    if m.reshape and tuple(m.reshape.file_shape) != first.shape:
        raise ShapeMismatchError(
            f"{loc.url}/{first.file}: tensor {first.name!r} has shape {list(first.shape)}, "
            f"but leaf {m.leaf!r}'s Reshape expects {list(m.reshape.file_shape)}"
        )
    got = m.leaf_shape(first.shape, count)
    if got != shape:
        raise ShapeMismatchError(
            f"{loc.url}/{first.file}: tensor {first.name!r} of shape {list(first.shape)} gives "
            f"leaf {m.leaf!r} shape {list(got)} after the transforms, but the target has "
            f"{list(shape)}; fix the target or the transforms"
        )
    if _kind(first.dtype) != _kind(dtype) and m.cast is None:
        raise SafetensorsError(
            f"{loc.url}/{first.file}: tensor {first.name!r} is {first.dtype}, leaf {m.leaf!r} "
            f"is {dtype}; add a Cast transform to convert across kinds"
        )
    sharding = None if isinstance(t, np.ndarray) else getattr(t, "sharding", None)
    return _Want(m, shape, dtype, sharding, found)


def _kind(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    return "int" if np.issubdtype(dtype, np.integer) else "float"


class _Reader:
    """Reads boxes of leaves as coalesced byte ranges, at most ``budget`` bytes in flight."""

    def __init__(self, kv: ts.KvStore, url: str, budget: int):
        self.kv, self.url, self.budget = kv, url, budget
        self.pending: collections.deque = collections.deque()
        self.bytes = 0

    def leaf(self, w: _Want) -> Callable[[], Any]:
        holder: dict = {}
        whole = tuple((0, d) for d in w.shape)
        if w.sharding is None:
            self._submit(w, whole, lambda data: holder.__setitem__("v", data))
            return lambda: holder["v"]
        out = Placement(w.sharding, w.shape, w.dtype)
        put, by_index = out.put, out.indices
        block = bounding(by_index)
        itemsize = w.tensors[0].dtype.itemsize
        if block == whole and volume(block) * itemsize <= self.budget // 2:
            # this process needs the whole leaf: one read, and jax slices it onto the devices
            self._submit(
                w, block, lambda data: holder.__setitem__("v", jax.device_put(data, w.sharding))
            )
            return lambda: holder["v"]
        if block is not None and volume(block) * itemsize <= self.budget // 2:
            # the slices this process needs, read together (a few long runs, not one short
            # run per row of every slice) and cut on the host
            def cut(data, block=block):
                for i in by_index:
                    part = tuple(
                        slice(a - s, b - s) for (a, b), (s, _) in zip(i, block, strict=True)
                    )
                    put(i, np.ascontiguousarray(data[part]))

            self._submit(w, block, cut)
        else:
            for index in by_index:
                self._submit(w, index, lambda data, i=index: put(i, data))

        return out.array

    def _submit(self, w: _Want, box: Index, consume) -> None:
        parts = []
        nbytes = 0
        for i, rbox in tensor_boxes(w.m, box):
            info = w.tensors[i]
            rshape = w.m.reshape.shape if w.m.reshape else info.shape
            # absolute offsets in the file
            pieces = [(info.begin + off, n) for off, n in runs(rshape, info.dtype.itemsize, rbox)]
            reads = [
                (self.kv.read(info.file, byte_range=slice(off, off + n)), off, n, members)
                for off, n, members in coalesce(pieces)
            ]
            parts.append((info, rbox, reads))
            nbytes += sum(n for _, n in pieces)
        while self.pending and self.bytes + nbytes > self.budget:
            self._finish_oldest()
        self.pending.append((w, box, parts, consume, nbytes))
        self.bytes += nbytes

    def _finish_oldest(self) -> None:
        w, box, parts, consume, nbytes = self.pending.popleft()
        blocks = []
        for info, rbox, reads in parts:
            extent = tuple(b - a for a, b in rbox)
            if len(reads) == 1 and len(reads[0][3]) == 1:  # one run: the read is the block
                fut, off, n, _ = reads[0]
                buf = checked(fut.result(), info.file, off, n, self.url)
            else:
                buf = np.empty(math.prod(extent) * info.dtype.itemsize, np.uint8)
                pos = 0
                for fut, off, n, members in reads:
                    data = checked(fut.result(), info.file, off, n, self.url)
                    for moff, mn in members:
                        buf[pos : pos + mn] = np.frombuffer(
                            data[moff - off : moff - off + mn], np.uint8
                        )
                        pos += mn
            block = np.frombuffer(buf, dtype=info.dtype).reshape(extent)
            blocks.append(from_reshaped(w.m, block))
        data = np.stack(blocks) if w.m.stacked else blocks[0]
        consume(data.astype(w.dtype, copy=data.dtype != w.dtype))
        self.bytes -= nbytes

    def drain(self) -> None:
        while self.pending:
            self._finish_oldest()
