"""The direct read path: a local checkpoint's chunks read with ``os.preadv`` straight into
the destination buffer, their CRC32C checked as they arrive; TensorStore is the fallback.

TensorStore's read of a chunk passes over its bytes two or three times (the OCDBT value,
the CRC32C, the zarr decode, a copy into our buffer). Where a chunk is stored raw and is a
contiguous region of the slice being read, its bytes can go where they belong in one read:
``chunk_plan`` finds such slices (one B-tree walk for every chunk of a restore), ``Reader``
reads them. Chunks adjacent in a data file are read in one ``preadv``, their 4-byte CRC
trailers into a scratch array; each piece is checksummed right after it arrives, while it
is still in the CPU's cache. A slice that cuts through chunks (a restore onto another mesh)
or ends in an edge chunk zarr padded is read chunk by chunk instead: each whole chunk
checksummed where it lies in a mapping of its data file (or, where the files may not be
mapped, read into a scratch buffer of the reading thread first), and the part the slice
needs copied into place (a chunk must be read whole to check it; TensorStore reads it whole
too); a chunk that several slices need a part of is checked once for all of them. As a slice's
read is issued, the kernel is asked to read its chunks ahead (``residency``).
``JAXCKPT_DIRECT_READ=0`` turns the path off (for benchmarks and debugging).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from ...errors import StorageError
from ..storage import Location
from . import arrays, crc, mapped, residency
from .chunk_plan import TRAILER, ChunkPart, ChunkRead, SliceRead

ENV = "JAXCKPT_DIRECT_READ"
PIECE_BYTES = 1 << 20  # read and checksummed at a time: stays in cache between the two
SPLIT_BYTES = 8 << 20  # a thread's share of a slice's whole chunks
KEEP_BYTES = 256 << 20
"""At most this many bytes of chunks kept for the other slices that need a part of them
(read once, checked once); a chunk past it is read again by each."""
BATCH_BYTES = 1 << 20
"""Slices of at most ``SMALL_BYTES`` are read together, a batch of about this many bytes on
one thread, chunks back to back in a file in one ``preadv`` across slices: a task and a
wake-up of a thread for each one cost more than reading it (2000 leaves of 16 KiB)."""
SMALL_BYTES = 256 << 10
USED_BYTES = 32 << 20
"""A reader thread unmaps the chunks it used from the files' mappings (``_used``) once it
has this many bytes of them: the process's RSS holds at most that much more per thread."""
_IOV_MAX = 1024  # Linux's limit on the buffers of one preadv
GAP_BYTES = 4096  # ``ocdbt_write.ALIGN``: the most zero bytes it writes before a chunk


