"""PLACEHOLDER (runlog worktree only): the two functions of the interval math that the goodput
report uses, per the shared design. The intervals engineer's module replaces this file when
the branches merge; drop this copy then."""

from __future__ import annotations

import math


def ettr(interval_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """Daly's complete model: a segment of τ work + δ save takes ``M e^{R/M} (e^{(τ+δ)/M} − 1)``
    on average with exponential failures of mean M; ETTR = τ / that."""
    segment = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((interval_s + save_s) / mtbf_s)
    return interval_s / segment


def best_interval_s(save_s: float, mtbf_s: float, restart_s: float) -> float:
    """The τ maximizing :func:`ettr`: the root u = τ/M of ``log(1 − u) + u + δ/M = 0``."""
    d = save_s / mtbf_s
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.log1p(-mid) + mid + d > 0 else (lo, mid)
    return lo * mtbf_s
