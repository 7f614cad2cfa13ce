"""A chunk that slices need parts of (a restore onto another mesh), read once for all of
them in pieces of whole rows that stay in the CPU's cache: each piece checksummed, then its
rows copied into every slice that needs them, while it is still in the cache.

Read whole into a buffer, checked, then copied out (and kept for the other slices' threads),
a chunk passed three times over memory the cache no longer held; mapped, its pages cost a
fault each (docs/MEASURED.md). Here it passes through one scratch buffer of about
``PIECE_BYTES`` a thread; the slices' bytes count only once the chunk's CRC32C matches (a
corrupt chunk fails every slice it was copied into).
"""

from __future__ import annotations

from collections.abc import Sequence

import crc32c
import numpy as np

from . import crc, spans
from .chunk_plan import ChunkPart, ChunkRead
from .inflight import Watch
from .layout import TRAILER

PIECE_BYTES = spans.PIECE_BYTES  # rows read at a time: about this many bytes


def rows_per_piece(p: ChunkPart) -> int:
    """Rows (first-axis slabs) of chunk ``p`` read at a time: about ``PIECE_BYTES``, one at
    least."""
    return max(1, PIECE_BYTES // max(1, p.nbytes // p.chunk_shape[0]))


def read(
    fd: int,
    chunk: ChunkPart,
    targets: Sequence[tuple[ChunkPart, Sequence[np.ndarray]]],
    scratch: np.ndarray,
    watch: Watch | None = None,
) -> None:
    """Reads ``chunk`` (any of its parts: the key and bytes are the chunk's) from file
    ``fd`` a piece of rows at a time into ``scratch`` (uint8, at least a piece), and copies
    each piece's rows of every part in ``targets`` (the part, the buffers of its slice:
    itself and its replicas, of the slice's dtype) into place; raises ``crc.Corrupt`` where
    the chunk's CRC32C does not match its trailer (the buffers then hold bytes that must
    not be used), StorageError where its file ends early or can't be read."""
    shape = chunk.chunk_shape
    rows = shape[0]
    row_bytes = chunk.nbytes // rows
    step = rows_per_piece(chunk)
    dtype = targets[0][1][0].dtype
    trailer = bytearray(TRAILER)
    run = [ChunkRead(chunk.key, chunk.at, 0, chunk.nbytes)]
    pos, got = chunk.at.start, 0
    for a in range(0, rows, step):
        b = min(rows, a + step)
        n = (b - a) * row_bytes
        views = [scratch[:n].data]
        if b == rows:
            views.append(memoryview(trailer))
        pos = spans.preadv_all(fd, views, pos, run, watch, n + (TRAILER if b == rows else 0))
        got = crc32c.crc32c(scratch[:n].data, got)
        values = scratch[:n].view(dtype).reshape((b - a, *shape[1:]))
        for part, bufs in targets:
            _copy_rows(part, values, a, b, bufs)
    crc.verify(chunk.key, chunk.at, got, trailer)


def _copy_rows(
    part: ChunkPart, values: np.ndarray, a: int, b: int, bufs: Sequence[np.ndarray]
) -> None:
    """The rows ``a`` to ``b`` of the chunk (``values``) that ``part`` takes, into place in
    each of ``bufs``."""
    s0, s1 = part.src[0].start, part.src[0].stop
    lo, hi = max(a, s0), min(b, s1)
    if lo >= hi:
        return
    d0 = part.dst[0].start + lo - s0
    src = (slice(lo - a, hi - a), *part.src[1:])
    dst = (slice(d0, d0 + hi - lo), *part.dst[1:])
    for buf in bufs:
        buf[dst] = values[src]
