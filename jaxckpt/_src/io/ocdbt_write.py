"""A process's OCDBT database written by jaxckpt itself: one pass from the host buffers.

TensorStore's write of a chunk copies it into its own buffers, checksums it and hands it to
the kernel, which copies it into the page cache. Where every leaf is stored raw (codecs
``bytes`` then ``crc32c``, no compression) in a local directory and each chunk lies whole
inside one piece this process writes, ``write`` lays the chunks out itself: each data file
is written by one thread with positional writes straight from the host buffer, in 1 MiB
steps, each step checksummed (hardware CRC32C) right before it is written, while it is in
the CPU's cache. With ``direct_io`` the files are opened with ``O_DIRECT``: the bytes go
through one aligned buffer per file to the disk and never enter the page cache (the tail of
a file that does not fill a 4 KiB block is written normally).

The result is the format TensorStore writes (docs/FORMAT.md; TensorStore's OCDBT format:
https://google.github.io/tensorstore/kvstore/ocdbt/index.html): a ``manifest.ocdbt`` of kind
"single" with one version, one B+tree leaf node holding every key (each leaf's
``zarr.json`` inline in it), and every chunk's stored bytes in ``d/<32 hex>`` data files.
(TensorStore would store a chunk of up to 1 KiB inline in the node, where only TensorStore
reads it; out of line, the direct reader reads it with its neighbours.) TensorStore opens
it, the merge of a multi-process save links it, every reader takes it unchanged. Anything
else (compression, object stores, adding to a database) TensorStore writes
(``arrays.write``).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import math
import mmap
import os
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import crc32c
import numpy as np
import tensorstore as ts

from ...errors import StorageError
from .. import boxes
from ..boxes import Index, extent
from ..storage import Location, fsync_dir, storage_error
from . import arrays, chunk_plan, fingerprint, linux, page_cache
from .arrays import DATA_FILES_PER_PROCESS, MIN_DATA_FILE_BYTES, ArrayWrite
from .layout import ALIGN, SMALL_CHUNK_BYTES

log = logging.getLogger("jaxckpt")

MAX_INLINE_VALUE_BYTES = arrays.OCDBT_CONFIG["max_inline_value_bytes"]
MAX_DECODED_NODE_BYTES = arrays.OCDBT_CONFIG["max_decoded_node_bytes"]
VERSION_TREE_ARITY_LOG2 = 4  # TensorStore's default
_MANIFEST_MAGIC = 0x0CDB3A2A
_NODE_MAGIC = 0x0CDB20DE
STEP_BYTES = 1 << 20  # checksummed then written at a time: still in cache for the write
BLOCK = 4096  # O_DIRECT's alignment of offsets, lengths and memory
BOUNCE_BYTES = 8 << 20  # one aligned buffer per file with O_DIRECT
_GATHER_BYTES = 64 << 10  # smaller writes are gathered into the file's buffer first
WRITE_BACK_BYTES = 8 << 20  # the disk's write of a file's cached bytes started this often
SMALL_PIECE_BYTES = 1 << 20  # pieces up to this size are fetched from their devices ...
FETCH_BYTES = 16 << 20  # ... this many bytes at a time (one batched device->host copy)


# --- the encodings ---------------------------------------------------------------------------


def varint(n: int) -> bytes:
    """``uleb128``, the format's variable-length unsigned integer."""
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _varints(values: Sequence[int]) -> bytes:
    return b"".join(varint(v) for v in values)


