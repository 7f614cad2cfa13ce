"""Hugging Face safetensors in and out of sharded pytrees, without gathering on one host.

``load`` reads, on each process, only the byte ranges of the tensors its devices need;
``save`` writes the HF sharded layout (``model-0000i-of-0000N.safetensors`` and
``model.safetensors.index.json``) with every process writing the slices it owns straight
into the files. ``names`` maps a leaf's path (its keys joined by ``.``) to a tensor name;
``transforms`` say how a tensor's layout differs from the leaf's:

>>> llama = [
...     (r"layers\\.(q|k|v|o)_proj\\.kernel$", [jaxckpt.safetensors.Stack(), Transpose((1, 0))]),
... ]
>>> params = jaxckpt.safetensors.load("hf_model/", abstract_params, names=rules, transforms=llama)

The ``safetensors`` package is not needed (it cannot read byte ranges from object stores nor
let several processes write slices of one file); files written here read back bit-exactly
with ``safetensors.numpy.load_file``.
"""

from __future__ import annotations

import collections
import difflib
import json
import math
import os
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from . import multihost
from . import tree as tree_lib
from .errors import LeafNotFoundError, ShapeMismatchError, UnsupportedLeafError
from .placement import Placement
from .safetensors_format import (
    INDEX_FILE,
    SafetensorsError,
    TensorInfo,
    checked,
    coalesce,
    index_json,
    plan,
    read_header,
    read_range,
    runs,
)
from .sharding import Index, layout, write_split
from .storage import Location, fsync_dir, location, rename_dir

__all__ = [
    "Cast",
    "Reshape",
    "SafetensorsError",
    "Stack",
    "TensorInfo",
    "Transpose",
    "load",
    "metadata",
    "save",
]

READ_BUDGET_BYTES = 128 << 20
WRITE_BLOCK_BYTES = 128 << 20  # a leaf's owned parts joined into one host block up to this


# --- the declarative mapping -----------------------------------------------------------------


@dataclass(frozen=True)
class Transpose:
    """The leaf is the tensor with its axes permuted (``np.transpose(tensor, axes)``); HF
    ``nn.Linear`` weights ``(out, in)`` are Flax ``Dense`` kernels with ``axes=(1, 0)``."""

    axes: tuple[int, ...]


@dataclass(frozen=True)
class Reshape:
    """The tensor, of ``file_shape`` in the file, reshaped to ``shape`` (before any
    Transpose), e.g. fused heads ``(heads * head_dim, d)`` -> ``(heads, head_dim, d)``."""

    file_shape: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Cast:
    """Stored in the file as ``dtype`` (``save``); on ``load`` it permits a cast across
    kinds (int <-> float). Loads always cast to the target's dtype within a kind."""

    dtype: Any


@dataclass(frozen=True)
class Stack:
    """The leaf's leading axis runs over tensors whose name has ``{i}`` (scanned layers:
    ``model.layers.{i}.mlp.up_proj.weight``), ``i`` from 0."""


Transform = Transpose | Reshape | Cast | Stack
Names = Callable[[str], str] | Sequence[tuple[str, str]] | None
Transforms = Callable[[str], Sequence[Transform]] | Sequence[tuple[str, Any]] | None


