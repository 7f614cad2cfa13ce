"""The direct read path: a local checkpoint's chunks read with ``os.preadv`` straight into
the destination buffer, their CRC32C checked as they arrive; TensorStore is the fallback.

TensorStore's read of a chunk passes over its bytes two or three times (the OCDBT value,
the CRC32C, the zarr decode, a copy into our buffer). Where a chunk is stored raw (codecs
``bytes`` little-endian then ``crc32c``: no compression), as a value of its own in a data
file (not inline in a B-tree node) and is a contiguous region of the slice being read (a
whole saved shard, or a run of whole rows of it), its bytes can go where they belong in one
read: ``plan`` finds such slices (one B-tree walk for every chunk of a restore), ``Reader``
reads them. Chunks adjacent in a data file are read in one ``preadv``, their 4-byte CRC
trailers into a scratch array; each piece is checksummed right after it arrives, while it
is still in the CPU's cache. A slice that cuts through chunks (a restore onto another mesh)
or ends in an edge chunk zarr padded is read chunk by chunk instead: each whole chunk into
a scratch buffer of the reading thread, checksummed, and the part the slice needs copied
into place (a chunk must be read whole to check it; TensorStore reads it whole too); a chunk
that several slices need a part of is read and checked once for all of them. Anything
else (zstd, inline values, object stores, sub-byte or bool dtypes, a value of an unexpected
length or past its file's end) is read by TensorStore.
``JAXCKPT_DIRECT_READ=0`` turns the path off (for benchmarks and debugging).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import itertools
import json
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import crc32c
import ml_dtypes
import numpy as np
import tensorstore as ts

from ..errors import StorageError
from . import arrays, boxes, crc
from .boxes import Index, extent
from .storage import Location

if TYPE_CHECKING:
    from .manifest import LeafRecord

ENV = "JAXCKPT_DIRECT_READ"
PIECE_BYTES = 1 << 20  # read and checksummed at a time: stays in cache between the two
SPLIT_BYTES = 8 << 20  # a thread's share of a slice's whole chunks
PART_CHUNK_BYTES = 64 << 20
"""The largest chunk read whole into a thread's scratch buffer when a slice needs only part
of it; a larger one is left to TensorStore (each reader thread would hold one)."""
ADVICE_BYTES = 1 << 20  # prefetch advice goes by blocks of this many bytes, each once
KEEP_BYTES = 256 << 20
"""At most this many bytes of chunks kept for the other slices that need a part of them
(read once, checked once); a chunk past it is read again by each."""
_IOV_MAX = 1024  # Linux's limit on the buffers of one preadv
_TRAILER = 4  # the crc32c codec: a chunk's bytes, then their CRC32C, little-endian


def enabled(loc: Location) -> bool:
    """Whether restores from ``loc`` use the direct path (local files; the env var not 0)."""
    return loc.is_local and hasattr(os, "preadv") and os.environ.get(ENV, "1").strip() != "0"


# --- which slices qualify ----------------------------------------------------------------


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


def stored_layout(zarr_json: bytes, shape: Sequence[int], saved: np.dtype) -> Layout | None:
    """The layout of a leaf from its ``zarr.json`` as stored (read in the B-tree walk, no
    TensorStore open), or None when the direct path can't read it or the metadata is not of
    the leaf the manifest describes: its shape, and its data type the ``saved`` one or, for
    an ``ml_dtypes`` type zarr lacks, the unsigned carrier of its bytes. (TensorStore reads
    such a leaf, and names what is wrong.)"""
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
        return stored_layout(stored, rec.shape, rec.data_dtype)
    except Exception:
        return None


def plan_slices(
    db: Location, slices: Iterable[tuple[Hashable, LeafRecord, Index, Callable[[], Any]]]
) -> dict[Hashable, SliceRead]:
    """The slices (key, leaf record, index, the leaf's TensorStore when needed) that the
    direct path reads, by key: one B-tree walk (``index``) for every chunk's place and every
    leaf's ``zarr.json``, each leaf's layout once (``leaf_layout``; a restore of 2000 leaves
    opened none, and a 2000-leaf local step asked TensorStore's spec 16000 times, 1.4 s).
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


@dataclass(frozen=True)
class ChunkRead:
    """One chunk: its key, where its bytes are, where they go in the slice's buffer."""

    key: str
    at: arrays.ChunkBytes
    offset: int
    nbytes: int  # without the 4-byte trailer


@dataclass(frozen=True)
class ChunkPart:
    """One chunk of a slice that cuts through it: its key, where its bytes are, the part of
    it the slice needs (``src``, the chunk's coordinates) and where that goes (``dst``)."""

    key: str
    at: arrays.ChunkBytes
    nbytes: int  # the whole chunk's, without the 4-byte trailer
    chunk_shape: tuple[int, ...]
    src: tuple[slice, ...]
    dst: tuple[slice, ...]
    users: int = 1  # the slices of the plan that read a part of this chunk


@dataclass(frozen=True)
class SliceRead:
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


def plan(
    db: Location,
    wanted: dict[Hashable, Wanted],
    where: dict[str, arrays.ChunkBytes] | None = None,
) -> dict[Hashable, SliceRead]:
    """The slices of ``wanted`` that can be read directly, by the same keys: one walk of the
    B-tree for all their chunks (or ``where``, a walk's result: ``index``). Raises
    StorageError when the B-tree points outside the database's directory."""
    whole: dict[Hashable, tuple[Wanted, list[tuple[str, int]]]] = {}
    cut: dict[Hashable, tuple[Wanted, list[tuple[str, tuple[slice, ...], tuple[slice, ...]]]]] = {}
    for k, w in wanted.items():
        if not all(b > a for a, b in w.index):
            continue  # nothing to read
        sep = w.layout.separator
        found = chunks_in(w.index, w.layout)
        if found:
            whole[k] = (w, [(chunk_key(w.name, g, sep), off) for g, off in found])
        elif math.prod(w.layout.chunk_shape) * w.layout.dtype.itemsize <= PART_CHUNK_BYTES:
            cut[k] = (
                w,
                [
                    (
                        chunk_key(w.name, g, sep),
                        boxes.within(part, chunk),
                        boxes.within(part, w.index),
                    )
                    for g, chunk, part in chunk_parts(w.index, w.layout)
                ],
            )
    if not whole and not cut:
        return {}
    keys = {key for _, ks in whole.values() for key, _ in ks}
    keys |= {key for _, ks in cut.values() for key, _, _ in ks}
    if where is None:
        where = arrays.chunk_bytes(ts.KvStore.open(db.kvstore()).result(), db, keys)
    sizes = _file_sizes(db, {at.file for at in where.values() if not at.inline})
    out: dict[Hashable, SliceRead] = {}
    for k, (w, ks) in whole.items():
        nbytes = math.prod(w.layout.chunk_shape) * w.layout.dtype.itemsize
        reads = [ChunkRead(key, where[key], off, nbytes) for key, off in ks if key in where]
        for r in reads:
            _check_inside(w.name, r.key, r.at, sizes)
        if len(reads) == len(ks) and all(_plain(r.at, r.nbytes) for r in reads):
            out[k] = SliceRead(tuple(extent(w.index)), w.layout.dtype, tuple(reads))
    users = collections.Counter(key for _, cs in cut.values() for key, _, _ in cs)
    for k, (w, cs) in cut.items():
        nbytes = math.prod(w.layout.chunk_shape) * w.layout.dtype.itemsize
        shape = w.layout.chunk_shape
        got = [
            ChunkPart(key, where[key], nbytes, shape, s, d, users[key])
            for key, s, d in cs
            if key in where
        ]
        for p in got:
            _check_inside(w.name, p.key, p.at, sizes)
        if len(got) == len(cs) and all(_plain(p.at, p.nbytes) for p in got):
            out[k] = SliceRead(tuple(extent(w.index)), w.layout.dtype, (), tuple(got))
    return out


def _plain(at: arrays.ChunkBytes, nbytes: int) -> bool:
    """A value of its own, of the length the codecs give."""
    return not at.inline and at.stop - at.start == nbytes + _TRAILER


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


# --- reading -------------------------------------------------------------------------------


class Corrupt(Exception):
    """A chunk whose CRC32C does not match its bytes (the caller names the leaf)."""

    def __init__(self, key: str, at: arrays.ChunkBytes) -> None:
        super().__init__(f"chunk {key!r} at {at}: CRC32C mismatch")
        self.key, self.at = key, at


def reader_threads() -> int:
    """Threads for the direct reads: half the cores, 2 to 8 (a read from the page cache is a
    memory copy and a CRC: more threads than cores only contend; measured on 2 cores, 2
    threads restored 4-8 % faster than 4, and 8 slower)."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


class Reader:
    """Reads ``SliceRead``s on a few threads; ``close`` stops them and closes the files."""

    def __init__(self, threads: int | None = None, keep_bytes: int | None = None) -> None:
        """``keep_bytes``: at most this many bytes of chunks kept for the slices that share
        them (default ``KEEP_BYTES``; a restore passes the smaller of that and its budget)."""
        threads = threads or reader_threads()
        self._keep_limit = KEEP_BYTES if keep_bytes is None else keep_bytes
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxckpt-direct")
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._scratch = threading.local()  # each thread's buffer for chunks read in part
        self._kept: dict[str, _Kept] = {}  # chunks read in part that other slices need too
        self._kept_bytes = 0
        self._came: dict[str, int] = {}  # the slices that came for each shared chunk so far
        self._spare: list[np.ndarray] = []  # kept chunks' buffers, for the next ones
        self._advised: dict[str, set[int]] = {}  # each file's MiB blocks prefetched
        self._sizes: dict[str, int] = {}  # of the files prefetched from

    def start(
        self, sr: SliceRead, into: np.ndarray | None = None, copies: Sequence[np.ndarray] = ()
    ) -> Future[np.ndarray]:
        """Reads ``sr`` on the threads, into a fresh buffer or ``into`` (C-contiguous, of
        the slice's shape and dtype), and its bytes into each of ``copies`` (the same) too,
        piece by piece as they are checked, while they are in the CPU's cache (a slice's
        replicas on CPU devices). Whole chunks are read in spans of about ``SPLIT_BYTES``,
        each on a thread of its own, so one large slice keeps every thread busy; each
        chunk's CRC32C is put together from its spans' (``crc.combine``)."""
        buf = arrays.buffer_for(into, sr.shape, sr.dtype)
        extra = [arrays.buffer_for(c, sr.shape, sr.dtype) for c in copies]
        self._prefetch(sr)
        if sr.parts:
            return self._pool.submit(self._read_parts, sr, [buf, *extra])
        chunks = sorted(sr.chunks, key=lambda r: (r.at.file, r.at.start))
        trailers = bytearray(_TRAILER * len(chunks))
        flats = [b.reshape(-1).view(np.uint8) for b in [buf, *extra]]
        spans = _spans(chunks, flats, memoryview(trailers))
        if len(spans) == 1:  # most slices: one task reads and checks it
            return self._pool.submit(self._read_whole, spans[0], chunks, trailers, buf)
        out: Future[np.ndarray] = Future()
        partial: list[dict[int, list[int]] | None] = [None] * len(spans)
        left = [len(spans)]
        lock = threading.Lock()

        def done(k: int, fut: Future[dict[int, list[int]]]) -> None:
            try:
                partial[k] = fut.result()
            except BaseException as e:  # (a cancelled span too)
                with lock:
                    if not out.done():
                        out.set_exception(e)
                return
            with lock:
                left[0] -= 1
                if left[0] or out.done():
                    return
            try:
                _check(chunks, trailers, partial)
            except BaseException as e:
                out.set_exception(e)
            else:
                out.set_result(buf)

        for k, span in enumerate(spans):
            self._pool.submit(self._read_span, span).add_done_callback(functools.partial(done, k))
        return out

    def _prefetch(self, sr: SliceRead) -> None:
        """Asks the kernel to start reading the slice's chunks (``POSIX_FADV_WILLNEED``) as
        the read is issued: the reads in flight (the read budget's worth) then keep the disk
        busy while threads copy and check earlier ones (a cold 1 GB restore here: 1.06
        against 0.94 GB/s). Advice goes by whole MiB blocks of a file, each block once a
        restore (those of 2000 leaves of 16 KiB: 32 calls, not 7500), and not where the
        stretch's last byte (or its file's) is in the page cache already (a 1-byte
        ``RWF_NOWAIT`` read): on cached files the advice only walks the cache (on a 16-core
        H100 host, 9 % of a warm 2 GB restore). (Its last byte: the kernel's own readahead,
        started by earlier reads and by such probes, may have brought in the first ones.) A
        hint only: errors are the read's."""
        if not hasattr(os, "posix_fadvise"):
            return
        where = [c.at for c in sr.chunks] + [p.at for p in sr.parts]
        with self._lock:
            stretches = _new_blocks(where, self._advised)
        for f, a, b in stretches:
            with contextlib.suppress(OSError, StorageError):  # the read raises, naming it
                fd = self._fd(f)
                if f not in self._sizes:
                    self._sizes[f] = os.fstat(fd).st_size
                if not _cached(fd, min(b, self._sizes[f]) - 1):
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._kept.clear()
        self._came.clear()
        self._spare.clear()
        self._advised.clear()
        self._sizes.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, path: str) -> int:
        with self._lock:
            if path not in self._fds:
                try:
                    self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise StorageError(f"opening the data file {path} failed: {e}") from e
            return self._fds[path]

    def _read_parts(self, sr: SliceRead, bufs: list[np.ndarray]) -> np.ndarray:
        """The slice's chunks in file order, those another thread is reading for it too
        put off to the end (waiting for them while there is work left would leave this
        thread idle: two slices sharing their chunks would read them in turn)."""
        later = []
        for p in sorted(sr.parts, key=lambda p: (p.at.file, p.at.start)):
            if p.users > 1 and self._being_read(p.key):
                later.append(p)
            else:
                self._read_part(p, bufs)
        for p in later:
            self._read_part(p, bufs)
        return bufs[0]

    def _being_read(self, key: str) -> bool:
        """Whether another thread is reading chunk ``key`` for the slices that share it."""
        with self._lock:
            entry = self._kept.get(key)
        if entry is None or not entry.ready.acquire(blocking=False):
            return entry is not None
        entry.ready.release()
        return False

    def _read_part(self, p: ChunkPart, bufs: list[np.ndarray]) -> None:
        """Copies the part of chunk ``p`` the slice needs into each of ``bufs``, from the
        chunk read whole and checked: by this thread into its scratch buffer, or, where
        other slices need a part of it too, once for all of them (``_shared``)."""
        if p.users > 1:
            kept = self._shared(p)
            if kept is not None:
                data, entry = kept
                try:
                    _copy_part(p, data, bufs)
                finally:
                    self._done_with(p.key, entry)
                return
        scratch: np.ndarray | None = getattr(self._scratch, "buf", None)
        if scratch is None or len(scratch) < p.nbytes + _TRAILER:
            scratch = self._scratch.buf = np.empty(p.nbytes + _TRAILER, np.uint8)
        self._read_chunk(p, scratch)
        _copy_part(p, scratch, bufs)

    def _read_chunk(self, p: ChunkPart, into: np.ndarray) -> None:
        """Chunk ``p`` whole, with its trailer, into ``into``; raises Corrupt unless its
        CRC32C matches."""
        view = into[: p.nbytes + _TRAILER].data
        _preadv_all(self._fd(p.at.file), [view], p.at.start, [ChunkRead(p.key, p.at, 0, p.nbytes)])
        if crc32c.crc32c(view[: p.nbytes]) != int.from_bytes(view[p.nbytes :], "little"):
            raise Corrupt(p.key, p.at)

    def _shared(self, p: ChunkPart) -> tuple[np.ndarray, _Kept] | None:
        """Chunk ``p`` read and checked once for the ``p.users`` slices that need it: the
        first to come reads it while the others wait; None where keeping it would pass
        the reader's ``keep_bytes`` (each reads it then). Every caller then calls
        ``_done_with``."""
        with self._lock:
            came = self._came[p.key] = self._came.get(p.key, 0) + 1
            entry = self._kept.get(p.key)
            mine = entry is None
            if mine:
                left = p.users - came + 1  # this slice and those still to come
                if left <= 1 or self._kept_bytes + p.nbytes > self._keep_limit:
                    return None
                entry = self._kept[p.key] = _Kept(left, p.nbytes)
                self._kept_bytes += p.nbytes
                entry.ready.acquire()  # held until the bytes are in and checked
                data = self._spare_for(p.nbytes + _TRAILER)
        assert entry is not None
        if mine:
            try:
                self._read_chunk(p, data)
                entry.data = data
            except BaseException as e:
                entry.error = e
                self._done_with(p.key, entry)
                raise
            finally:
                entry.ready.release()
            return data, entry
        with entry.ready:  # the first user's read
            pass
        if entry.error is not None:
            self._done_with(p.key, entry)
            raise entry.error
        assert entry.data is not None
        return entry.data, entry

    def _done_with(self, key: str, entry: _Kept) -> None:
        """One user of a kept chunk less; the last one lets it go."""
        with self._lock:
            entry.left -= 1
            if entry.left <= 0 and self._kept.get(key) is entry:
                del self._kept[key]
                self._kept_bytes -= entry.nbytes
                if entry.data is not None:
                    self._spare.append(entry.data)
                entry.data = None

    def _spare_for(self, size: int) -> np.ndarray:
        """A buffer of at least ``size`` bytes for a kept chunk: one a released chunk left
        (fresh memory costs a page fault a page), else a new one. (Under ``_lock``.)"""
        for i, buf in enumerate(self._spare):
            if len(buf) >= size:
                return self._spare.pop(i)
        if self._kept_bytes + sum(len(b) for b in self._spare) > self._keep_limit:
            self._spare.clear()  # (none fits: let the small ones go)
        return np.empty(size, np.uint8)

    def _read_whole(
        self, span: _Span, chunks: list[ChunkRead], trailers: bytearray, buf: np.ndarray
    ) -> np.ndarray:
        """A slice that is one span: read, then checked."""
        _check(chunks, trailers, [self._read_span(span)])
        return buf

    def _read_span(self, span: _Span) -> dict[int, list[int]]:
        """Reads one span in ``preadv`` calls of about PIECE_BYTES, each piece checksummed
        (and copied into the slice's copies) as soon as it is in; returns {chunk: [CRC32C,
        length] of its bytes in the span}."""
        fd, pos = self._fd(span.chunks[0].at.file), span.start
        crcs: dict[int, list[int]] = {}
        group: list[_Piece] = []
        size = 0
        for piece in [*span.pieces, _Piece(memoryview(b""), -2)]:  # -2: the end
            i, view = piece.chunk, piece.view
            if group and (i == -2 or size + len(view) > PIECE_BYTES or len(group) == _IOV_MAX):
                pos = _preadv_all(fd, [g.view for g in group], pos, span.chunks)
                for g in group:
                    if g.chunk >= 0:
                        c = crcs.setdefault(g.chunk, [0, 0])
                        c[0] = crc32c.crc32c(g.view, c[0])
                        c[1] += len(g.view)
                        if g.copies:
                            got = np.frombuffer(g.view, np.uint8)
                            for dst in g.copies:
                                np.copyto(dst, got)
                group, size = [], 0
            group.append(piece)
            size += len(view)
        return crcs


class _Kept:
    """A chunk read in part by several slices: its checked bytes (or the error its read
    raised), the users still to copy from it, and a lock held while it is read."""

    def __init__(self, users: int, nbytes: int) -> None:
        self.left, self.nbytes = users, nbytes
        self.ready = threading.Lock()
        self.data: np.ndarray | None = None
        self.error: BaseException | None = None


def _copy_part(p: ChunkPart, chunk: np.ndarray, bufs: list[np.ndarray]) -> None:
    """The part of chunk ``p`` (its bytes, at the start of ``chunk``) a slice needs, into
    each of ``bufs``."""
    values = chunk[: p.nbytes].view(bufs[0].dtype).reshape(p.chunk_shape)
    for buf in bufs:
        buf[p.dst] = values[p.src]


@dataclass(frozen=True)
class _Piece:
    """Bytes read in one go: where they go (``view``), the index of their chunk (-1: a CRC
    trailer) and where else (``copies``: the same bytes of the slice's other buffers)."""

    view: memoryview
    chunk: int
    copies: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class _Span:
    """Consecutive bytes of one data file that one thread reads: from ``start`` on, into
    ``pieces``; ``chunks``: those it touches, for errors."""

    start: int
    pieces: list[_Piece]
    chunks: list[ChunkRead]


def _spans(chunks: list[ChunkRead], flats: list[np.ndarray], trailers: memoryview) -> list[_Span]:
    """The reads of ``chunks`` (sorted by file and offset) into ``flats[0]`` (bytes), copied
    into the others, their trailers into ``trailers``: chunks back to back in one file are
    one run, cut into spans of about ``SPLIT_BYTES`` (wherever that falls, inside a chunk
    too), each made of pieces of at most PIECE_BYTES."""
    flat, extra = flats[0].data, flats[1:]
    spans: list[_Span] = []
    pieces: list[_Piece] = []
    touched: list[ChunkRead] = []
    start = pos = size = 0
    prev: ChunkRead | None = None

    def cut() -> None:
        if pieces:
            spans.append(_Span(start, list(pieces), list(touched)))
        pieces.clear()
        touched.clear()

    for i, r in enumerate(chunks):
        if prev is None or r.at.file != prev.at.file or r.at.start != prev.at.stop:
            cut()
            start = pos = r.at.start
            size = 0
        prev = r
        touched.append(r)
        ranges = [(r.offset + lo, r.offset + min(r.nbytes, lo + PIECE_BYTES))
                  for lo in range(0, r.nbytes, PIECE_BYTES)]  # fmt: skip
        for piece in [
            *(_Piece(flat[a:b], i, tuple(e[a:b] for e in extra)) for a, b in ranges),
            _Piece(trailers[_TRAILER * i : _TRAILER * (i + 1)], -1),
        ]:
            if size >= SPLIT_BYTES:
                cut()
                start, size = pos, 0
                touched.append(r)
            pieces.append(piece)
            pos += len(piece.view)
            size += len(piece.view)
    cut()
    return spans


def _check(chunks: list[ChunkRead], trailers: bytearray, partial: Sequence[Any]) -> None:
    """Raises Corrupt for the first chunk whose bytes' CRC32C, put together from the spans'
    ``partial`` ones (in file order), is not the one stored after it."""
    got: dict[int, int] = {}
    for p in partial:
        for i, (c, n) in p.items():  # most chunks lie in one span: nothing to combine
            got[i] = crc.combine(got[i], c, n) if i in got else c
    for i, r in enumerate(chunks):
        if got.get(i) != int.from_bytes(trailers[_TRAILER * i : _TRAILER * (i + 1)], "little"):
            raise Corrupt(r.key, r.at)


def _new_blocks(
    where: Sequence[arrays.ChunkBytes], seen: dict[str, set[int]], block: int = ADVICE_BYTES
) -> list[tuple[str, int, int]]:
    """The stretches of whole ``block``s (file, start, stop) that hold bytes of ``where``
    and are not in ``seen`` yet (which now holds them), runs of consecutive blocks merged."""
    out: list[tuple[str, int, int]] = []
    for at in sorted(where, key=lambda at: (at.file, at.start)):
        done = seen.setdefault(at.file, set())
        for k in range(at.start // block, (at.stop - 1) // block + 1):
            if k in done:
                continue
            done.add(k)
            if out and out[-1][0] == at.file and out[-1][2] == k * block:
                out[-1] = (at.file, out[-1][1], (k + 1) * block)
            else:
                out.append((at.file, k * block, (k + 1) * block))
    return out


def from_disk(plans: Sequence[SliceRead]) -> bool:
    """Whether the reads of ``plans`` (in the order they are issued) will wait for the disk:
    the first and last bytes of the first and last slices' first chunks are not all in the
    page cache (``_resident``: it starts no readahead, which would hide from ``_prefetch``
    the stretches around the probed bytes; False where that can't be told)."""
    if not plans:
        return False
    probes = {(at.file, at.start) for sr in (plans[0], plans[-1]) for at in _first(sr)}
    probes |= {(at.file, at.stop - 1) for sr in (plans[0], plans[-1]) for at in _first(sr)}
    return any(_resident(file, offset) is False for file, offset in sorted(probes))


def _resident(path: str, offset: int) -> bool | None:
    """Whether the page of file ``path`` holding byte ``offset`` is in the page cache
    (``mincore`` over a one-page mapping of it; no read); None where that can't be told."""
    fn = arrays.libc("mincore", ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
    if fn is None:
        return None
    page = offset - offset % mmap.PAGESIZE
    try:
        with (
            open(path, "rb") as f,
            mmap.mmap(f.fileno(), mmap.PAGESIZE, access=mmap.ACCESS_READ, offset=page) as m,
        ):
            view = np.frombuffer(m, np.uint8)
            vec = bytearray(1)
            ok = fn(view.ctypes.data, mmap.PAGESIZE, (ctypes.c_char * 1).from_buffer(vec)) == 0
            del view  # (before the mapping closes)
    except (OSError, ValueError):  # the read raises, naming it; a page past the end
        return None
    return bool(vec[0] & 1) if ok else None


def _first(sr: SliceRead) -> list[arrays.ChunkBytes]:
    return [c.at for c in sr.chunks[:1]] + [p.at for p in sr.parts[:1]]


def _cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` is in the page cache (``_probe``); False where that
    cannot be told."""
    return _probe(fd, offset) is True


def _probe(fd: int, offset: int) -> bool | None:
    """Whether the byte at ``offset`` is in the page cache: a 1-byte read that fails rather
    than wait for the disk (``RWF_NOWAIT``; a miss starts the kernel's readahead of a few
    pages); None where that cannot be told."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return None
    try:
        return os.preadv(fd, [bytearray(1)], offset, nowait) == 1
    except BlockingIOError:  # EAGAIN: not cached
        return False
    except OSError:  # EOPNOTSUPP: a file system that can't tell
        return None


def _preadv_all(fd: int, views: list[memoryview], pos: int, run: list[ChunkRead]) -> int:
    """Fills ``views`` from ``pos`` on (a read may return less); returns the next position."""
    at = 0  # the first view not yet filled
    while at < len(views):
        try:
            n = os.preadv(fd, views[at:] if at else views, pos)
        except OSError as e:
            raise StorageError(f"reading {run[0].at.file} at byte {pos} failed: {e}") from e
        if n == 0:
            first, last = run[0].at, run[-1].at
            raise StorageError(
                f"the data file {first.file} ends at byte {pos}, before the bytes "
                f"{first.start}-{last.stop - 1} the OCDBT B-tree gives chunk {run[0].key!r} and "
                f"those after it: the file was truncated; restore another step or re-save"
            )
        pos += n
        while at < len(views) and n >= len(views[at]):
            n -= len(views[at])
            at += 1
        if n:
            views[at] = views[at][n:]
    return pos