def enabled(loc: Location) -> bool:
    """Whether restores from ``loc`` use the direct path (local files; the env var not 0)."""
    return loc.is_local and hasattr(os, "preadv") and os.environ.get(ENV, "1").strip() != "0"


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

    def __init__(
        self,
        threads: int | None = None,
        keep_bytes: int | None = None,
        prefetch: bool = True,
        maps: bool = False,
    ) -> None:
        """``keep_bytes``: at most this many bytes of chunks kept for the slices that share
        them (default ``KEEP_BYTES``; a restore passes the smaller of that and its budget).
        ``prefetch``: ask the kernel to read ahead (``_prefetch``); a restore that found its
        files in the page cache (``residency.from_disk``) saves the probes. ``maps``: the
        files may be mapped (``mapped.enabled``): a chunk a slice needs a part of is then
        checked and copied from a mapping of its file, not read into a buffer first."""
        threads = threads or reader_threads()
        self._prefetching = prefetch
        self._maps = maps
        self._mappings: dict[str, np.ndarray] = {}  # data files mapped whole (``_mapping``)
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
        self._batch: list[_Queued] = []  # small slices not yet handed to the threads
        self._batch_bytes = 0

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
        trailers = bytearray(TRAILER * len(chunks))
        flats = [b.reshape(-1).view(np.uint8) for b in [buf, *extra]]
        spans = _spans(chunks, flats, memoryview(trailers))
        if len(spans) == 1 and buf.nbytes <= SMALL_BYTES:
            return self._queue(_Queued(spans[0], chunks, trailers, buf, _Waiting(self.send)))
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

    def map(self, sr: SliceRead, replicas: int = 0) -> Future[tuple[np.ndarray, ...]]:
        """Slice ``sr`` (``mapped.suitable``) as private mappings of its chunks in the data
        files (several: each at its place, ``mapped.chunks``), each chunk's CRC32C checked
        over them, and ``replicas`` more such copies (one for each other device of the
        slice), on the threads: no fresh memory, no copy."""
        self._prefetch(sr)
        return self._pool.submit(self._map, sr, replicas)

    def _map(self, sr: SliceRead, replicas: int) -> tuple[np.ndarray, ...]:
        chunks = sorted(sr.chunks, key=lambda c: c.offset)
        parts = [(self._fd(c.at.file), c.at.start, c.nbytes) for c in chunks]
        nbytes = sum(c.nbytes for c in chunks)

        def mapping(populate: bool) -> np.ndarray:  # one chunk: with its trailer
            if len(parts) == 1:
                return mapped.region(parts[0][0], parts[0][1], nbytes + TRAILER, populate)
            return mapped.chunks(parts, populate)

        try:
            flat = mapping(True)
            if len(chunks) == 1:
                trailers = [flat[nbytes:].tobytes()]
            else:
                trailers = [os.pread(fd, TRAILER, a + n) for fd, a, n in parts]
            for c, trailer in zip(chunks, trailers, strict=True):
                data = flat[c.offset : c.offset + c.nbytes].data
                if len(trailer) != TRAILER or crc32c.crc32c(data) != int.from_bytes(
                    trailer, "little"
                ):
                    raise Corrupt(c.key, c.at)
            copies = [mapping(False) for _ in range(replicas)]
        except OSError as e:
            raise StorageError(
                f"chunks {[c.key for c in chunks]} of {chunks[0].at.file}: {e}"
            ) from e
        return tuple(f[:nbytes].view(sr.dtype).reshape(sr.shape) for f in [flat, *copies])

    def _queue(self, q: _Queued) -> _Waiting:
        """Puts a small slice in the batch, which goes to the threads once it holds
        ``BATCH_BYTES`` (or when a caller waits for one of its slices: ``send``)."""
        with self._lock:
            self._batch.append(q)
            self._batch_bytes += q.buf.nbytes
            full = self._batch_bytes >= BATCH_BYTES
        if full:
            self.send()
        return q.fut

    def send(self) -> None:
        """Hands the batch of small slices to the threads (a no-op when empty)."""
        with self._lock:
            batch, self._batch, self._batch_bytes = self._batch, [], 0
        if batch:
            task = self._pool.submit(self._read_batch, batch)
            task.add_done_callback(functools.partial(_unsettled, batch))

    def _read_batch(self, batch: list[_Queued]) -> None:
        """Reads a batch of small slices, each one's chunks checked and its future set as
        its run is in: slices whose spans lie back to back in one file are one run, read
        in ``preadv`` calls of about PIECE_BYTES. A run that fails is read again slice by
        slice, so that each slice gets its own error, naming its own chunks."""
        live = [q for q in batch if q.fut.set_running_or_notify_cancel()]
        runs: list[list[_Queued]] = []
        for q in live:
            last = runs[-1][-1].span if runs else None
            if last is not None and last.file == q.span.file and _near(last.stop, q.span.start):
                runs[-1].append(q)
            else:
                runs.append([q])
        for run in runs:
            bases: list[int] = []
            pieces: list[_Piece] = []
            chunks: list[ChunkRead] = []
            for k, q in enumerate(run):
                base = len(chunks)
                bases.append(base)
                if k:
                    pieces += _gap(run[k - 1].span.stop, q.span.start)
                chunks += q.span.chunks
                pieces += [
                    p if p.chunk < 0 or not base else dataclasses.replace(p, chunk=p.chunk + base)
                    for p in q.span.pieces
                ]
            try:
                crcs = self._read_span(_Span(run[0].span.start, pieces, chunks))
            except Exception:
                for q in run:
                    _settle(q, functools.partial(self._read_span, q.span))
                continue
            for q, base in zip(run, bases, strict=True):
                _settle(q, functools.partial(_own, crcs, base, len(q.chunks)))

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
        if not self._prefetching or not hasattr(os, "posix_fadvise"):
            return
        where = [c.at for c in sr.chunks] + [p.at for p in sr.parts]
        with self._lock:
            stretches = residency.new_blocks(where, self._advised)
        for f, a, b in stretches:
            with contextlib.suppress(OSError, StorageError):  # the read raises, naming it
                fd = self._fd(f)
                if f not in self._sizes:
                    self._sizes[f] = os.fstat(fd).st_size
                if not residency.cached(fd, min(b, self._sizes[f]) - 1):
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for q in batch:
            q.fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._kept.clear()
        self._came.clear()
        self._spare.clear()
        self._advised.clear()
        self._sizes.clear()
        self._mappings.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _mapping(self, path: str) -> np.ndarray:
        """All of data file ``path`` as one mapping (``mapped.region``, not faulted in),
        kept until ``close``: one ``mmap`` a file, not one and an ``munmap`` a chunk."""
        with self._lock:
            got = self._mappings.get(path)
        if got is None:
            fd = self._fd(path)
            got = mapped.region(fd, 0, os.fstat(fd).st_size, populate=False)
            with self._lock:
                got = self._mappings.setdefault(path, got)
        return got

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
        pending = collections.deque(sorted(sr.parts, key=lambda p: (p.at.file, p.at.start)))
        later: collections.deque[ChunkPart] = collections.deque()
        try:
            while pending:
                p = pending.popleft()
                if p.users > 1 and self._being_read(p.key):
                    later.append(p)
                else:
                    self._read_part(p, bufs)
            while later:
                self._read_part(later.popleft(), bufs)
        except BaseException:
            self._abandon([*pending, *later])
            raise
        return bufs[0]

    def _abandon(self, parts: list[ChunkPart]) -> None:
        """A slice whose read failed gives up the shared chunks it will never come for:
        counted as come and gone, so that the last of their other users lets them go
        (else a kept chunk waits for it until ``close``)."""
        for p in parts:
            if p.users < 2:
                continue
            with self._lock:
                self._came[p.key] = self._came.get(p.key, 0) + 1
                entry = self._kept.get(p.key)
            if entry is not None:
                self._done_with(p.key, entry)

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
        chunk checked whole: mapped or read by this thread (``_chunk``), or, where other
        slices need a part of it too, once for all of them (``_shared``)."""
        if p.users > 1:
            kept = self._shared(p)
            if kept is not None:
                data, entry = kept
                try:
                    if data.base is not None:  # a mapping, kept since it was checked
                        self._still_whole(p)
                    _copy_part(p, data, bufs)
                finally:
                    self._done_with(p.key, entry)
                return
        data = self._chunk(p)
        try:
            _copy_part(p, data, bufs)
        finally:
            if data.base is not None:
                self._used(data)

    def _still_whole(self, p: ChunkPart) -> None:
        """Raises StorageError where chunk ``p``'s data file no longer holds it (cut short
        since its mapping was checked: touching it would stop the process with SIGBUS).
        An ``fstat``, not a second fault-in: that cost a (2, 4) restore all the mapping
        saved."""
        size = os.fstat(self._fd(p.at.file)).st_size
        if size < p.at.stop:
            raise _cut_short(p.at, size, repr(p.key), p.at.stop, " during the restore")

    def _chunk(self, p: ChunkPart, spare: bool = False) -> np.ndarray:
        """Chunk ``p`` whole with its trailer, its CRC32C checked (else Corrupt): where the
        reader ``maps``, a view of its data file's mapping (``_mapping``), faulted in
        first (the page cache's pages: nothing copied before the part is); else read
        into a buffer: a kept chunk's (``spare``) or this thread's scratch buffer. (A
        (2, 4) restore of the (4, 2) 1 GB state, 30 alternating pairs: 0.51 against 0.54
        s, 0.83 against 0.89 CPU s; other series of it within this VM's noise.)"""
        size = p.nbytes + TRAILER
        if self._maps and not p.at.inline:
            try:
                data = self._mapping(p.at.file)[p.at.start : p.at.start + size]
            except OSError as e:
                raise StorageError(f"mapping {p.at.file} for chunk {p.key!r}: {e}") from e
            if len(data) < size:
                raise _cut_short(p.at, p.at.start + len(data), repr(p.key), p.at.stop)
            _fault_in(p, data)
        else:
            if spare:
                with self._lock:
                    data = self._spare_for(size)
            else:
                scratch: np.ndarray | None = getattr(self._scratch, "buf", None)
                if scratch is None or len(scratch) < size:
                    scratch = self._scratch.buf = np.empty(size, np.uint8)
                data = scratch
            view = data[:size].data
            _preadv_all(
                self._fd(p.at.file), [view], p.at.start, [ChunkRead(p.key, p.at, 0, p.nbytes)]
            )
        if crc32c.crc32c(data[: p.nbytes].data) != int.from_bytes(data[p.nbytes : size], "little"):
            raise Corrupt(p.key, p.at)
        return data

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
        assert entry is not None
        if mine:
            try:
                data = entry.data = self._chunk(p, spare=True)
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
        gone = None
        with self._lock:
            entry.left -= 1
            if entry.left <= 0 and self._kept.get(key) is entry:
                del self._kept[key]
                self._kept_bytes -= entry.nbytes
                gone, entry.data = entry.data, None
                if gone is not None and gone.base is None:  # a buffer, not a mapping
                    self._spare.append(gone)
                    gone = None
        if gone is not None:
            self._used(gone)

    def _used(self, view: np.ndarray) -> None:
        """A chunk's view of a file's mapping that is used up: its pages are unmapped
        (``mapped.let_go``) once this thread has ``USED_BYTES`` of them, in one call for
        each stretch of adjacent chunks (an unmapping interrupts every core that runs the
        process: one for each chunk cost all the mapping saved)."""
        local = self._scratch
        if not hasattr(local, "used"):
            local.used, local.used_bytes = [], 0
        local.used.append(view)
        local.used_bytes += view.nbytes
        if local.used_bytes >= USED_BYTES:
            mapped.let_go(local.used)
            local.used, local.used_bytes = [], 0

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
        fd, pos = self._fd(span.file), span.start
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


class _Waiting(Future):
    """A small slice's future: waiting for it first sends its batch to the threads."""

    def __init__(self, send: Callable[[], None]) -> None:
        super().__init__()
        self._send = send

    def result(self, timeout: float | None = None) -> Any:
        self._send()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._send()
        return super().exception(timeout)


@dataclass(frozen=True)
class _Queued:
    """A small slice waiting in a batch: its one span, chunks (by file and offset), their
    trailers, its buffer and its future."""

    span: _Span
    chunks: list[ChunkRead]
    trailers: bytearray
    buf: np.ndarray
    fut: _Waiting


def _settle(q: _Queued, crcs: Callable[[], dict[int, list[int]]]) -> None:
    """Sets ``q``'s future: its buffer once its chunks' CRC32Cs (``crcs()``, those of its
    own chunks) match their trailers, else the error."""
    try:
        _check(q.chunks, q.trailers, [crcs()])
    except BaseException as e:
        q.fut.set_exception(e)
    else:
        q.fut.set_result(q.buf)


def _unsettled(batch: list[_Queued], task: Future[None]) -> None:
    """Once a batch's task is over: the slices it did not settle are cancelled (``close``
    cancelled the task before it ran) or get its error, so that no waiter hangs."""
    error = None if task.cancelled() else task.exception()
    for q in batch:
        if q.fut.done() or (error is None and q.fut.cancel()):
            continue
        q.fut.set_exception(error or CancelledError())


def _own(crcs: dict[int, list[int]], base: int, n: int) -> dict[int, list[int]]:
    """A run's CRC32Cs of the ``n`` chunks from ``base`` on, by the slice's own numbers."""
    return {i: crcs[base + i] for i in range(n) if base + i in crcs}


class _Kept:
    """A chunk read in part by several slices: its checked bytes (or the error its read
    raised), the users still to copy from it, and a lock held while it is read."""

    def __init__(self, users: int, nbytes: int) -> None:
        self.left, self.nbytes = users, nbytes
        self.ready = threading.Lock()
        self.data: np.ndarray | None = None
        self.error: BaseException | None = None


def _cut_short(
    first: arrays.ChunkBytes, ends: int, chunks: str, stop: int, when: str = ""
) -> StorageError:
    """A data file that ends at byte ``ends``, before the bytes the B-tree gives ``chunks``
    (from ``first``'s start to ``stop``)."""
    return StorageError(
        f"the data file {first.file} ends at byte {ends}, before the bytes {first.start}-"
        f"{stop - 1} the OCDBT B-tree gives chunk {chunks}: the file was truncated{when}; "
        "restore another step or re-save"
    )


def _fault_in(p: ChunkPart, data: np.ndarray) -> None:
    """Chunk ``p``'s pages of its file's mapping (``data``) faulted in (``mapped.fault_in``):
    a page the file no longer has, or can't read, raises StorageError here instead of
    stopping the process with SIGBUS when it is touched."""
    try:
        mapped.fault_in(data)
    except OSError as e:
        raise StorageError(f"reading {p.at.file} for chunk {p.key!r}: {e}") from e


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

    @property
    def file(self) -> str:
        return self.chunks[0].at.file

    @property
    def stop(self) -> int:
        """The file offset past the span's last byte."""
        return self.start + sum(len(p.view) for p in self.pieces)


def _spans(chunks: list[ChunkRead], flats: list[np.ndarray], trailers: memoryview) -> list[_Span]:
    """The reads of ``chunks`` (sorted by file and offset) into ``flats[0]`` (bytes), copied
    into the others, their trailers into ``trailers``: chunks back to back in one file are
    one run, cut into spans of about ``SPLIT_BYTES`` (wherever that falls, inside a chunk
    too), each made of pieces of at most PIECE_BYTES."""
    flat, extra = flats[0].data, flats[1:]
    if len(chunks) == 1 and chunks[0].nbytes <= PIECE_BYTES:  # (most small slices)
        r = chunks[0]
        a, b = r.offset, r.offset + r.nbytes
        one = _Piece(flat[a:b], 0, tuple(e[a:b] for e in extra))
        return [_Span(r.at.start, [one, _Piece(trailers[:TRAILER], -1)], [r])]
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
        if prev is None or r.at.file != prev.at.file or not _near(prev.at.stop, r.at.start):
            cut()
            start = pos = r.at.start
            size = 0
        for gap in _gap(pos, r.at.start):
            pieces.append(gap)
            pos += len(gap.view)
            size += len(gap.view)
        prev = r
        touched.append(r)
        ranges = [(r.offset + lo, r.offset + min(r.nbytes, lo + PIECE_BYTES))
                  for lo in range(0, r.nbytes, PIECE_BYTES)]  # fmt: skip
        for piece in [
            *(_Piece(flat[a:b], i, tuple(e[a:b] for e in extra)) for a, b in ranges),
            _Piece(trailers[TRAILER * i : TRAILER * (i + 1)], -1),
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


def _near(stop: int, start: int) -> bool:
    """Whether a chunk at ``start`` follows one that ends at ``stop`` closely enough to be read
    in the same ``preadv``: back to back, or after the zero bytes before a chunk that
    ``ocdbt_write`` starts on an ``ALIGN`` boundary."""
    return 0 <= start - stop < GAP_BYTES


def _gap(stop: int, start: int) -> list[_Piece]:
    """The bytes between two chunks read together (``_near``), into scratch memory: no
    chunk's, so neither checksummed nor kept."""
    return [_Piece(memoryview(bytearray(start - stop)), -1)] if start > stop else []


def _check(chunks: list[ChunkRead], trailers: bytearray, partial: Sequence[Any]) -> None:
    """Raises Corrupt for the first chunk whose bytes' CRC32C, put together from the spans'
    ``partial`` ones (in file order), is not the one stored after it."""
    got: dict[int, int] = {}
    for p in partial:
        for i, (c, n) in p.items():  # most chunks lie in one span: nothing to combine
            got[i] = crc.combine(got[i], c, n) if i in got else c
    for i, r in enumerate(chunks):
        if got.get(i) != int.from_bytes(trailers[TRAILER * i : TRAILER * (i + 1)], "little"):
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
            raise _cut_short(run[0].at, pos, f"{run[0].key!r} and those after it", run[-1].at.stop)
        pos += n
        while at < len(views) and n >= len(views[at]):
            n -= len(views[at])
            at += 1
        if n:
            views[at] = views[at][n:]
    return pos
