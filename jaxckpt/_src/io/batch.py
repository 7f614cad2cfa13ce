"""Small slices read together: a task and a wake-up of a thread for each one cost more than
reading it (a restore of thousands of small leaves), so slices of at most
``layout.SMALL_CHUNK_BYTES`` wait in a batch of about ``BATCH_BYTES`` that one thread
reads, chunks back to back in a file in one ``preadv`` across slices."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import spans
from .chunk_plan import ChunkRead
from .spans import Piece, Span

BATCH_BYTES = 1 << 20


class Waiting(Future):
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
class Queued:
    """A small slice waiting in a batch: its one span, chunks (by file and offset), their
    trailers, its buffer and its future."""

    span: Span
    chunks: list[ChunkRead]
    trailers: bytearray
    buf: np.ndarray
    fut: Waiting


class Batcher:
    """The batch of small slices not yet handed to the threads of ``pool``; ``read``
    reads one span (returning its chunks' CRC32Cs, ``spans.read``)."""

    def __init__(self, pool: Executor, read: Callable[[Span], dict[int, list[int]]]) -> None:
        self._pool, self._read = pool, read
        self._lock = threading.Lock()
        self._batch: list[Queued] = []
        self._bytes = 0

    def add(
        self, span: Span, chunks: list[ChunkRead], trailers: bytearray, buf: np.ndarray
    ) -> Waiting:
        """Puts a small slice (its one span) in the batch, which goes to the threads once it
        holds ``BATCH_BYTES`` (or when a caller waits for one of its slices: ``send``)."""
        q = Queued(span, chunks, trailers, buf, Waiting(self.send))
        with self._lock:
            self._batch.append(q)
            self._bytes += buf.nbytes
            full = self._bytes >= BATCH_BYTES
        if full:
            self.send()
        return q.fut

    def send(self) -> None:
        """Hands the batch to the threads (a no-op when empty)."""
        with self._lock:
            batch, self._batch, self._bytes = self._batch, [], 0
        if batch:
            task = self._pool.submit(self._read_batch, batch)
            task.add_done_callback(functools.partial(_unsettled, batch))

    def cancel(self) -> None:
        """Cancels the slices not yet handed over (a closing reader)."""
        with self._lock:
            batch, self._batch, self._bytes = self._batch, [], 0
        for q in batch:
            q.fut.cancel()

    def _read_batch(self, batch: list[Queued]) -> None:
        """Reads a batch of small slices, each one's chunks checked and its future set as
        its run is in: slices whose spans lie back to back in one file are one run, read
        in ``preadv`` calls of about ``spans.PIECE_BYTES``. A run that fails is read again
        slice by slice, so that each slice gets its own error, naming its own chunks."""
        live = [q for q in batch if q.fut.set_running_or_notify_cancel()]
        runs: list[list[Queued]] = []
        for q in live:
            last = runs[-1][-1].span if runs else None
            if (
                last is not None
                and last.file == q.span.file
                and spans.near(last.stop, q.span.start)
            ):
                runs[-1].append(q)
            else:
                runs.append([q])
        for run in runs:
            bases: list[int] = []
            pieces: list[Piece] = []
            chunks: list[ChunkRead] = []
            for k, q in enumerate(run):
                base = len(chunks)
                bases.append(base)
                if k:
                    pieces += spans.gap(run[k - 1].span.stop, q.span.start)
                chunks += q.span.chunks
                pieces += [
                    p if p.chunk < 0 or not base else p._replace(chunk=p.chunk + base)
                    for p in q.span.pieces
                ]
            try:
                crcs = self._read(Span(run[0].span.start, pieces, chunks))
            except Exception:
                for q in run:
                    _settle(q, functools.partial(self._read, q.span))
                continue
            for q, base in zip(run, bases, strict=True):
                _settle(q, functools.partial(_own, crcs, base, len(q.chunks)))


def _settle(q: Queued, crcs: Callable[[], dict[int, list[int]]]) -> None:
    """Sets ``q``'s future: its buffer once its chunks' CRC32Cs (``crcs()``, those of its
    own chunks) match their trailers, else the error."""
    try:
        spans.check(q.chunks, q.trailers, [crcs()])
    except BaseException as e:
        q.fut.set_exception(e)
    else:
        q.fut.set_result(q.buf)


def _unsettled(batch: list[Queued], task: Future[None]) -> None:
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
