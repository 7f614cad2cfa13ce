"""A leaf's content fingerprint: three 31-bit lanes that depend on its values alone, not on
how it was laid out (mesh, process count, chunks), so that two steps can be compared without
reading them (``jaxckpt diff``) and a save of unchanged arrays noticed (a stale state).

The definition (docs/FORMAT.md, "Fingerprints"): view the stored bits of the leaf as *limbs*
(uint16 for elements of 2 bytes or more, uint8 for 1-byte ones), so that the array is a grid
of ``rows x columns`` limbs: ``rows`` the product of every dimension but the last, ``columns``
the last dimension times the limbs per element. Lane ``l`` of the fingerprint is

    sum over limbs of  R_l(row) * K_l(column // B) * c_l(column % B) * limb    (mod P)

with ``P = 2**31 - 1``, ``B = 2048``, weights drawn by splitmix64 from the *global* row and
column: ``R`` and ``K`` in [1, P), ``c`` in [1, 2**26). A sum of per-limb terms splits along
any partition of the array: each writer adds up its own pieces (:func:`of_piece`, while it
writes them) and the sums of every process are added at commit (:func:`combine`).

Why this shape: ``c * limb`` summed over one block of ``B`` columns stays under 2**53, so a
block's sum is an exact float64 matrix-vector product (BLAS, one pass over the limbs after
one widening copy); the rest is integer arithmetic on one value per block and per row.

Collision odds: a single changed limb always changes every lane (each weight is nonzero
modulo the prime ``P`` and a limb is under ``P``). For any other change, a lane stays equal
with odds at most 2**-26 + 2**-31 over the weights, and the lanes draw their weights
independently: about 2**-77 for all three. It detects accidents (a stale state, a bit
flip), not tampering: the weights are public.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence

import numpy as np

Index = Sequence[tuple[int, int]]  # a piece's [start, stop) along each dimension

P = (1 << 31) - 1  # a prime: every nonzero weight and limb is invertible modulo it
B = 2048  # columns whose weighted sum is one exact float64 product
SMALL = 1 << 26  # c_l(.) < SMALL: B * SMALL * 2**16 <= 2**53
LANES = 3
SEEDS = {  # splitmix64 seeds of each lane's row, block and in-block column weights
    "row": (0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B),
    "block": (0xA54FF53A5F1D36F1, 0x510E527FADE682D1, 0x9B05688C2B3E6C1F),
    "column": (0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179, 0xCBBB9D5DC1059ED8),
}
TILE_LIMBS = 1 << 18  # limbs widened at a time (2 MiB of float64, kept per writer thread)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output for each of ``x`` (uint64 arrays wrap modulo 2**64 silently)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def weights(indices: np.ndarray, kind: str, below: int) -> np.ndarray:
    """Every lane's ``1 + splitmix64(i ^ seed) % (below - 1)`` of each index (the lane's
    ``kind`` seed): in [1, below), int64, lanes x indices."""
    seeds = np.array(SEEDS[kind], np.uint64)[:, None]
    mixed = splitmix64(np.asarray(indices).astype(np.uint64)[None, :] ^ seeds)
    return (mixed % np.uint64(below - 1)).astype(np.int64) + 1


_COLUMN = weights(np.arange(B), "column", SMALL).astype(np.float64)  # c_l(u), exact


@functools.lru_cache(maxsize=4096)
def _range_weights(kind: str, start: int, stop: int) -> np.ndarray:
    """``weights`` of the indices ``start`` ... ``stop - 1`` (rows or blocks; the leaves of
    a state share a few shapes and layouts, so each range comes again and again)."""
    out = weights(np.arange(start, stop), kind, P)
    out.flags.writeable = False
    return out


def _weights_of(kind: str, indices: np.ndarray) -> np.ndarray:
    """``weights(indices, kind, P)``, remembered where ``indices`` is a short range."""
    n = len(indices)
    if n <= 1 << 16 and (n == 1 or indices[-1] - indices[0] == n - 1):
        return _range_weights(kind, int(indices[0]), int(indices[0]) + n)
    return weights(indices, kind, P)


def limbs(data: np.ndarray) -> np.ndarray:
    """``data``'s stored bits as limbs (uint16, or uint8 for 1-byte elements): the last
    dimension times the limbs per element; a 0-d array becomes one row."""
    data = np.ascontiguousarray(data)
    if data.ndim == 0:
        data = data.reshape(1)
    return data.view(np.uint8 if data.dtype.itemsize == 1 else np.uint16)


def of_piece(data: np.ndarray, index: Index, shape: Sequence[int]) -> tuple[int, ...]:
    """Each lane's sum over ``data``, the part of a leaf of ``shape`` at ``index`` (its
    stored dtype, C order); zeros for no elements."""
    if data.size == 0:
        return (0,) * LANES
    bits = limbs(data)
    cols = bits.shape[-1]
    grid = bits.reshape(-1, cols)
    per = cols // data.shape[-1] if data.ndim else cols
    first = (index[-1][0] if len(index) else 0) * per  # global column of grid[:, 0]
    rows = _global_rows(index, shape)
    if grid.size <= SMALL_PIECE_LIMBS:
        return _small(grid, first, rows)
    block, off = divmod(first, B)
    head = 0 if off == 0 else min(cols, B - off)  # the rest of a block begun elsewhere
    whole = (cols - head) // B
    with _Rows(grid.shape[0]) as sums:
        if head:
            sums.partial(grid[:, :head], block, off)
            block += 1
        if whole:
            sums.whole(grid[:, head : head + whole * B], block)
        if head + whole * B < cols:
            sums.partial(grid[:, head + whole * B :], block + whole, 0)
    lanes = _mod(_weights_of("row", rows) * sums.lanes)
    return tuple(int(v) % P for v in lanes.sum(axis=1))


SMALL_PIECE_LIMBS = 1 << 15
"""Pieces of at most this many limbs go through :func:`_small`: a dozen NumPy calls in all,
where the tiled path's fixed work (a few dozen calls) was most of a small leaf's time."""


_PERIODIC = np.tile(_COLUMN.T, (SMALL_PIECE_LIMBS // B + 2, 1))  # c_l(j % B) from j = 0


def _small(grid: np.ndarray, first: int, rows: np.ndarray) -> tuple[int, ...]:
    """:func:`of_piece` of a small ``grid`` (rows x columns of limbs, global columns from
    ``first``, global rows ``rows``): every limb times its in-block weight at once (exact
    in float64), summed per block with ``reduceat``, then the block and row weights."""
    n, off = grid.shape[1], first % B
    starts = np.arange(B - off if off else B, n, B)  # where each next block begins
    starts = np.concatenate([[0], starts]).astype(np.intp)
    terms = grid.astype(np.float64)[:, :, None] * _PERIODIC[off : off + n][None, :, :]
    # one fold (see _fold) before each product keeps every value under 2**63
    sums = _fold(np.add.reduceat(terms, starts, axis=1).astype(np.int64))  # rows, blocks, 3
    blocks = np.arange(first // B, first // B + len(starts))
    sums *= _weights_of("block", blocks).T[None, :, :]
    per_row = _fold(_fold(sums).sum(axis=1))  # rows, lanes: under 2**33 each before the sum
    per_row *= _weights_of("row", rows).T
    return tuple(int(v) % P for v in _fold(per_row).sum(axis=0))


def _fold(x: np.ndarray) -> np.ndarray:
    """``(x & P) + (x >> 31)`` in place: the same value modulo P, under 2**33 for any
    non-negative int64 (under 2**32 for ``x`` under 2**62), cheaper than a whole ``_mod``."""
    high = x >> 31
    x &= P
    x += high
    return x


def _mod(x: np.ndarray) -> np.ndarray:
    """``x % P`` of non-negative int64 values under 2**62, in place: P is 2**31 - 1, so a
    value folds as ``(x & P) + (x >> 31)`` (NumPy's integer ``%`` and ``fmod`` divide one
    element at a time, several times slower)."""
    _fold(_fold(x))  # under 2**32, then under 2**31 + 2
    x -= P * (x >= P)
    return x


_spare: list[np.ndarray] = []  # tile buffers of TILE_LIMBS float64, one per writer thread
_spare_lock = threading.Lock()


class _Rows:
    """Each row's lanes of one piece, summed over its blocks (modulo P), from runs of
    columns widened a tile at a time into a float64 buffer kept between pieces and saves
    (a fresh one a piece was a third of a small piece's time: its pages faulted in)."""

    def __init__(self, rows: int) -> None:
        self.lanes = np.zeros((LANES, rows), np.int64)
        self._buf: np.ndarray | None = None

    def __enter__(self) -> _Rows:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._buf is not None:
            with _spare_lock:
                _spare.append(self._buf)
            self._buf = None

    def _tile(self, run: np.ndarray) -> np.ndarray:
        """``run``'s limbs widened to float64 (exact), in the kept buffer."""
        if self._buf is None:
            with _spare_lock:
                self._buf = _spare.pop() if _spare else None
        if self._buf is None or self._buf.size < run.size:
            self._buf = np.empty(max(TILE_LIMBS, run.size), np.float64)
        tile = self._buf[: run.size].reshape(run.shape)
        np.copyto(tile, run, casting="unsafe")
        return tile

    def _add(self, rows: slice, sums: np.ndarray, block_w: np.ndarray) -> None:
        """Each lane's ``sums`` (exact; lanes x rows x blocks) times the blocks' weights
        (lanes x blocks), added."""
        got = _mod(sums.astype(np.int64))  # exact: integers under 2**53
        got *= block_w[:, None, :]
        got = _mod(got)
        here = self.lanes[:, rows]
        here += got[:, :, 0] if got.shape[2] == 1 else got.sum(axis=-1)
        _mod(here)

    def partial(self, part: np.ndarray, block: int, start: int) -> None:
        """Columns ``start``... of global block ``block``, for every row."""
        n = part.shape[1]
        step = max(1, TILE_LIMBS // n)
        block_w = _range_weights("block", block, block + 1)
        columns = _COLUMN[:, start : start + n]
        for r in range(0, part.shape[0], step):
            tile = self._tile(part[r : r + step])
            sums = np.empty((LANES, tile.shape[0], 1))
            for lane in range(LANES):
                np.matmul(tile, columns[lane], out=sums[lane, :, 0])
            self._add(slice(r, r + tile.shape[0]), sums, block_w)

    def whole(self, part: np.ndarray, block: int) -> None:
        """Whole blocks ``block``, ``block + 1``... (``part``'s columns), for every row."""
        rows, count = part.shape[0], part.shape[1] // B
        blocks = part.reshape(rows, count, B)
        step_b = max(1, min(count, TILE_LIMBS // B))
        step_r = max(1, TILE_LIMBS // (step_b * B))
        block_w = _weights_of("block", np.arange(block, block + count))
        for k in range(0, count, step_b):
            for r in range(0, rows, step_r):
                tile = self._tile(blocks[r : r + step_r, k : k + step_b])
                flat = tile.reshape(-1, B)
                sums = np.empty((LANES, *tile.shape[:2]))
                for lane in range(LANES):
                    np.matmul(flat, _COLUMN[lane], out=sums[lane].reshape(-1))
                self._add(slice(r, r + tile.shape[0]), sums, block_w[:, k : k + step_b])


def _global_rows(index: Index, shape: Sequence[int]) -> np.ndarray:
    """The global row number (C order over every dimension but the last) of each row of
    the piece at ``index``, in the piece's order."""
    rows = np.zeros(1, np.int64)
    for (a, b), n in zip(index[:-1], shape[:-1], strict=True):
        rows = (rows[:, None] * n + np.arange(a, b, dtype=np.int64)[None, :]).reshape(-1)
    return rows


def combine(parts: Iterable[Sequence[int]]) -> tuple[int, ...]:
    """A leaf's lanes from the lanes of its pieces (any partition)."""
    out = [0] * LANES
    for part in parts:
        out = [(a + b) % P for a, b in zip(out, part, strict=True)]
    return tuple(out)


def to_text(lanes: Sequence[int]) -> str:
    """As stored in a leaf record: each lane as 8 lower-case hex digits, 24 in all."""
    return "".join(f"{v % P:08x}" for v in lanes)


def from_text(text: str) -> tuple[int, ...]:
    """The lanes of a stored fingerprint (ValueError if ``text`` is not one)."""
    if len(text) != 8 * LANES:
        raise ValueError(f"a fingerprint has {8 * LANES} hex digits, got {text!r}")
    return tuple(int(text[i : i + 8], 16) for i in range(0, len(text), 8))


def of_array(data: np.ndarray) -> str:
    """The fingerprint of a whole leaf held in one array (stored dtype), as stored."""
    return to_text(of_piece(data, [(0, n) for n in data.shape], data.shape))


class Sums:
    """Each leaf's lanes summed over the pieces a writer has seen: added to by several
    writer threads; ``texts()`` for the commit's round to process 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, tuple[int, ...]] = {}

    def add(self, leaf: str, data: np.ndarray, index: Index, shape: Sequence[int]) -> None:
        lanes = of_piece(data, index, shape)
        with self._lock:
            self._sums[leaf] = combine([self._sums.get(leaf, (0,) * LANES), lanes])

    def texts(self) -> dict[str, str]:
        with self._lock:
            return {leaf: to_text(v) for leaf, v in self._sums.items()}
