"""Box arithmetic, without jax: a slice of an n-d array as ``((start, stop), ...)``, one
``[start, stop)`` per dimension (an ``Index``), and how boxes combine.

Every path that cuts, joins or keys slices (placement, read-once, safetensors, the emergency
tier's peers and plan) uses these, so a box means the same thing everywhere.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Sequence

Index = tuple[tuple[int, int], ...]  # per dimension: [start, stop)


def whole(shape: Sequence[int]) -> Index:
    """The box of a whole array."""
    return tuple((0, d) for d in shape)


def extent(box: Index) -> tuple[int, ...]:
    """The box's shape."""
    return tuple(b - a for a, b in box)


def volume(box: Index) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Index, b: Index) -> Index | None:
    """The common part of two boxes, or None when they share no element."""
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def within(part: Index, outer: Index) -> tuple[slice, ...]:
    """The NumPy slices that select ``part`` from an array holding the box ``outer``."""
    return tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(part, outer, strict=True))


def bounding(boxes: Sequence[Index]) -> Index | None:
    """The box around ``boxes`` when they tile it with at most 1.5x its volume needed
    elsewhere (replicas counted once), else None."""
    if not boxes or not boxes[0]:
        return None
    box = tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0]))
    )
    return box if volume(box) <= 1.5 * sum(volume(b) for b in set(boxes)) else None


def from_slices(index: tuple[slice, ...], shape: Sequence[int]) -> Index:
    """A device's index (a tuple of slices, maybe shorter than ``shape``) as a box over
    every dimension."""
    given = tuple(sl.indices(dim)[:2] for sl, dim in zip(index, shape, strict=False))
    return given + tuple((0, dim) for dim in shape[len(index) :])


def to_text(box: Index) -> str:
    """A box as text: ``0:16,0:8`` (``-`` for a 0-d array)."""
    return ",".join(f"{a}:{b}" for a, b in box) or "-"


@functools.lru_cache(maxsize=4096)
def from_text(text: str) -> Index:
    """The box ``to_text`` wrote (``ValueError`` on anything else). Remembered: a state's
    leaves share a few boxes, and the emergency tier parses one per slice of every process
    (docs/MEASURED.md)."""
    if text == "-":
        return ()
    return tuple((int(a), int(b)) for a, b in (part.split(":") for part in text.split(",")))


def chunks_in(region: Index, chunks: Iterable[int]) -> Iterator[tuple[int, ...]]:
    """The grid coordinates of every chunk inside the chunk-aligned ``region``."""
    ranges = [range(a // c, -(-b // c)) for (a, b), c in zip(region, chunks, strict=True)]
    return itertools.product(*ranges)
