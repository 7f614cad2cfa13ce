"""A chunk that slices need parts of (a restore onto another mesh), read once for all of
them in pieces that stay in the CPU's cache: each piece checksummed, then its values copied
into every slice that needs them, while it is still in the cache.

Read whole into a buffer, checked, then copied out (and kept for the other slices' threads),
a chunk passed three times over memory the cache no longer held; mapped, its pages cost a
fault each (docs/MEASURED.md). Here it passes through one scratch buffer of about
``PIECE_BYTES`` a thread; the slices' bytes count only once the chunk's CRC32C matches (a
corrupt chunk fails every slice it was copied into).

A piece is a run of whole rows (first-axis slabs) where a row fits in ``PIECE_BYTES``; where
it does not (a chunk of one wide row: a layer of stacked weights, an expert), a run of the
first axis along which one slab fits, every axis before it held at one index (``cut``), so
that no chunk's shape takes the scratch buffer beyond a piece or the piece out of the cache.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import crc32c
import numpy as np

from . import crc, spans
from .chunk_plan import ChunkPart, ChunkRead
from .inflight import Watch
from .layout import TRAILER

PIECE_BYTES = spans.PIECE_BYTES  # read at a time: about this many bytes


class Cut(NamedTuple):
    """How a chunk is read a piece at a time: along ``axis``, ``step`` indices a piece, each
    index a slab of ``slab`` bytes (every axis after ``axis`` whole), each axis before it at
    one index."""

    axis: int
    step: int
    slab: int

    @property
    def piece_bytes(self) -> int:
        """The most bytes a piece holds: the scratch buffer a read needs."""
        return self.step * self.slab


def cut(p: ChunkPart) -> Cut:
    """The pieces chunk ``p`` is read in: whole rows, at most ``PIECE_BYTES`` of them (one
    at least), where a row fits in ``PIECE_BYTES``; else the first axis whose slabs fit, or
    single values along the last. The pieces along that axis are as even as they can be (a
    row just wider than a piece: two halves, not a piece and a sliver)."""
    shape = p.chunk_shape
    slab = p.nbytes
    for axis, n in enumerate(shape):
        if n == 0:
            return Cut(axis, 1, 0)
        slab //= n
        if slab <= PIECE_BYTES or axis == len(shape) - 1:
            most = max(1, PIECE_BYTES // max(1, slab))  # slabs a piece holds at most
            pieces = -(-n // most)
            return Cut(axis, -(-n // pieces), slab)
    return Cut(0, 1, p.nbytes)  # (no axes: no part of it is ever wanted)


def read(
    fd: int,
    chunk: ChunkPart,
    targets: Sequence[tuple[ChunkPart, Sequence[np.ndarray]]],
    scratch: np.ndarray,
    watch: Watch | None = None,
) -> None:
    """Reads ``chunk`` (any of its parts: the key and bytes are the chunk's) from file
    ``fd`` a piece at a time (``cut``) into ``scratch`` (uint8, at least
    ``cut(chunk).piece_bytes``), and copies each piece's values of every part in ``targets``
    (the part, the buffers of its slice: itself and its replicas, of the slice's dtype)
    into place; raises ``crc.Corrupt`` where the chunk's CRC32C does not match its trailer
    (the buffers then hold bytes that must not be used), StorageError where its file ends
    early or can't be read."""
    shape = chunk.chunk_shape
    axis, step, slab = cut(chunk)
    dtype = targets[0][1][0].dtype
    trailer = bytearray(TRAILER)
    run = [ChunkRead(chunk.key, chunk.at, 0, chunk.nbytes)]
    pos, got, end = chunk.at.start, 0, chunk.at.start + chunk.nbytes
    if not chunk.nbytes:  # (no values: its trailer alone, the CRC32C of no bytes)
        spans.preadv_all(fd, [memoryview(trailer)], pos, run, watch, TRAILER)
    outers = itertools.product(*map(range, shape[:axis])) if chunk.nbytes else ()
    for outer in outers:  # (whole rows: () once)
        wanted = [(p, bs) for p, bs in targets if _holds(p.src, outer)]
        for a in range(0, shape[axis], step):
            b = min(shape[axis], a + step)
            n = (b - a) * slab
            last = pos + n == end
            views = [scratch[:n].data, memoryview(trailer)] if last else [scratch[:n].data]
            pos = spans.preadv_all(fd, views, pos, run, watch, n + (TRAILER if last else 0))
            got = crc32c.crc32c(scratch[:n].data, got)
            if wanted:
                values = scratch[:n].view(dtype).reshape((b - a, *shape[axis + 1 :]))
                for part, bufs in wanted:
                    _copy(part, outer, values, a, b, bufs)
    crc.verify(chunk.key, chunk.at, got, trailer)


def _holds(src: tuple[slice, ...], outer: tuple[int, ...]) -> bool:
    """Whether a part taking ``src`` of its chunk takes anything at the index ``outer`` of
    the chunk's first axes."""
    return all(s.start <= i < s.stop for s, i in zip(src, outer, strict=False))


def _copy(
    part: ChunkPart,
    outer: tuple[int, ...],
    values: np.ndarray,
    a: int,
    b: int,
    bufs: Sequence[np.ndarray],
) -> None:
    """The values of the chunk at ``outer`` (its first axes' indices), ``a`` to ``b`` along
    the next (``values``), that ``part`` takes, into place in each of ``bufs``."""
    k = len(outer)
    s = part.src[k]
    lo, hi = max(a, s.start), min(b, s.stop)
    if lo >= hi:
        return
    d = part.dst[k].start + lo - s.start
    at = tuple(t.start + i - f.start for t, i, f in zip(part.dst, outer, part.src, strict=False))
    src = (slice(lo - a, hi - a), *part.src[k + 1 :])
    dst = (*at, slice(d, d + hi - lo), *part.dst[k + 1 :])
    for buf in bufs:
        buf[dst] = values[src]
