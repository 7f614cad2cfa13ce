"""The direct read path: a local checkpoint's chunks read with ``os.preadv`` straight into
the destination buffer, their CRC32C checked as they arrive; TensorStore is the fallback.

TensorStore's read of a chunk passes over its bytes two or three times (the OCDBT value,
the CRC32C, the zarr decode, a copy into our buffer). Where a chunk is stored raw and is a
contiguous region of the slice being read, its bytes can go where they belong in one read:
``chunk_plan`` finds such slices (one B-tree walk for every chunk of a restore), ``Reader``
reads them. Chunks adjacent in a data file are read in one ``preadv``, their 4-byte CRC
trailers into a scratch array; each piece is checksummed right after it arrives, while it
is still in the CPU's cache. Slices that cut through chunks (a restore onto another mesh,
or ending in an edge chunk zarr padded) are read in groups (``start_group``): each chunk
once for every slice of the group that needs a part of it, a piece (of rows, or of a row's
slabs) at a time, each piece checked and copied into those slices while it is in the cache
(``scatter``; a chunk must be read whole to check it, and TensorStore reads it whole too).
As a slice's read is issued, the kernel is asked to read its chunks ahead (``residency``).
``JAXCKPT_DIRECT_READ=0`` turns the path off (for benchmarks and debugging).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import crc32c
import numpy as np

from ...errors import StorageError
from ..storage import Location
from . import arrays, crc, linux, mapped, scatter, spans
from .batch import Batcher
from .chunk_plan import ChunkPart, ChunkRead, SliceRead
from .files import Files
from .inflight import Watch
from .layout import SMALL_CHUNK_BYTES, TRAILER


def enabled(loc: Location) -> bool:
    """Whether restores from ``loc`` use the direct path (local files; the switch on)."""
    return loc.is_local and hasattr(os, "preadv") and linux.switched_on(linux.DIRECT_READ)


def reader_threads() -> int:
    """Threads for the direct reads: half the cores, 2 to 8 (a read from the page cache is a
    memory copy and a CRC: more threads than cores only contend; docs/MEASURED.md)."""
    return min(8, max(2, (os.cpu_count() or 2) // 2))


class Reader:
    """Reads ``SliceRead``s on a few threads; ``close`` stops them and closes the files.

    Its parts, one idea each: ``files`` (descriptors, prefetch advice), the batch of small
    slices (``batch.Batcher``) and the chunks read in part (``scatter``)."""

    def __init__(
        self,
        threads: int | None = None,
        prefetch: bool = True,
        watch: Watch | None = None,
    ) -> None:
        """``prefetch``: ask the kernel to read ahead (``Files.prefetch``). ``watch``: every
        ``preadv`` and fault-in of a mapping is watched (``Watch.enter``), so a stalled one
        is named, and ``close`` leaves a thread stuck in one behind."""
        self.watch = watch
        self.pool = ThreadPoolExecutor(
            threads or reader_threads(), thread_name_prefix="jaxckpt-direct"
        )
        self.files = Files(prefetch)
        self._batch = Batcher(self.pool, self._read_span)
        self._scratch = threading.local()  # each thread's buffer for chunks read in part

    def start(
        self, sr: SliceRead, into: np.ndarray | None = None, copies: Sequence[np.ndarray] = ()
    ) -> Future[np.ndarray]:
        """Reads ``sr`` on the threads, into a fresh buffer or ``into`` (C-contiguous, of
        the slice's shape and dtype), and its bytes into each of ``copies`` (the same) too,
        piece by piece as they are checked, while they are in the CPU's cache (a slice's
        replicas on CPU devices). Whole chunks are read in spans of about ``SPLIT_BYTES``,
        each on a thread of its own, so one large slice keeps every thread busy; each
        chunk's CRC32C is put together from its spans' (``crc.combine``). A slice that
        needs parts of chunks is a group of one (``start_group``)."""
        if sr.parts:
            out, group = self._group([(sr, into, copies)])
            return together(self.pool, group, lambda _: _raised(out[0]))
        buf, extra = self._buffers(sr, into, copies)
        if SMALL_CHUNK_BYTES < buf.nbytes <= spans.SPLIT_BYTES:  # most slices: one task
            return self.pool.submit(self._read_whole, sr, buf, extra)
        chunks, trailers, runs = _spans(sr, buf, extra)
        if len(runs) == 1 and buf.nbytes <= SMALL_CHUNK_BYTES:
            return self._batch.add(runs[0], chunks, trailers, buf)
        tasks = [functools.partial(self._read_span, span) for span in runs]
        return together(self.pool, tasks, lambda crcs: _checked(chunks, trailers, crcs, buf))

    def start_group(
        self, items: Sequence[tuple[SliceRead, np.ndarray | None, Sequence[np.ndarray]]]
    ) -> Future[list[np.ndarray | Exception]]:
        """Reads several slices (``start``'s ``sr``, ``into``, ``copies`` each) with one
        future for them all (a restore issues hundreds of slices of a few MiB, and the
        thread that issues them was its bottleneck): those of whole chunks (each of at most
        ``spans.SPLIT_BYTES``) in turn on one thread; the chunks that the others need parts
        of, in file order, each read once for every slice of the group that needs a part of
        it (``scatter``), in runs of about ``PART_RUN_BYTES`` a thread. The future gives
        each slice's buffer, or the error its read raised (naming its chunk), in order."""
        out, tasks = self._group(items)
        return together(self.pool, tasks, lambda _: out)

    def _group(
        self, items: Sequence[tuple[SliceRead, np.ndarray | None, Sequence[np.ndarray]]]
    ) -> tuple[list[np.ndarray | Exception], list[Callable[[], None]]]:
        """``start_group``'s buffers (each slice's, or its error: already where its memory
        can't be had, so that only it fails) and its tasks."""
        work: list[tuple[SliceRead, np.ndarray, list[np.ndarray]]] = []
        out: list[np.ndarray | Exception] = []
        for sr, into, copies in items:
            try:
                buf, extra = self._buffers(sr, into, copies)
            except Exception as e:
                work.append((sr, np.empty(0, np.uint8), []))
                out.append(e)
                continue
            work.append((sr, buf, extra))
            out.append(buf)
        live = [k for k, got in enumerate(out) if not isinstance(got, Exception)]
        users: dict[str, list[tuple[int, ChunkPart]]] = {}
        for k in live:
            for p in work[k][0].parts:
                users.setdefault(p.key, []).append((k, p))
        wholes = [k for k in live if not work[k][0].parts]
        tasks: list[Callable[[], None]] = []
        if wholes:
            tasks.append(functools.partial(self._read_wholes, work, wholes, out))
        run: list[list[tuple[int, ChunkPart]]] = []
        size = 0
        for parts in sorted(users.values(), key=lambda u: (u[0][1].at.file, u[0][1].at.start)):
            run.append(parts)
            size += parts[0][1].nbytes
            if size >= PART_RUN_BYTES:
                tasks.append(functools.partial(self._scatter, work, run, out))
                run, size = [], 0
        if run:
            tasks.append(functools.partial(self._scatter, work, run, out))
        return out, tasks

    def _read_wholes(
        self, work: list[tuple[SliceRead, np.ndarray, list[np.ndarray]]], which: list[int],
        out: list[np.ndarray | Exception],
    ) -> None:  # fmt: skip
        for k in which:
            try:
                self._read_whole(*work[k])
            except Exception as e:
                out[k] = e

    def _scatter(
        self,
        work: list[tuple[SliceRead, np.ndarray, list[np.ndarray]]],
        chunks: list[list[tuple[int, ChunkPart]]],
        out: list[np.ndarray | Exception],
    ) -> None:
        """Each of ``chunks`` (the slices of ``work`` that need a part of it, by position,
        and the part) read once and copied into them (``scatter.read``); a chunk whose read
        fails fails each of them."""
        for parts in chunks:
            live = [(k, p) for k, p in parts if not isinstance(out[k], Exception)]
            if not live:
                continue
            chunk = live[0][1]
            targets = [(p, [work[k][1], *work[k][2]]) for k, p in live]
            try:
                scratch = self._scratch_buffer(scatter.cut(chunk).piece_bytes)
                scatter.read(self.files.fd(chunk.at.file), chunk, targets, scratch, self.watch)
            except Exception as e:
                for k, _ in live:
                    out[k] = e

    def _scratch_buffer(self, size: int) -> np.ndarray:
        """This thread's scratch buffer, of ``size`` bytes at least."""
        scratch: np.ndarray | None = getattr(self._scratch, "buf", None)
        if scratch is None or len(scratch) < size:
            scratch = self._scratch.buf = np.empty(size, np.uint8)
        return scratch

    def map(self, sr: SliceRead, replicas: int = 0) -> Future[tuple[np.ndarray, ...]]:
        """Slice ``sr`` (``mapped.suitable``) as private mappings of its chunks in the data
        files (several: each at its place, ``mapped.chunks``), each chunk's CRC32C checked
        over them, and ``replicas`` more such copies (one for each other device of the
        slice), on the threads: no fresh memory, no copy."""
        self._prefetch(sr)
        return self.pool.submit(self._map, sr, replicas)

    def _map(self, sr: SliceRead, replicas: int) -> tuple[np.ndarray, ...]:
        chunks = sorted(sr.chunks, key=lambda c: c.offset)
        first = [c.at for c in chunks if c.at.file == chunks[0].at.file]
        with self._watched(first[0].file, min(a.start for a in first), max(a.stop for a in first)):
            return self._map_chunks(sr, chunks, replicas)

    def _map_chunks(
        self, sr: SliceRead, chunks: list[ChunkRead], replicas: int
    ) -> tuple[np.ndarray, ...]:
        parts = [(self.files.fd(c.at.file), c.at.start, c.nbytes) for c in chunks]
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
                got = crc32c.crc32c(flat[c.offset : c.offset + c.nbytes].data)
                crc.verify(c.key, c.at, got, trailer)
            copies = [mapping(False) for _ in range(replicas)]
        except OSError as e:
            raise StorageError(
                f"chunks {[c.key for c in chunks]} of {chunks[0].at.file}: {e}"
            ) from e
        return tuple(f[:nbytes].view(sr.dtype).reshape(sr.shape) for f in [flat, *copies])

    def send(self) -> None:
        """Hands the batch of small slices to the threads (a no-op when empty)."""
        self._batch.send()

    def _buffers(
        self, sr: SliceRead, into: np.ndarray | None, copies: Sequence[np.ndarray]
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Slice ``sr``'s buffer (``into``, else fresh memory) and its copies', its read
        ahead asked for (``_prefetch``)."""
        buf = arrays.buffer_for(into, sr.shape, sr.dtype)
        extra = [arrays.buffer_for(c, sr.shape, sr.dtype) for c in copies]
        self._prefetch(sr)
        return buf, extra

    def _prefetch(self, sr: SliceRead) -> None:
        if self.files.prefetching:  # (else not even the list of its chunks)
            self.files.prefetch([c.at for c in sr.chunks] + [p.at for p in sr.parts])

    def close(self) -> None:
        """Stops the threads and closes the files; where a thread is stuck in the kernel
        past the watch's bound (``Watch.stop``), it is left behind, and the files with it
        (closing them could give their descriptors to other files under its reads)."""
        self._batch.cancel()
        if self.watch is not None and not self.watch.stop():
            self.pool.shutdown(wait=False, cancel_futures=True)
            return
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.files.close()

    @contextlib.contextmanager
    def _watched(self, file: str, start: int, stop: int) -> Iterator[None]:
        """A call that may block in the kernel on bytes ``start`` to ``stop`` of ``file``
        (page faults of a mapping), watched (``Watch.enter``)."""
        if self.watch is None:
            yield
            return
        self.watch.enter(file, start, stop)
        try:
            yield
        finally:
            self.watch.leave()

    def _read_whole(self, sr: SliceRead, buf: np.ndarray, extra: list[np.ndarray]) -> np.ndarray:
        """A slice one thread reads: its spans made here (not on the thread that issues the
        reads, which a restore keeps busy), read in turn, then checked."""
        chunks, trailers, runs = _spans(sr, buf, extra)
        spans.check(chunks, trailers, [self._read_span(span) for span in runs])
        return buf

    def _read_span(self, span: spans.Span) -> dict[int, list[int]]:
        return spans.read(self.files.fd(span.file), span, self.watch)


PART_RUN_BYTES = spans.SPLIT_BYTES  # a group's chunks read in part: a thread's share

T = TypeVar("T")
R = TypeVar("R")


def together(
    pool: ThreadPoolExecutor, tasks: Sequence[Callable[[], T]], finish: Callable[[list[T]], R]
) -> Future[R]:
    """One future for ``tasks``, each run on ``pool``: ``finish`` of their results (in
    order) once every one is done, or the first error a task raised (a cancelled one's
    too: a reader that closes sets every future)."""
    out: Future[R] = Future()
    results: list[Any] = [None] * len(tasks)
    left = [len(tasks)]
    lock = threading.Lock()

    def settle() -> None:
        try:
            value = finish(results)
        except BaseException as e:
            out.set_exception(e)
        else:
            out.set_result(value)

    def done(k: int, fut: Future[T]) -> None:
        try:
            results[k] = fut.result()
        except BaseException as e:
            with lock:
                if not out.done():
                    out.set_exception(e)
            return
        with lock:
            left[0] -= 1
            if left[0] or out.done():
                return
        settle()

    if not tasks:
        settle()
    for k, task in enumerate(tasks):
        pool.submit(task).add_done_callback(functools.partial(done, k))
    return out


def _raised(got: np.ndarray | Exception) -> np.ndarray:
    if isinstance(got, Exception):
        raise got
    return got


def _checked(
    chunks: list[ChunkRead], trailers: bytearray, crcs: list[Any], buf: np.ndarray
) -> np.ndarray:
    """``buf``, once its chunks' CRC32Cs, put together from its spans' (``crcs``), match."""
    spans.check(chunks, trailers, crcs)
    return buf


def _spans(
    sr: SliceRead, buf: np.ndarray, extra: list[np.ndarray]
) -> tuple[list[ChunkRead], bytearray, list[spans.Span]]:
    """The reads of slice ``sr``'s whole chunks into ``buf`` (and ``extra``, its copies):
    its chunks in file order, the scratch for their trailers and the spans (``spans.spans``)."""
    chunks = list(sr.chunks)
    if len(chunks) > 1:
        chunks.sort(key=lambda r: (r.at.file, r.at.start))
    trailers = bytearray(TRAILER * len(chunks))
    flats = [b.reshape(-1).view(np.uint8) for b in [buf, *extra]]
    return chunks, trailers, spans.spans(chunks, flats, memoryview(trailers))
