"""Which slices of a restore the direct read path (``direct``) reads, and where each of
their chunks' bytes are.

A chunk qualifies where it is stored raw (codecs ``bytes`` little-endian then ``crc32c``:
no compression; a dtype whose bytes are all the value's), as a value of its own in a data
file (not inline in a B-tree node) of the length the codecs give, inside the checkpoint's
directory. A slice is read *whole* where its chunks are contiguous regions of its buffer (a
whole saved shard, or a run of whole rows of it), *in part* where it cuts through chunks (a
restore onto another mesh, an edge chunk zarr padded). ``plan_slices`` finds them with one
B-tree walk (``index``) for every chunk's place and every leaf's ``zarr.json``; anything
else is left to TensorStore.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import ml_dtypes
import numpy as np
import tensorstore as ts

from ...errors import StorageError
from .. import boxes
from ..boxes import Index
from ..storage import Location
from . import arrays
from .layout import TRAILER

if TYPE_CHECKING:
    from ..manifest import LeafRecord

PART_CHUNK_BYTES = 64 << 20
"""The largest chunk read whole into a thread's scratch buffer when a slice needs only part
of it; a larger one is left to TensorStore (each reader thread would hold one)."""


@dataclass(frozen=True)
class Layout:
    """How a leaf's chunks are stored, when the direct path can read them."""

    chunk_shape: tuple[int, ...]
    dtype: np.dtype  # the buffer's dtype (the stored one: what TensorStore reads into)
    separator: str  # of the chunk keys: ``c/0/1`` ("/") or ``c.0.1`` (".")


def whole_bytes(dtype: np.dtype) -> bool:
    """Every bit of every byte is the value's (no bool, no sub-byte type padded to a byte)."""
    if dtype.kind in "iufc":
        return dtype.itemsize == 1 or (dtype.isnative and sys.byteorder == "little")
    if dtype.kind != "V":
        return False
    try:
        return int(ml_dtypes.finfo(dtype).bits) == dtype.itemsize * 8
    except (ValueError, TypeError):
        return False


def raw_layout(metadata: dict, dtype: np.dtype) -> Layout | None:
    """The layout of a zarr array stored raw (codecs ``bytes``, little-endian, then
    ``crc32c``; a regular grid; the default chunk keys), from its metadata; else None.
    ``dtype``: the stored one. (The writer's test and the reader's: ``ocdbt_write``, ``layout``.)"""
    codecs = metadata.get("codecs") or [{}]
    names = [c.get("name") for c in codecs]
    # (TensorStore drops the byte order of 1-byte types)
    endian = (codecs[0].get("configuration") or {}).get("endian", "little")
    grid = metadata.get("chunk_grid", {})
    keys = metadata.get("chunk_key_encoding", {})
    if (
        names != ["bytes", "crc32c"]
        or endian != "little"
        or grid.get("name") != "regular"
        or keys.get("name") != "default"
    ):
        return None
    chunk_shape = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
    separator = keys.get("configuration", {}).get("separator", "/")
    if len(chunk_shape) != len(metadata["shape"]) or min(chunk_shape, default=1) < 1:
        return None
    return Layout(chunk_shape, dtype, separator)


def layout(store: ts.TensorStore) -> Layout | None:
    """The leaf's layout from its zarr metadata, or None when the direct path can't read it
    (not stored raw, or a dtype whose bytes are not all the value's)."""
    dtype = store.dtype.numpy_dtype
    lay = raw_layout(store.spec().to_json().get("metadata", {}), dtype)
    return lay if lay is not None and whole_bytes(dtype) else None


