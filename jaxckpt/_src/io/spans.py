"""How the direct reader reads whole chunks: ``preadv`` runs of chunks back to back in a
data file into the slice's buffer (``Span``s of ``Piece``s), their CRC32C trailers into a
scratch array, each piece checksummed as it arrives.

A run of chunks is cut into spans of about ``SPLIT_BYTES`` (wherever that falls, inside a
chunk too), so that one large slice keeps every thread busy; each chunk's CRC32C is put
together from its spans' (``crc.combine``) and checked (``check``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import numpy as np

from ...errors import StorageError
from . import arrays, crc
from .chunk_plan import ChunkRead
from .inflight import Watch
from .layout import ALIGN, TRAILER

PIECE_BYTES = 4 << 20  # read and checksummed at a time: in the last-level cache between the two
SPLIT_BYTES = 8 << 20  # a thread's share of a slice's whole chunks
IOV_MAX = 1024  # Linux's limit on the buffers of one preadv


class Piece(NamedTuple):
    """Bytes read in one go: where they go (``view``), the index of their chunk (-1: a CRC
    trailer) and where else (``copies``: the same bytes of the slice's other buffers).
    (A tuple: a restore makes one for every piece it reads.)"""

    view: memoryview
    chunk: int
    copies: tuple[np.ndarray, ...] = ()


@dataclass(frozen=True)
class Span:
    """Consecutive bytes of one data file that one thread reads: from ``start`` on, into
    ``pieces``; ``chunks``: those it touches, for errors."""

    start: int
    pieces: list[Piece]
    chunks: list[ChunkRead]

    @property
    def file(self) -> str:
        return self.chunks[0].at.file

    @property
    def stop(self) -> int:
        """The file offset past the span's last byte."""
        return self.start + sum(len(p.view) for p in self.pieces)


def spans(chunks: list[ChunkRead], flats: list[np.ndarray], trailers: memoryview) -> list[Span]:
    """The reads of ``chunks`` (sorted by file and offset) into ``flats[0]`` (bytes), copied
    into the others, their trailers into ``trailers``: chunks back to back in one file are
    one run, cut into spans of about ``SPLIT_BYTES`` (wherever that falls, inside a chunk
    too), each made of pieces of at most PIECE_BYTES."""
    flat, extra = flats[0].data, flats[1:]
    if len(chunks) == 1:  # (most slices)
        return _one_chunk(chunks[0], flat, extra, trailers)
    spans: list[Span] = []
    pieces: list[Piece] = []
    touched: list[ChunkRead] = []
    start = pos = size = 0
    prev: ChunkRead | None = None

    def cut() -> None:
        if pieces:
            spans.append(Span(start, list(pieces), list(touched)))
        pieces.clear()
        touched.clear()

    for i, r in enumerate(chunks):
        if prev is None or r.at.file != prev.at.file or not near(prev.at.stop, r.at.start):
            cut()
            start = pos = r.at.start
            size = 0
        for zeros in gap(pos, r.at.start):
            pieces.append(zeros)
            pos += len(zeros.view)
            size += len(zeros.view)
        prev = r
        touched.append(r)
        ranges = [(r.offset + lo, r.offset + min(r.nbytes, lo + PIECE_BYTES))
                  for lo in range(0, r.nbytes, PIECE_BYTES)]  # fmt: skip
        for piece in [
            *(Piece(flat[a:b], i, tuple(e[a:b] for e in extra)) for a, b in ranges),
            Piece(trailers[TRAILER * i : TRAILER * (i + 1)], -1),
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


def _one_chunk(
    r: ChunkRead, flat: memoryview, extra: Sequence[np.ndarray], trailers: memoryview
) -> list[Span]:
    """``spans`` of a slice that is one chunk: its pieces, then its trailer, cut into spans
    of about ``SPLIT_BYTES`` (the trailer stays with the last piece)."""
    out: list[Span] = []
    pieces: list[Piece] = []
    start, size, stop = r.at.start, 0, r.offset + r.nbytes
    for a in range(r.offset, stop, PIECE_BYTES):
        if size >= SPLIT_BYTES:
            out.append(Span(start, pieces, [r]))
            start, size, pieces = start + size, 0, []
        b = min(stop, a + PIECE_BYTES)
        pieces.append(Piece(flat[a:b], 0, tuple(e[a:b] for e in extra) if extra else ()))
        size += b - a
    pieces.append(Piece(trailers[:TRAILER], -1))
    out.append(Span(start, pieces, [r]))
    return out


def near(stop: int, start: int) -> bool:
    """Whether a chunk at ``start`` follows one that ends at ``stop`` closely enough to be read
    in the same ``preadv``: back to back, or after the zero bytes before a chunk that
    ``ocdbt_write`` starts on an ``ALIGN`` boundary."""
    return 0 <= start - stop < ALIGN


def gap(stop: int, start: int) -> list[Piece]:
    """The bytes between two chunks read together (``near``), into scratch memory: no
    chunk's, so neither checksummed nor kept."""
    return [Piece(memoryview(bytearray(start - stop)), -1)] if start > stop else []


def check(chunks: list[ChunkRead], trailers: bytearray, partial: Sequence[Any]) -> None:
    """Raises ``crc.Corrupt`` for the first chunk whose bytes' CRC32C, put together from the spans'
    ``partial`` ones (in file order), is not the one stored after it."""
    got: dict[int, int] = {}
    for p in partial:
        for i, (c, n) in p.items():  # most chunks lie in one span: nothing to combine
            got[i] = crc.combine(got[i], c, n) if i in got else c
    for i, r in enumerate(chunks):
        crc.verify(r.key, r.at, got.get(i), trailers[TRAILER * i : TRAILER * (i + 1)])


def preadv_all(
    fd: int,
    views: list[memoryview],
    pos: int,
    run: list[ChunkRead],
    watch: Watch | None = None,
    nbytes: int | None = None,
) -> int:
    """Fills ``views`` (``nbytes`` in all, where the caller knows) from ``pos`` on (a read
    may return less); returns the next position. ``watch``: each ``preadv`` is watched
    (``Watch.enter``), so a stalled one is named with its file and bytes."""
    end = 0
    if watch is not None:
        end = pos + (sum(map(len, views)) if nbytes is None else nbytes)
    at = 0  # the first view not yet filled
    while at < len(views):
        todo = views[at:] if at else views
        if watch is not None:
            watch.enter(run[0].at.file, pos, end)
        try:
            n = os.preadv(fd, todo, pos)
        except OSError as e:
            raise StorageError(f"reading {run[0].at.file} at byte {pos} failed: {e}") from e
        finally:
            if watch is not None:
                watch.leave()
        if n == 0:
            raise cut_short(run[0].at, pos, f"{run[0].key!r} and those after it", run[-1].at.stop)
        pos += n
        while at < len(views) and n >= len(views[at]):
            n -= len(views[at])
            at += 1
        if n:
            views[at] = views[at][n:]
    return pos


def cut_short(
    first: arrays.ChunkBytes, ends: int, chunks: str, stop: int, when: str = ""
) -> StorageError:
    """A data file that ends at byte ``ends``, before the bytes the B-tree gives ``chunks``
    (from ``first``'s start to ``stop``)."""
    return StorageError(
        f"the data file {first.file} ends at byte {ends}, before the bytes {first.start}-"
        f"{stop - 1} the OCDBT B-tree gives chunk {chunks}: the file was truncated{when}; "
        "restore another step or re-save"
    )


def read(fd: int, span: Span, watch: Watch | None = None) -> dict[int, list[int]]:
    """Reads ``span`` of the file ``fd`` in ``preadv`` calls of about ``PIECE_BYTES``, each
    piece checksummed (and copied into the slice's copies) as soon as it is in; returns
    {chunk: [CRC32C, length] of its bytes in the span}. ``watch``: see ``preadv_all``."""
    pos = span.start
    crcs: dict[int, list[int]] = {}
    group: list[Piece] = []
    size = 0
    for piece in [*span.pieces, Piece(memoryview(b""), -2)]:  # -2: the end
        i, view = piece.chunk, piece.view
        if group and (i == -2 or size + len(view) > PIECE_BYTES or len(group) == IOV_MAX):
            pos = preadv_all(fd, [g.view for g in group], pos, span.chunks, watch, size)
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
