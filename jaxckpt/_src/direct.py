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
is still in the CPU's cache. Anything else (zstd, inline values, object stores, a slice
that cuts through chunks, an edge chunk zarr padded, sub-byte or bool dtypes, a value of an
unexpected length or past its file's end) is read by TensorStore.
``JAXCKPT_DIRECT_READ=0`` turns the path off (for benchmarks and debugging).
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import threading
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import crc32c
import ml_dtypes
import numpy as np
import tensorstore as ts

from ..errors import StorageError
from . import arrays
from .boxes import Index
from .storage import Location

ENV = "JAXCKPT_DIRECT_READ"
PIECE_BYTES = 1 << 20  # read and checksummed at a time: stays in cache between the two
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


def _whole_bytes(dtype: np.dtype) -> bool:
    """Every bit of every byte is the value's (no bool, no sub-byte type padded to a byte)."""
    if dtype.kind in "iufc":
        return dtype.itemsize == 1 or (dtype.isnative and sys.byteorder == "little")
    if dtype.kind != "V":
        return False
    try:
        return int(ml_dtypes.finfo(dtype).bits) == dtype.itemsize * 8
    except (ValueError, TypeError):
        return False


def layout(store: ts.TensorStore) -> Layout | None:
    """The leaf's layout from its zarr metadata, or None when the direct path can't read it."""
    meta = store.spec().to_json().get("metadata", {})
    dtype = store.dtype.numpy_dtype
    codecs = meta.get("codecs")
    little = {"name": "bytes", "configuration": {"endian": "little"}}
    one_byte = {"name": "bytes"}  # (TensorStore drops the byte order of 1-byte types)
    raw = [little if dtype.itemsize > 1 else one_byte, {"name": "crc32c"}]
    grid = meta.get("chunk_grid", {})
    keys = meta.get("chunk_key_encoding", {})
    if (
        codecs != raw
        or grid.get("name") != "regular"
        or keys.get("name") != "default"
        or not _whole_bytes(dtype)
    ):
        return None
    chunk_shape = tuple(int(c) for c in grid["configuration"]["chunk_shape"])
    separator = keys.get("configuration", {}).get("separator", "/")
    if len(chunk_shape) != store.rank or min(chunk_shape, default=1) < 1:
        return None
    return Layout(chunk_shape, dtype, separator)


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
class SliceRead:
    """One slice read directly: the buffer to allocate and the chunks that fill it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    chunks: tuple[ChunkRead, ...]


@dataclass(frozen=True)
class Wanted:
    """A slice a restore asks for: the leaf, its layout and the slice's box."""

    name: str
    layout: Layout
    index: Index


def plan(db: Location, wanted: dict[Hashable, Wanted]) -> dict[Hashable, SliceRead]:
    """The slices of ``wanted`` that can be read directly, by the same keys: one walk of the
    B-tree for all their chunks. Raises StorageError when the B-tree points outside the
    database's directory."""
    parts: dict[Hashable, tuple[Wanted, list[tuple[str, int]]]] = {}
    for k, w in wanted.items():
        found = chunks_in(w.index, w.layout)
        if found:
            keys = [(chunk_key(w.name, g, w.layout.separator), off) for g, off in found]
            parts[k] = (w, keys)
    if not parts:
        return {}
    base = ts.KvStore.open(db.kvstore()).result()
    where = arrays.chunk_bytes(base, db, {key for _, keys in parts.values() for key, _ in keys})
    sizes = _file_sizes(db, {at.file for at in where.values() if not at.inline})
    out: dict[Hashable, SliceRead] = {}
    for k, (w, keys) in parts.items():
        nbytes = math.prod(w.layout.chunk_shape) * w.layout.dtype.itemsize
        reads = [ChunkRead(key, where[key], off, nbytes) for key, off in keys if key in where]
        for r in reads:
            _check_inside(w.name, r, sizes)
        if len(reads) == len(keys) and all(_plain(r) for r in reads):
            shape = tuple(b - a for a, b in w.index)
            out[k] = SliceRead(shape, w.layout.dtype, tuple(reads))
    return out


def _plain(r: ChunkRead) -> bool:
    """A value of its own, of the length the codecs give."""
    return not r.at.inline and r.at.stop - r.at.start == r.nbytes + _TRAILER


def _check_inside(leaf: str, r: ChunkRead, sizes: dict[str, int]) -> None:
    """Raises StorageError when the chunk's bytes end past its data file's end (TensorStore
    would fail too, without naming the file)."""
    if r.at.inline or r.at.stop <= sizes[r.at.file]:
        return
    size = sizes[r.at.file]
    has = "is missing" if size < 0 else f"holds only {size} bytes"
    raise StorageError(
        f"leaf {leaf!r}: chunk {r.key!r} is bytes {r.at.start}-{r.at.stop - 1} of the data "
        f"file {r.at.file}, which {has}: the checkpoint was truncated or damaged; restore "
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

    def __init__(self, threads: int | None = None) -> None:
        threads = threads or reader_threads()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jaxckpt-direct")
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def start(self, sr: SliceRead) -> Future[np.ndarray]:
        return self._pool.submit(self._read, sr)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
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

    def _read(self, sr: SliceRead) -> np.ndarray:
        buf = arrays.aligned_empty(sr.shape, sr.dtype)
        flat = buf.reshape(-1).view(np.uint8).data
        chunks = sorted(sr.chunks, key=lambda r: (r.at.file, r.at.start))
        run: list[ChunkRead] = []
        for r in chunks:
            if run and (r.at.file != run[-1].at.file or r.at.start != run[-1].at.stop):
                self._read_run(run, flat)
                run = []
            run.append(r)
        if run:
            self._read_run(run, flat)
        return buf

    def _read_run(self, run: list[ChunkRead], flat: memoryview) -> None:
        """Chunks stored back to back in one file: read in pieces of about PIECE_BYTES,
        each checksummed as soon as it is in."""
        trailers = bytearray(_TRAILER * len(run))
        tail = memoryview(trailers)
        # (destination, index of its chunk or -1 for a trailer)
        iov: list[tuple[memoryview, int]] = []
        for i, r in enumerate(run):
            for lo in range(0, r.nbytes, PIECE_BYTES):
                hi = min(r.nbytes, lo + PIECE_BYTES)
                iov.append((flat[r.offset + lo : r.offset + hi], i))
            iov.append((tail[_TRAILER * i : _TRAILER * (i + 1)], -1))
        fd, pos = self._fd(run[0].at.file), run[0].at.start
        crcs = [0] * len(run)
        group: list[tuple[memoryview, int]] = []
        size = 0
        for view, i in [*iov, (memoryview(b""), -2)]:  # -2: the end
            if group and (i == -2 or size + len(view) > PIECE_BYTES or len(group) == _IOV_MAX):
                pos = _preadv_all(fd, [v for v, _ in group], pos, run)
                for v, j in group:
                    if j >= 0:
                        crcs[j] = crc32c.crc32c(v, crcs[j])
                group, size = [], 0
            group.append((view, i))
            size += len(view)
        for i, r in enumerate(run):
            if crcs[i] != int.from_bytes(trailers[_TRAILER * i : _TRAILER * (i + 1)], "little"):
                raise Corrupt(r.key, r.at)


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