@functools.lru_cache(maxsize=1024)
def stored_layout(zarr_json: bytes, shape: tuple[int, ...], saved: np.dtype) -> Layout | None:
    """The layout of a leaf from its ``zarr.json`` as stored (read in the B-tree walk, no
    TensorStore open), or None when the direct path can't read it or the metadata is not of
    the leaf the manifest describes: its shape, and its data type the ``saved`` one or, for
    an ``ml_dtypes`` type zarr lacks, the unsigned carrier of its bytes. (TensorStore reads
    such a leaf, and names what is wrong.) Remembered: leaves of one shape and dtype have
    the same ``zarr.json``, and parsing each was a third of a direct plan."""
    try:
        metadata = json.loads(zarr_json)
        name = metadata["data_type"]
        dtype = np.dtype(getattr(ml_dtypes, name) if hasattr(ml_dtypes, name) else name)
        if [int(n) for n in metadata["shape"]] != list(shape):
            return None
        lay = raw_layout(metadata, dtype)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    carrier = saved.kind == "V" and dtype.kind == "u" and dtype.itemsize == saved.itemsize
    if lay is None or not whole_bytes(dtype) or not (dtype == saved or carrier):
        return None
    return lay


def leaf_layout(
    inline: Mapping[str, bytes], rec: LeafRecord, store: Callable[[], Any]
) -> Layout | None:
    """The layout of the leaf ``rec``: from its ``zarr.json`` where the B-tree walk found it
    stored inline (``index``; no TensorStore open), else from its TensorStore (``store()``,
    which opens it); None where the direct path can't read it or the leaf won't open
    (TensorStore's read of it then raises, naming the leaf)."""
    stored = inline.get(f"{rec.name}/zarr.json")
    try:
        if stored is None:
            return layout(store())
        return stored_layout(stored, tuple(rec.shape), rec.data_dtype)
    except Exception:
        return None


def plan_slices(
    db: Location, slices: Iterable[tuple[Hashable, LeafRecord, Index, Callable[[], Any]]]
) -> dict[Hashable, SliceRead]:
    """The slices (key, leaf record, index, the leaf's TensorStore when needed) that the
    direct path reads, by key: one B-tree walk (``index``) for every chunk's place and every
    leaf's ``zarr.json``, each leaf's layout once (``leaf_layout``: no TensorStore open,
    whose spec a restore of many leaves would otherwise ask for each slice).
    None planned where the B-tree can't be walked (TensorStore's reads raise it, naming the
    leaf); raises StorageError where it names a file outside the database (``plan``)."""
    try:
        where, inline = index(db)
    except Exception:
        return {}
    layouts: dict[str, Layout | None] = {}
    wanted: dict[Hashable, Wanted] = {}
    for key, rec, box, store in slices:
        if rec.name not in layouts:
            layouts[rec.name] = leaf_layout(inline, rec, store)
        lay = layouts[rec.name]
        if lay is not None:
            wanted[key] = Wanted(rec.name, lay, box)
    return plan(db, wanted, where)


def index(db: Location) -> tuple[dict[str, arrays.ChunkBytes], dict[str, bytes]]:
    """One walk of the B-tree of ``db``: every key's ``arrays.ChunkBytes`` and the bytes of
    the values stored inline (``arrays.btree``), for ``stored_layout`` and ``plan``."""
    return arrays.btree(ts.KvStore.open(db.kvstore()).result(), db)