def _common(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _prefix_coded(keys: Sequence[bytes]) -> tuple[bytes, bytes, bytes]:
    """Each key's common prefix length with the one before it, the lengths of the rest
    (suffixes), and the suffixes: the three columns both tables and nodes store."""
    prefixes = [_common(a, b) for a, b in itertools.pairwise(keys)]
    suffixes = [k[p:] for k, p in zip(keys, [0, *prefixes][: len(keys)], strict=True)]
    return _varints(prefixes), _varints([len(s) for s in suffixes]), b"".join(suffixes)


def data_file_table(paths: Sequence[str]) -> bytes:
    """The files a node or manifest refers to, by index (every base path empty)."""
    prefixes, lengths, suffixes = _prefix_coded([p.encode() for p in paths])
    return varint(len(paths)) + prefixes + lengths + _varints([0] * len(paths)) + suffixes


def framed(magic: int, body: bytes) -> bytes:
    """Header (magic, total length, version 0, uncompressed), ``body``, CRC32C footer."""
    head = struct.pack(">I", magic)
    length = len(head) + 8 + 2 + len(body) + 4
    out = head + struct.pack("<Q", length) + b"\x00\x00" + body
    return out + struct.pack("<I", crc32c.crc32c(out))


@dataclass(frozen=True)
class Ref:
    """An out-of-line value: ``length`` bytes at ``offset`` of data file ``file``."""

    file: int
    offset: int
    length: int


def leaf_node(entries: Sequence[tuple[bytes, bytes | Ref]], files: Sequence[str]) -> bytes:
    """An encoded B+tree leaf node (height 0) of ``entries``, sorted by key."""
    keys = [k for k, _ in entries]
    values = [v for _, v in entries]
    refs = [v for v in values if isinstance(v, Ref)]
    body = [
        b"\x00",  # height
        data_file_table(files),
        varint(len(entries)),
        *_prefix_coded(keys),
        _varints([v.length if isinstance(v, Ref) else len(v) for v in values]),
        _varints([1 if isinstance(v, Ref) else 0 for v in values]),
        _varints([r.file for r in refs]),
        _varints([r.offset for r in refs]),
        *(v for v in values if not isinstance(v, Ref)),
    ]
    return framed(_NODE_MAGIC, b"".join(body))


def manifest(root: Ref, files: Sequence[str], keys: int, indirect_bytes: int) -> bytes:
    """An encoded manifest of kind "single": the configuration TensorStore writes for
    ``arrays.kvstore_spec`` (zstd named for its own B+tree nodes; ours are uncompressed,
    which each node's header says) and one version, generation 1, whose root is ``root``."""
    config = [
        uuid.uuid4().bytes,
        b"\x00",  # manifest kind: single
        varint(MAX_INLINE_VALUE_BYTES),
        varint(MAX_DECODED_NODE_BYTES),
        bytes([VERSION_TREE_ARITY_LOG2]),
        varint(1) + struct.pack("<i", 0),  # zstd, level 0 (TensorStore's default)
    ]
    version = [
        varint(1),  # one inline version
        varint(1),  # generation number
        b"\x00",  # root height
        varint(root.file),
        varint(root.offset),
        varint(root.length),
        varint(keys),
        varint(root.length),  # bytes of every B+tree node
        varint(indirect_bytes),
        struct.pack("<Q", time.time_ns()),
        varint(0),  # no version tree nodes
    ]
    return framed(_MANIFEST_MAGIC, b"".join(config + [data_file_table(files)] + version))


# --- the plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chunk:
    key: bytes
    box: tuple[slice, ...]  # inside the piece
    shape: tuple[int, ...]  # the chunk's (zarr pads edge chunks to it)

    def bytes_of(self, piece: np.ndarray) -> np.ndarray:
        """The chunk's stored bytes (C order, padded with the fill value 0), flat uint8."""
        part = piece[self.box]
        if part.shape != self.shape:
            whole = np.zeros(self.shape, part.dtype)
            whole[tuple(slice(0, n) for n in part.shape)] = part
            part = whole
        return np.ascontiguousarray(part).reshape(-1).view(np.uint8)


@dataclass
class _Piece:
    leaf: str
    shape: tuple[int, ...]  # what ``get`` returns
    get: Callable[[], np.ndarray]
    dtype: np.dtype  # stored
    chunks: list[_Chunk]
    nbytes: int  # stored, CRC32C trailers included
    index: Index  # where the piece lies in its leaf (for the leaf's fingerprint)
    leaf_shape: tuple[int, ...]


@dataclass
class _File:
    name: str  # relative to the database: d/<32 hex>
    pieces: list[_Piece] = field(default_factory=list)
    size: int = 0
    head: bytes = b""  # the B+tree node and zeros up to a block boundary, before the pieces


def _stored(w: ArrayWrite) -> chunk_plan.Layout | None:
    """The layout of a leaf stored raw whose bytes we can write as NumPy holds them: whole
    bytes, or one byte an element (bool and sub-byte types, as TensorStore stores them)."""
    dtype = ts.dtype(w.metadata["data_type"]).numpy_dtype
    lay = chunk_plan.raw_layout(w.metadata, dtype)
    ok = lay is not None and (chunk_plan.whole_bytes(dtype) or dtype.itemsize == 1)
    return lay if ok else None


def _chunks(name: str, index: Index, shape: Sequence[int], lay: chunk_plan.Layout) -> list | None:
    """The chunks of a piece, or None when one is cut by the piece's edge (and so needs
    bytes of another piece, or of another process)."""
    chunk = lay.chunk_shape
    for (a, b), c, n in zip(index, chunk, shape, strict=True):
        if a % c or (b % c and b != n):
            return None
    out = []
    for g in boxes.chunks_in(index, chunk):
        box = tuple(
            slice(i * c - a, min((i + 1) * c, b) - a)
            for i, c, (a, b) in zip(g, chunk, index, strict=True)
        )
        key = chunk_plan.chunk_key(name, g, lay.separator).encode()
        out.append(_Chunk(key, box, tuple(chunk)))
    return out


def _zarr_json(metadata: dict) -> bytes:
    """``zarr.json`` as TensorStore writes it for ``metadata`` (made in memory by it; the
    leaves of a train state share a few shapes, so each distinct one is made once)."""
    return _zarr_json_of(json.dumps(metadata, sort_keys=True))


@functools.lru_cache(maxsize=1024)
def _zarr_json_of(text: str) -> bytes:
    metadata = json.loads(text)
    where = f"memory://zarr_json/{uuid.uuid4().hex}/"
    ctx = ts.Context()
    ts.open(
        {"driver": "zarr3", "kvstore": where, "metadata": metadata, "create": True}, context=ctx
    ).result()
    value = ts.KvStore.open(where, context=ctx).result().read("zarr.json").result().value
    return bytes(value)


def plan(
    writes: Sequence[ArrayWrite],
) -> tuple[list[tuple[bytes, bytes | Ref]], list[_File]] | None:
    """Every key of the database with its value or where it goes, and the data files with
    what each holds; None when a leaf needs TensorStore."""
    entries: dict[bytes, bytes | Ref] = {}
    pieces: list[_Piece] = []
    total = 0
    for w in writes:
        lay = _stored(w)
        if lay is None:
            return None
        dtype, chunk = lay.dtype, lay.chunk_shape
        if w.create:
            entries[f"{w.name}/zarr.json".encode()] = _zarr_json(w.metadata)
        for index, get in w.pieces:
            chunks = _chunks(w.name, index, w.metadata["shape"], lay)
            if chunks is None or any(c.key in entries for c in chunks):
                return None  # (two pieces of one chunk: TensorStore writes the last, as ever)
            entries.update((c.key, b"") for c in chunks)  # their places: below
            nbytes = len(chunks) * (math.prod(chunk) * dtype.itemsize + 4)
            shape = tuple(w.metadata["shape"])
            pieces.append(_Piece(w.name, extent(index), get, dtype, chunks, nbytes, index, shape))
            total += nbytes
    count = max(1, min(DATA_FILES_PER_PROCESS, total // MIN_DATA_FILE_BYTES, len(pieces)))
    # sorted by path, as TensorStore orders a node's data file table: the node is its bytes
    files = [_File(name) for name in sorted(f"d/{uuid.uuid4().hex}" for _ in range(count))]
    order = {id(p): i for i, p in enumerate(pieces)}
    for piece in sorted(pieces, key=lambda p: -p.nbytes):  # largest first, onto the emptiest
        f = min(files, key=lambda f: f.size)
        f.pieces.append(piece)
        f.size += piece.nbytes
    for f in files:  # in the tree's order, as a restore reads them: each file front to back
        f.pieces.sort(key=lambda p: order[id(p)])
    for i, f in enumerate(files):
        offset = 0
        for piece in f.pieces:
            stored_bytes = piece.nbytes // len(piece.chunks) if piece.chunks else 0
            for c in piece.chunks:
                offset = chunk_start(offset, stored_bytes)
                entries[c.key] = Ref(i, offset, stored_bytes)
                offset += stored_bytes
        f.size = offset
    return sorted(entries.items()), files


def chunk_start(offset: int, stored_bytes: int) -> int:
    """Where a chunk of ``stored_bytes`` (trailer included) that could start at ``offset``
    of a data file's values starts (``layout``; the values start on a block)."""
    return offset + (-offset % ALIGN) if stored_bytes >= SMALL_CHUNK_BYTES else offset


# --- the files -------------------------------------------------------------------------------


class _Sink:
    """Sequential writes into one new file, at the offsets the plan gave."""

    def __init__(self, path: str, direct_io: bool, drop: bool = False) -> None:
        self.path, self.drop = path, drop
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        self.dfd = -1
        if direct_io and hasattr(os, "O_DIRECT"):
            try:
                self.dfd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:  # tmpfs and some network filesystems refuse O_DIRECT
                log.info("jaxckpt: %s: no O_DIRECT (%s); dropping its pages instead", path, e)
                self.drop = True
        size = BOUNCE_BYTES if self.dfd >= 0 else _GATHER_BYTES * 16
        self._map = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
        self.buf = np.frombuffer(self._map, np.uint8)
        self.fill = 0  # bytes waiting in buf
        self.pos = 0  # the file offset of buf[0]
        self.flushed = 0  # the bytes before it are on their way to the disk
        self.dropped = 0  # with ``drop``: the bytes before it are out of the page cache

    def write(self, data: np.ndarray) -> None:
        """Appends flat uint8 ``data``."""
        if self.dfd < 0 and len(data) >= _GATHER_BYTES:
            self.flush()
            _pwrite_all(self.fd, data.data, self.pos)  # from the host buffer itself
            self.pos += len(data)
            self._write_back()
            return
        while len(data):
            n = min(len(data), len(self.buf) - self.fill)
            np.copyto(self.buf[self.fill : self.fill + n], data[:n])
            self.fill += n
            data = data[n:]
            if self.fill == len(self.buf):
                self.flush()

    def flush(self) -> None:
        """Writes what waits in the buffer (with O_DIRECT: its whole blocks)."""
        if self.dfd >= 0:
            n = self.fill - self.fill % BLOCK
            _pwrite_all(self.dfd, self.buf[:n].data, self.pos)
            rest = self.fill - n
            self.buf[:rest] = self.buf[n : self.fill]
        else:
            n, rest = self.fill, 0
            _pwrite_all(self.fd, self.buf[:n].data, self.pos)
        self.pos += n
        self.fill = rest
        self._write_back()

    def _write_back(self) -> None:
        """Starts the disk's write of the cached bytes written since the last start, every
        ``WRITE_BACK_BYTES``: the disk works while the rest is copied, and the fsync at the
        end waits for the last part only (the kernel would wait for its dirty limits)."""
        if self.dfd < 0 and self.pos - self.flushed >= WRITE_BACK_BYTES:
            if self.drop:  # the last window: written by now, mostly; wait for it, drop it
                sync_range(self.fd, self.dropped, self.flushed - self.dropped, wait=True)
                drop_pages(self.fd, self.dropped, self.flushed - self.dropped)
                self.dropped = self.flushed
            sync_range(self.fd, self.flushed, self.pos - self.flushed)
            self.flushed = self.pos

    def close(self) -> None:
        """Flushes (a last part block through the page cache), fsyncs, closes."""
        try:
            self.flush()
            if self.fill:
                _pwrite_all(self.fd, self.buf[: self.fill].data, self.pos)
                self.pos += self.fill
                self.fill = 0
            os.fsync(self.fd)
            if self.drop or self.dfd >= 0:  # (with O_DIRECT: the last part block)
                drop_pages(self.fd, 0, 0)
        finally:
            self.release()

    def release(self) -> None:
        for fd in (self.fd, self.dfd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.dfd = -1
        self.buf = np.empty(0, np.uint8)
        with contextlib.suppress(BufferError):
            self._map.close()


def sync_range(fd: int, offset: int, nbytes: int, wait: bool = False) -> None:
    """``sync_file_range``: the kernel starts writing the range's dirty pages to the disk
    and returns (``SYNC_FILE_RANGE_WRITE``), or, ``wait``, also waits for them (and for
    earlier writes of the range) to be done. Linux; elsewhere nothing."""
    fn = linux.sync_file_range
    if fn is not None:
        fn(
            fd,
            offset,
            nbytes,
            linux.SYNC_FILE_RANGE_WAIT_ALL if wait else linux.SYNC_FILE_RANGE_WRITE,
        )


def drop_pages(fd: int, offset: int, nbytes: int) -> None:
    """Drops the range's clean pages from the page cache (0 bytes: to the end of the file)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)


def _in_threads(jobs: Sequence[Callable[[], None]]) -> None:
    """Runs each job on a thread of its own and raises the first error. Plain threads, not
    an executor: a manager's last save may run at interpreter exit (``writer._close_all``),
    when ``concurrent.futures`` takes no new work."""
    errors: list[BaseException] = []

    def run(job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # raised in the caller's thread below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(j,), name="jaxckpt-write") for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


Fetch = Callable[[Sequence[Callable[[], np.ndarray]]], list[np.ndarray]]
"""Host bytes of several pieces at once: the caller's device->host copy, which may batch
them (``staging.to_host_all``); the engine itself knows no devices."""


def each(gets: Sequence[Callable[[], np.ndarray]]) -> list[np.ndarray]:
    """The plain :data:`Fetch`: each piece's own call (pieces already on the host)."""
    return [get() for get in gets]


def _fetched(pieces: Sequence[_Piece], fetch: Fetch) -> Iterator[tuple[_Piece, np.ndarray]]:
    """Each piece with its bytes on the host, in order: a large piece alone, runs of small
    ones (up to FETCH_BYTES) together, so that their device->host copies go in one call of
    ``fetch``."""
    run: list[_Piece] = []
    size = 0
    for piece in pieces:
        if piece.nbytes > SMALL_PIECE_BYTES or size + piece.nbytes > FETCH_BYTES:
            yield from zip(run, fetch([p.get for p in run]), strict=True)
            run, size = [], 0
        if piece.nbytes > SMALL_PIECE_BYTES:
            yield piece, piece.get()
        else:
            run.append(piece)
            size += piece.nbytes
    yield from zip(run, fetch([p.get for p in run]), strict=True)


def _write_file(
    path: str, f: _File, direct_io: bool, drop: bool, fetch: Fetch, sums: fingerprint.Sums | None
) -> None:
    sink = _Sink(path, direct_io, drop)
    try:
        sink.write(np.frombuffer(f.head, np.uint8))
        for piece, data in _fetched(f.pieces, fetch):
            if data.shape != piece.shape:
                raise StorageError(
                    f"leaf {piece.leaf!r}: a piece of shape {piece.shape} came to the writer "
                    f"as {data.shape} (a bug: please report it)"
                )
            if data.dtype != piece.dtype:
                data = data.view(piece.dtype)
            if sums is not None:
                sums.add(piece.leaf, data, piece.index, piece.leaf_shape)
            for c in piece.chunks:
                raw = c.bytes_of(data)
                at = sink.pos + sink.fill - len(f.head)
                if gap := chunk_start(at, len(raw) + 4) - at:
                    sink.write(np.zeros(gap, np.uint8))
                crc = 0
                for start in range(0, len(raw), STEP_BYTES):
                    step = raw[start : start + STEP_BYTES]
                    crc = crc32c.crc32c(step.data, crc)
                    sink.write(step)
                sink.write(np.frombuffer(struct.pack("<I", crc), np.uint8))
            del data
        if sink.pos + sink.fill != len(f.head) + f.size:
            raise StorageError(f"{path}: wrote {sink.pos + sink.fill} bytes, planned {f.size}")
        sink.close()
    except BaseException:
        sink.release()
        raise


def write(
    db: Location,
    writes: Sequence[ArrayWrite],
    *,
    direct_io: bool | None = False,
    drop_page_cache: bool = False,
    fetch: Fetch = each,
    sums: fingerprint.Sums | None = None,
) -> None:
    """Writes every piece of ``writes`` into a new OCDBT database at ``db``: ourselves where
    the module's docstring says we can, else through TensorStore (``arrays.write``).
    ``fetch`` brings pieces' bytes to the host (:data:`Fetch`; the pieces' own calls).
    ``sums``: adds each piece's fingerprint sum as its bytes pass (``fingerprint``).
    ``direct_io``: our files with O_DIRECT (None: where ``db`` is on a disk filesystem,
    ``page_cache.direct_io``); True: TensorStore's have their pages dropped as they are
    written, as ``drop_page_cache`` does (``page_cache.dropping``; ours are dropped every
    ``WRITE_BACK_BYTES`` as the disk takes them).
    ``JAXCKPT_DIRECT_WRITE=0`` always takes TensorStore (for benchmarks and debugging)."""
    planned = _ours(db, writes)
    if planned is None:
        with page_cache.dropping(db.url, db.is_local and (direct_io is True or drop_page_cache)):
            arrays.write(db, writes, sums)
        return
    try:
        _write(db, *planned, page_cache.direct_io(db.url, direct_io), drop_page_cache, fetch, sums)
    except OSError as e:
        raise storage_error(e, db, "writing arrays into") from e


def _ours(db: Location, writes: Sequence[ArrayWrite]) -> tuple[list, list[_File], Ref, str] | None:
    """The plan, with the B+tree node placed first in the smallest file (the values after
    it, from the next block), the node's place and that file; None when TensorStore must
    write ``db``: not local, a leaf it can't take, an existing database (TensorStore adds
    to it), or a node over the format's limit."""
    if not db.is_local or not linux.switched_on(linux.DIRECT_WRITE):
        return None
    if os.path.exists(os.path.join(db.url, "manifest.ocdbt")):
        return None
    planned = plan(writes)
    if planned is None or not planned[0]:
        return None
    entries, files = planned
    home = min(range(len(files)), key=lambda i: files[i].size)
    node, shift = b"", 0
    while len(node) > shift or not node:  # the node's offsets include its own length
        shift = -(-len(node) // BLOCK) * BLOCK
        placed = [(k, _moved(v, home, shift)) for k, v in entries]
        node = leaf_node(placed, [f.name for f in files])
    if len(node) > MAX_DECODED_NODE_BYTES:
        return None
    files[home].head = node + bytes(shift - len(node))
    return placed, files, Ref(0, 0, len(node)), files[home].name


def _moved(v: bytes | Ref, home: int, shift: int) -> bytes | Ref:
    return Ref(v.file, v.offset + shift, v.length) if isinstance(v, Ref) and v.file == home else v


def _write(
    db: Location, entries: list[tuple[bytes, bytes | Ref]], files: list[_File], root: Ref,
    root_file: str, direct_io: bool, drop: bool, fetch: Fetch, sums: fingerprint.Sums | None,
) -> None:  # fmt: skip
    os.makedirs(os.path.join(db.url, "d"), exist_ok=True)
    _in_threads(
        [
            functools.partial(
                _write_file, os.path.join(db.url, f.name), f, direct_io, drop, fetch, sums
            )
            for f in files
        ]
    )
    fsync_dir(os.path.join(db.url, "d"))
    indirect = sum(v.length for _, v in entries if isinstance(v, Ref))
    db.write_bytes("manifest.ocdbt", manifest(root, [root_file], len(entries), indirect))