@dataclass(frozen=True)
class LeafMap:
    """How one leaf relates to its tensor(s)."""

    leaf: str  # the leaf's path, keys joined by "."
    tensor: str  # the tensor name; with ``stacked``, a pattern with "{i}"
    stacked: bool
    reshape: Reshape | None
    axes: tuple[int, ...] | None
    cast: np.dtype | None

    def names(self, count: int) -> list[str]:
        return [self.tensor.format(i=i) for i in range(count)] if self.stacked else [self.tensor]

    def tensor_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one tensor in the file, for a leaf of ``leaf_shape``."""
        shape = leaf_shape[1:] if self.stacked else leaf_shape
        if self.axes is not None:
            shape = tuple(shape[self.axes.index(d)] for d in range(len(shape)))
        return self.reshape.file_shape if self.reshape else tuple(shape)

    def leaf_shape(self, tensor_shape: tuple[int, ...], count: int) -> tuple[int, ...]:
        shape = self.reshape.shape if self.reshape else tensor_shape
        if self.axes is not None:
            shape = tuple(shape[a] for a in self.axes)
        return (count, *shape) if self.stacked else tuple(shape)


def leaf_map(path: str, names: Names, transforms: Transforms) -> LeafMap:
    if callable(names):
        tensor = names(path)
    else:
        tensor = path
        for pattern, repl in names or ():
            tensor = re.sub(pattern, repl, tensor)
    if callable(transforms):
        chain = list(transforms(path) or ())
    else:
        chain = next(
            (
                list(t) if isinstance(t, (list, tuple)) else [t]
                for p, t in transforms or ()
                if re.search(p, path)
            ),
            [],
        )
    reshape = next((t for t in chain if isinstance(t, Reshape)), None)
    body = [t for t in chain if not isinstance(t, (Stack, Cast))]
    if reshape is not None and body.index(reshape) != 0:
        raise SafetensorsError(f"leaf {path!r}: Reshape must come before Transpose in {chain}")
    axes = next((tuple(t.axes) for t in chain if isinstance(t, Transpose)), None)
    cast = next((np.dtype(jax.numpy.dtype(t.dtype)) for t in chain if isinstance(t, Cast)), None)
    stacked = any(isinstance(t, Stack) for t in chain)
    if stacked and "{i}" not in tensor:
        raise SafetensorsError(
            f"leaf {path!r} is stacked (Stack) but its tensor name {tensor!r} has no '{{i}}'"
        )
    return LeafMap(path, tensor, stacked, reshape, axes, cast)


def _dotted(path: list) -> str:
    return ".".join(str(k) for _, k in path)


# --- slices of a leaf <-> byte runs of its tensors ---------------------------------------------


def tensor_boxes(m: LeafMap, box: Index) -> list[tuple[int, Index]]:
    """``(tensor number, box in the tensor's reshaped layout)`` for a box of the leaf."""
    (lo, hi), inner = (box[0], box[1:]) if m.stacked else ((0, 1), box)
    if m.axes is not None:
        inner = tuple(inner[m.axes.index(d)] for d in range(len(inner)))
    return [(i, inner) for i in range(lo, hi)]


def _from_reshaped(m: LeafMap, block: np.ndarray) -> np.ndarray:
    return block if m.axes is None else np.transpose(block, m.axes)


def _to_reshaped(m: LeafMap, block: np.ndarray) -> np.ndarray:
    return block if m.axes is None else np.transpose(block, np.argsort(m.axes))


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


def metadata(path: str | os.PathLike | Sequence) -> dict[str, TensorInfo]:
    """Every tensor's dtype, shape, file and bytes, from the headers alone (no data read).
    ``__metadata__`` of the files is under the key ``"__metadata__"`` (a dict)."""
    loc, files = _files(path)
    kv = ts.KvStore.open(loc.kvstore()).result()
    out: dict[str, Any] = {}
    meta: dict = {}
    for f in files:
        tensors, m = read_header(kv, f, loc.url)
        out.update(tensors)
        meta.update(m)
    out["__metadata__"] = meta
    return out


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
    loc, files = _files(path)
    kv = ts.KvStore.open(loc.kvstore()).result()
    tensors: dict[str, TensorInfo] = {}
    for f in files:
        tensors.update(read_header(kv, f, loc.url)[0])
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
    m = leaf_map(_dotted(path), names, transforms)
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


def _volume(box: Index) -> int:
    return math.prod(b - a for a, b in box)


def _bounding(boxes: list[Index]) -> Index | None:
    """The box around ``boxes`` when they tile it with at most 1.5x its volume needed
    elsewhere (replicas counted once), else None."""
    if not boxes or not boxes[0]:
        return None
    box = tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0]))
    )
    return box if _volume(box) <= 1.5 * sum(_volume(b) for b in set(boxes)) else None


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
        if w.sharding is None:
            whole = tuple((0, d) for d in w.shape)
            self._submit(w, whole, lambda data: holder.__setitem__("v", data))
            return lambda: holder["v"]
        out = Placement(w.sharding, w.shape, w.dtype)
        put, by_index = out.put, out.indices
        block = _bounding(by_index)
        itemsize = w.tensors[0].dtype.itemsize
        whole = tuple((0, d) for d in w.shape)
        if block == whole and _volume(block) * itemsize <= self.budget // 2:
            # this process needs the whole leaf: one read, and jax slices it onto the devices
            self._submit(
                w, block, lambda data: holder.__setitem__("v", jax.device_put(data, w.sharding))
            )
            return lambda: holder["v"]
        if block is not None and _volume(block) * itemsize <= self.budget // 2:
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
            pieces = runs(rshape, info.dtype.itemsize, rbox)
            reads = [
                (read_range(self.kv, info.file, info.begin + off, n, self.url), off, n, members)
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
                buf = checked(fut.result(), info.file, info.begin + off, n, self.url)
            else:
                buf = np.empty(math.prod(extent) * info.dtype.itemsize, np.uint8)
                pos = 0
                for fut, off, n, members in reads:
                    data = checked(fut.result(), info.file, info.begin + off, n, self.url)
                    for moff, mn in members:
                        buf[pos : pos + mn] = np.frombuffer(
                            data[moff - off : moff - off + mn], np.uint8
                        )
                        pos += mn
            block = np.frombuffer(buf, dtype=info.dtype).reshape(extent)
            blocks.append(_from_reshaped(w.m, block))
        data = np.stack(blocks) if w.m.stacked else blocks[0]
        consume(data.astype(w.dtype, copy=data.dtype != w.dtype))
        self.bytes -= nbytes

    def drain(self) -> None:
        while self.pending:
            self._finish_oldest()


# --- save ---------------------------------------------------------------------------------------


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
    the index last. ``names``/``transforms`` as for :func:`load`; ``metadata`` goes in each
    file's ``__metadata__``.
    """
    loc = location(path)
    if metadata is not None and not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{loc.url}: metadata values must be strings, got {metadata!r}")
    leaves = [(m, v) for m, v in _save_leaves(tree, names, transforms, loc)]
    specs = [
        (name, m.cast or np.dtype(v.dtype), m.tensor_shape(tuple(v.shape)))
        for m, v in leaves
        for name in m.names(v.shape[0] if m.stacked else 1)
    ]
    if len({s[0] for s in specs}) != len(specs):
        dup = [n for n, c in collections.Counter(s[0] for s in specs).items() if c > 1]
        raise SafetensorsError(f"{loc.url}: several leaves map to tensor(s) {dup[:5]}; fix names=")
    files, placed = plan(specs, max_file_bytes, metadata)
    count = multihost.process_count()
    if not loc.is_local:
        if count > 1:
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
    work = loc.parent().join(f"{loc.name}.tmp-{agreed.first}")
    if multihost.process_index() == 0:
        work.makedirs()
        for f in files:
            with open(os.path.join(work.url, f.name), "wb") as fh:
                fh.write(f.header)
                fh.truncate(f.size)
    multihost.barrier(f"jaxckpt/safetensors/{agreed.first}/created", timeout_s, what=loc.url)
    fds = {f.name: os.open(os.path.join(work.url, f.name), os.O_WRONLY) for f in files}
    try:
        for salt, (m, v) in enumerate(leaves):
            for box, data in _blocks(_owned(v, salt), WRITE_BLOCK_BYTES):
                for file, offset, chunk in _placements(m, box, data, placed):
                    os.pwrite(fds[file], chunk, offset)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    multihost.barrier(f"jaxckpt/safetensors/{agreed.first}/written", timeout_s, what=loc.url)
    if multihost.process_index() == 0:
        if len(files) > 1:
            work.write_bytes(INDEX_FILE, index_json(files, placed, metadata))
        rename_dir(work, loc)
        fsync_dir(loc.parent().url)
    multihost.barrier(f"jaxckpt/safetensors/{agreed.first}/committed", timeout_s, what=loc.url)


def _save_leaves(tree, names, transforms, loc: Location):
    for path, v in tree_lib.flatten(tree):
        if isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            raise UnsupportedLeafError(
                f"{loc.url}: leaf {_dotted(path)!r} is a PRNG key; safetensors holds plain "
                "tensors: save jax.random.key_data(key) instead"
            )
        if isinstance(v, (jax.Array, np.ndarray, np.generic)):
            yield (
                leaf_map(_dotted(path), names, transforms),
                (v if isinstance(v, jax.Array) else np.asarray(v)),
            )


def _owned(v, salt: int):
    """``(box, host data)`` of the parts of ``v`` this process writes, one at a time."""
    shape, pid = tuple(v.shape), multihost.process_index()
    if isinstance(v, np.ndarray):
        if pid == salt % multihost.process_count():
            yield tuple((0, d) for d in shape), v
        return
    if not math.prod(shape):
        return
    split = write_split(v.sharding, shape, np.dtype(v.dtype).itemsize, None)
    for position, index in layout(v.sharding, shape).held_at:
        for region, group in split.parts[index]:
            if split.writer(index, group, salt) == pid:
                part = tuple(
                    slice(a - s, b - s) for (a, b), (s, _) in zip(region, index, strict=True)
                )
                yield region, np.asarray(v.addressable_data(position))[part]


def _blocks(parts, budget: int):
    """The owned ``(box, data)`` parts of a leaf, joined into one block when they tile a box
    of at most ``budget`` bytes (one long write per row range, not one per row of each
    part); else as they come."""
    parts = list(parts)
    block = _bounding([b for b, _ in parts]) if len(parts) > 1 else None
    if block is None or _volume(block) != sum(_volume(b) for b, _ in parts):
        yield from parts
        return
    dtype = parts[0][1].dtype
    if _volume(block) * dtype.itemsize > budget:
        yield from parts
        return
    out = np.empty(tuple(b - a for a, b in block), dtype)
    for box, data in parts:
        out[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(box, block, strict=True))] = data
    yield block, out


def _placements(m: LeafMap, box: Index, data: np.ndarray, placed):
    """``(file, offset, bytes)`` writes that put ``data`` (the leaf's ``box``) in place."""
    for n, (i, rbox) in enumerate(tensor_boxes(m, box)):
        name = m.tensor.format(i=i) if m.stacked else m.tensor
        t = placed[name]
        block = data[n] if m.stacked else data
        block = np.ascontiguousarray(_to_reshaped(m, block).astype(t.dtype, copy=False))
        rshape = m.reshape.shape if m.reshape else t.shape
        raw = memoryview(block.reshape(-1).view(np.uint8))
        pos = 0
        for off, length in runs(rshape, t.dtype.itemsize, rbox):
            yield t.file, t.begin + off, raw[pos : pos + length]
            pos += length


def _save_object_store(loc: Location, leaves, files, placed, metadata) -> None:
    kv = ts.KvStore.open(loc.kvstore()).result()
    for f in files:
        buf = bytearray(f.size)
        buf[: len(f.header)] = f.header
        for salt, (m, v) in enumerate(leaves):
            if not any(placed[n].file == f.name for n in m.names(v.shape[0] if m.stacked else 1)):
                continue
            for box, data in _owned(v, salt):
                for file, offset, chunk in _placements(m, box, data, placed):
                    if file == f.name:
                        buf[offset : offset + len(chunk)] = chunk
        kv.write(f.name, bytes(buf)).result()
    if len(files) > 1:
        kv.write(INDEX_FILE, index_json(files, placed, metadata)).result()