def chunks_in(index: Index, lay: Layout) -> list[tuple[tuple[int, ...], int]] | None:
    """The chunks that make up slice ``index`` and each one's byte offset in the slice's
    buffer; None unless each lies whole inside the slice as one contiguous region."""
    if any(a % c or b % c for (a, b), c in zip(index, lay.chunk_shape, strict=True)):
        return None  # the slice cuts through a chunk (or ends in an edge chunk zarr padded)
    extent = [b - a for a, b in index]
    big = [i for i, c in enumerate(lay.chunk_shape) if c > 1]
    if big and any(lay.chunk_shape[i] != extent[i] for i in range(big[0] + 1, len(extent))):
        return None  # a chunk would be strided in the buffer
    strides = [math.prod(extent[i + 1 :]) * lay.dtype.itemsize for i in range(len(extent))]
    grid = [range(a // c, b // c) for (a, b), c in zip(index, lay.chunk_shape, strict=True)]
    starts = [a for a, _ in index]
    return [
        (
            g,
            sum(
                (gi * c - a) * s
                for gi, c, a, s in zip(g, lay.chunk_shape, starts, strides, strict=True)
            ),
        )
        for g in itertools.product(*grid)
    ]


def chunk_parts(index: Index, lay: Layout) -> list[tuple[tuple[int, ...], Index, Index]]:
    """Every chunk that slice ``index`` overlaps: its grid coordinates, its box and the
    part of it the slice needs (both in the array's coordinates). Edge chunks are stored
    whole (zarr pads them), so every part lies inside its chunk's stored bytes."""
    out = []
    for g in boxes.chunks_in(index, lay.chunk_shape):
        chunk = tuple((i * c, (i + 1) * c) for i, c in zip(g, lay.chunk_shape, strict=True))
        part = boxes.intersect(chunk, index)
        if part is not None:
            out.append((g, chunk, part))
    return out


def chunk_key(name: str, coords: Sequence[int], separator: str) -> str:
    """The OCDBT key of a chunk of leaf ``name`` (zarr v3's default chunk key encoding)."""
    return f"{name}/c" + "".join(f"{separator}{c}" for c in coords)


class ChunkRead(NamedTuple):
    """One chunk: its key, where its bytes are, where they go in the slice's buffer. (A
    tuple, as the records below: a restore plans one for every chunk it reads.)"""

    key: str
    at: arrays.ChunkBytes
    offset: int
    nbytes: int  # without the 4-byte trailer


class ChunkPart(NamedTuple):
    """One chunk of a slice that cuts through it: its key, where its bytes are, the part of
    it the slice needs (``src``, the chunk's coordinates) and where that goes (``dst``)."""

    key: str
    at: arrays.ChunkBytes
    nbytes: int  # the whole chunk's, without the 4-byte trailer
    chunk_shape: tuple[int, ...]
    src: tuple[slice, ...]
    dst: tuple[slice, ...]


class SliceRead(NamedTuple):
    """One slice read directly: the buffer to allocate and the chunks that fill it, whole
    (``chunks``: each a contiguous region of the buffer) or in part (``parts``)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[ChunkRead, ...]
    parts: tuple[ChunkPart, ...] = ()


@dataclass(frozen=True)
class Wanted:
    """A slice a restore asks for: the leaf, its layout and the slice's box."""

    name: str
    layout: Layout
    index: Index


Slices = tuple[slice, ...]


class _Box(NamedTuple):
    """What ``plan`` finds for one box of one layout, the same for every leaf of it: the
    slice's shape; its whole chunks (each one's key after the leaf's name, its offset in
    the slice's buffer) or the parts of chunks it needs (each one's key after the name,
    its part in the chunk's coordinates and in the slice's); neither where the direct
    path can't read it, nor where the box is empty."""

    shape: tuple[int, ...]
    whole: list[tuple[str, int]] | None
    parts: list[tuple[str, Slices, Slices]] | None


def _box(index: Index, lay: Layout) -> _Box:
    shape = tuple(b - a for a, b in index)
    if not all(shape):
        return _Box(shape, None, None)  # nothing to read
    found = chunks_in(index, lay)
    if found:
        return _Box(shape, [(chunk_key("", g, lay.separator), off) for g, off in found], None)
    if math.prod(lay.chunk_shape) * lay.dtype.itemsize > PART_CHUNK_BYTES:
        return _Box(shape, None, None)
    parts = [
        (chunk_key("", g, lay.separator), boxes.within(part, chunk), boxes.within(part, index))
        for g, chunk, part in chunk_parts(index, lay)
    ]
    return _Box(shape, None, parts)


def plan(
    db: Location,
    wanted: dict[Hashable, Wanted],
    where: dict[str, arrays.ChunkBytes] | None = None,
) -> dict[Hashable, SliceRead]:
    """The slices of ``wanted`` that can be read directly, by the same keys: one walk of the
    B-tree for all their chunks (or ``where``, a walk's result: ``index``). Raises
    StorageError when the B-tree points outside the database's directory."""
    whole: dict[Hashable, tuple[Wanted, tuple[int, ...], list[tuple[str, int]]]] = {}
    cut: dict[Hashable, tuple[Wanted, tuple[int, ...], list[tuple[str, Slices, Slices]]]] = {}
    seen: dict[tuple[Index, Layout], _Box] = {}  # (the leaves of a state share a few of each)
    for k, w in wanted.items():
        at = (w.index, w.layout)
        box = seen.get(at)
        if box is None:
            box = seen[at] = _box(w.index, w.layout)
        name = w.name
        if box.whole is not None:
            whole[k] = (w, box.shape, [(name + key, off) for key, off in box.whole])
        elif box.parts is not None:
            cut[k] = (w, box.shape, [(name + key, src, dst) for key, src, dst in box.parts])
    if not whole and not cut:
        return {}
    if where is None:
        keys = {key for _, _, ks in whole.values() for key, _ in ks}
        keys |= {key for _, _, ks in cut.values() for key, _, _ in ks}
        where = arrays.chunk_bytes(ts.KvStore.open(db.kvstore()).result(), db, keys)
    sizes = _file_sizes(db, {at.file for at in where.values() if not at.inline})
    out: dict[Hashable, SliceRead] = {}
    for k, (w, shape, ks) in whole.items():
        nbytes = math.prod(w.layout.chunk_shape) * w.layout.dtype.itemsize
        reads: list[ChunkRead] = []
        direct = True  # every chunk in the B-tree, a value of its own (else TensorStore's)
        for key, off in ks:
            where_ = where.get(key)
            if where_ is None:
                direct = False
                continue
            _check_inside(w.name, key, where_, sizes)
            direct = direct and _plain(where_, nbytes)
            reads.append(ChunkRead(key, where_, off, nbytes))
        if direct:
            out[k] = SliceRead(shape, w.layout.dtype, tuple(reads))
    for k, (w, shape, cs) in cut.items():
        nbytes = math.prod(w.layout.chunk_shape) * w.layout.dtype.itemsize
        chunk_shape = w.layout.chunk_shape
        got = [
            ChunkPart(key, where[key], nbytes, chunk_shape, s, d)
            for key, s, d in cs
            if key in where
        ]
        for p in got:
            _check_inside(w.name, p.key, p.at, sizes)
        if len(got) == len(cs) and all(_plain(p.at, p.nbytes) for p in got):
            out[k] = SliceRead(shape, w.layout.dtype, (), tuple(got))
    return out


def _plain(at: arrays.ChunkBytes, nbytes: int) -> bool:
    """A value of its own, of the length the codecs give."""
    return not at.inline and at.stop - at.start == nbytes + TRAILER


def _check_inside(leaf: str, key: str, at: arrays.ChunkBytes, sizes: dict[str, int]) -> None:
    """Raises StorageError when the chunk's bytes end past its data file's end (TensorStore
    would fail too, without naming the file)."""
    if at.inline or at.stop <= sizes[at.file]:
        return
    size = sizes[at.file]
    has = "is missing" if size < 0 else f"holds only {size} bytes"
    raise StorageError(
        f"leaf {leaf!r}: chunk {key!r} is bytes {at.start}-{at.stop - 1} of the data "
        f"file {at.file}, which {has}: the checkpoint was truncated or damaged; restore "
        "another step or re-save"
    )


def _file_sizes(db: Location, files: set[str]) -> dict[str, int]:
    """Each data file's size, after checking it lies inside the database's directory (its
    name comes from the B-tree: untrusted input)."""
    root = os.path.realpath(db.url)
    sizes = {}
    for f in files:
        real = os.path.realpath(f)
        if os.path.commonpath([root, real]) != root:
            raise StorageError(
                f"{db.url}: the OCDBT B-tree names the data file {f!r}, which resolves to "
                f"{real!r}, outside the checkpoint's arrays directory; the checkpoint is "
                "damaged or hostile: restore another step or re-save"
            )
        try:
            sizes[f] = os.stat(real).st_size
        except OSError:
            sizes[f] = -1  # missing
    return sizes
