"""How often to save: the checkpoint-interval math and the ``"auto"`` interval chooser.

The model (Daly 2006, "A higher order estimate of the optimum checkpoint interval for
restart dumps"): failures arrive at random with mean time between failures M (exponential),
training does τ seconds of work then a save blocks it for δ seconds, and after a failure the
job restarts and restores in R seconds and redoes the work since the last save. ETTR (the
effective training time ratio) is the productive share of wall time. Everything here is pure
arithmetic on seconds: the managers measure (``Measurements``), agree between processes and
call :func:`choose`.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from ...errors import OptionsError

__all__ = [
    "Choice",
    "Costs",
    "Measurements",
    "best_interval_s",
    "choose",
    "daly",
    "ettr",
    "job_mtbf_s",
    "learned_mtbf_s",
    "with_restart",
    "young",
]


def _check(name: str, value: float, *, zero: bool = False) -> None:
    """Refuses a negative (or, unless ``zero``, a zero), infinite or NaN ``value``."""
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        wanted = "a finite number >= 0" if zero else "a finite number > 0"
        raise OptionsError(f"{name} must be {wanted}, got {value!r}")


def young(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum interval (1974): ``sqrt(2 δ M)`` seconds of work."""
    _check("save_s", save_s, zero=True)
    _check("mtbf_s", mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s)


def daly(save_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum interval (2006): for δ < 2M,
    ``sqrt(2δM)·[1 + (1/3)·sqrt(δ/2M) + (1/9)·(δ/2M)] − δ``; else M."""
    _check("save_s", save_s, zero=True)
    _check("mtbf_s", mtbf_s)
    if save_s >= 2 * mtbf_s:
        return mtbf_s
    r = save_s / (2 * mtbf_s)
    return math.sqrt(2 * save_s * mtbf_s) * (1 + math.sqrt(r) / 3 + r / 9) - save_s


def with_restart(save_s: float, mtbf_s: float, restart_s: float) -> float:
    """The first-order optimum counting the restart time: ``δ + sqrt(2(M+R)δ + δ²)``.

    Close to :func:`young` when δ and R are small against M; it grows with R, whereas the
    exact optimum of :func:`ettr` does not depend on R (see :func:`best_interval_s`).
    """
    _check("save_s", save_s, zero=True)
    _check("mtbf_s", mtbf_s)
    _check("restart_s", restart_s, zero=True)
    return save_s + math.sqrt(2 * (mtbf_s + restart_s) * save_s + save_s**2)


def _log_segment(work_s: float, mtbf_s: float) -> float:
    """``log(M (e^{W/M} − 1))``, W = ``work_s``: no overflow for W ≫ M, exact as M → ∞."""
    x = work_s / mtbf_s
    if x > 1:
        return math.log(mtbf_s) + x + math.log1p(-math.exp(-x))
    return math.log(work_s) + (math.log(math.expm1(x) / x) if x > 0 else 0.0)


def ettr(interval_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """The expected productive share of wall time when each ``interval_s`` of work is followed
    by a save blocking ``save_s``, failures come at rate 1/``mtbf_s`` and each costs
    ``restart_s`` (restart + restore) plus the work since the last save.

    Daly's complete model: one segment takes ``M e^{R/M} (e^{(τ+δ)/M} − 1)`` on average, so
    ETTR = τ / that; it tends to τ/(τ+δ) as M grows, and to 0 (never an overflow) when
    segments are much longer than M.
    """
    _check("interval_s", interval_s)
    _check("save_s", save_s, zero=True)
    _check("mtbf_s", mtbf_s)
    _check("restart_s", restart_s, zero=True)
    log_segment = restart_s / mtbf_s + _log_segment(interval_s + save_s, mtbf_s)
    return math.exp(math.log(interval_s) - log_segment)


def best_interval_s(save_s: float, mtbf_s: float, restart_s: float) -> float:
    """The interval τ that maximizes :func:`ettr` (seconds of work between saves).

    Setting d(log ETTR)/dτ = 0 gives ``(1 − u)·e^u = e^{−δ/M}`` with u = τ/M: one root in
    (0, 1), found by bisection on ``log(1 − u) + u + δ/M`` (decreasing in u). R only scales
    ETTR by ``e^{−R/M}``, so it does not move the optimum (Daly 2006); it is checked, not used.
    A save that costs nothing (δ = 0) gives 0: save as often as allowed.
    """
    _check("save_s", save_s, zero=True)
    _check("mtbf_s", mtbf_s)
    _check("restart_s", restart_s, zero=True)
    d = save_s / mtbf_s
    if d == 0:
        return 0.0
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        if math.log1p(-mid) + mid + d > 0:
            lo = mid
        else:
            hi = mid
    return lo * mtbf_s


@dataclass(frozen=True)
class Costs:
    """What one save interval is chosen from, in seconds: the time of one training step, of
    one save on the calling thread, of a restart + restore, and the job's MTBF."""

    step_s: float
    save_s: float
    restart_s: float
    mtbf_s: float

    def __post_init__(self) -> None:
        _check("step_s", self.step_s)
        _check("save_s", self.save_s, zero=True)
        _check("restart_s", self.restart_s, zero=True)
        _check("mtbf_s", self.mtbf_s)


@dataclass(frozen=True)
class Choice:
    """A chosen save interval in steps, the ETTR the model predicts for it, and its inputs."""

    steps: int
    predicted_ettr: float
    costs: Costs


def choose(costs: Costs, min_steps: int, max_steps: int) -> Choice:
    """The save interval in steps: :func:`best_interval_s` over the step time, rounded (halves
    up) and held within [``min_steps``, ``max_steps``]; ``predicted_ettr`` is :func:`ettr` at
    the chosen interval (``steps × step_s`` of work between saves of ``save_s``)."""
    if min_steps < 1:
        raise OptionsError(f"min_steps must be >= 1, got {min_steps}")
    if max_steps < min_steps:
        raise OptionsError(f"max_steps ({max_steps}) must be >= min_steps ({min_steps})")
    best = best_interval_s(costs.save_s, costs.mtbf_s, costs.restart_s) / costs.step_s
    steps = min(max(math.floor(min(best, max_steps) + 0.5), min_steps), max_steps)
    predicted = ettr(steps * costs.step_s, costs.save_s, costs.mtbf_s, costs.restart_s)
    return Choice(steps, predicted, costs)


def job_mtbf_s(mtbf_hours_per_host: float, processes: int) -> float:
    """The job's MTBF in seconds: any of ``processes`` hosts failing stops the job, so the
    per-host MTBF (hours) divided by their count."""
    _check("mtbf_hours_per_host", mtbf_hours_per_host)
    if processes < 1:
        raise OptionsError(f"processes must be >= 1, got {processes}")
    return mtbf_hours_per_host * 3600 / processes


def learned_mtbf_s(
    prior_s: float, uptime_s: float, failures: int, prior_weight: float = 1.0
) -> float:
    """The MTBF estimated from a run's history: ``(w·prior + uptime) / (w + failures)``.

    The reciprocal of the posterior mean failure rate under a Gamma prior worth ``w``
    failures seen over ``w·prior`` seconds: the prior alone before anything happened,
    the observed ``uptime / failures`` once failures outweigh ``w``.
    """
    _check("prior_s", prior_s)
    _check("uptime_s", uptime_s, zero=True)
    _check("prior_weight", prior_weight)
    if failures < 0:
        raise OptionsError(f"failures must be >= 0, got {failures}")
    return (prior_weight * prior_s + uptime_s) / (prior_weight + failures)


class Measurements:
    """What one process measured: the last ``window`` step times, save blocking times and
    restore times (the managers agree on the figures between processes). Times are passed
    in; nothing here reads a clock.

    Call ``step(step, t, busy)`` when the loop reaches ``step`` at time ``t`` (a manager: at
    the start of ``save``, before it blocks), ``save(blocking_s)`` after a save has blocked
    the calling thread. A step time is Δt/Δstep between two ``step`` calls, less the
    blocking of the saves reported between them; ``busy`` says whether a background write
    ran in that stretch (None: not known). A step that is not above the previous one (a
    restore went back) starts afresh from there without a step time.

    A background write is not free: it competes with the loop for the host (CPU, memory
    bandwidth), so steps run slower while it runs. ``contention_s`` is what one write of
    ``write_s`` seconds costs the loop that way, from the step times with and without one.
    """

    def __init__(self, window: int = 64) -> None:
        if window < 1:
            raise OptionsError(f"window must be >= 1, got {window}")
        self.step_s: deque[float] = deque(maxlen=window)
        self.idle_step_s: deque[float] = deque(maxlen=window)  # no background write ran
        self.busy_step_s: deque[float] = deque(maxlen=window)  # one did
        self.save_s: deque[float] = deque(maxlen=window)
        self.restore_s: deque[float] = deque(maxlen=window)
        self._last: tuple[int, float] | None = None
        self._blocked_s = 0.0  # save blocking since the last step() call

    def step(self, step: int, t: float, busy: bool | None = None) -> None:
        """The loop reached ``step`` at time ``t`` (seconds, any fixed origin); ``busy``:
        a background write ran since the last call."""
        last, self._last = self._last, (step, t)
        blocked, self._blocked_s = self._blocked_s, 0.0
        if last is not None and step > last[0]:
            seconds = (t - last[1] - blocked) / (step - last[0])
            if seconds > 0:
                self.step_s.append(seconds)
                if busy is not None:
                    (self.busy_step_s if busy else self.idle_step_s).append(seconds)

    def save(self, blocking_s: float, *, warmup: bool = False) -> None:
        """A save blocked the calling thread for ``blocking_s`` seconds. A ``warmup`` save
        (a job's first: compiling, first exchanges) is left out of the save times; its
        blocking still is not counted as step time."""
        _check("blocking_s", blocking_s, zero=True)
        if not warmup:
            self.save_s.append(blocking_s)
        self._blocked_s += blocking_s

    def restore(self, seconds: float) -> None:
        """A restore took ``seconds``."""
        _check("seconds", seconds, zero=True)
        self.restore_s.append(seconds)

    def split(self) -> tuple[float, float] | None:
        """Median step times (without, with) a background write; None before 2 of each."""
        if len(self.idle_step_s) < 2 or len(self.busy_step_s) < 2:
            return None
        return statistics.median(self.idle_step_s), statistics.median(self.busy_step_s)

    def contention_s(self, write_s: float) -> float:
        """The loop's time lost to one background write of ``write_s`` seconds: the steps
        it overlaps run at the busy step time instead of the idle one, so
        ``write_s × (1 − idle/busy)``; 0 before both were measured, or if busy steps are
        not slower."""
        _check("write_s", write_s, zero=True)
        split = self.split()
        if split is None or split[1] <= split[0]:
            return 0.0
        return write_s * (1 - split[0] / split[1])

    def costs(self, mtbf_s: float, contention_s: float = 0.0) -> Costs | None:
        """The medians as ``Costs`` with ``mtbf_s``: the step time without a background
        write where both kinds were measured; the save cost its blocking plus
        ``contention_s``; ``restart_s`` the median restore time, 0 before any restore.
        None before 2 step times and a save were measured."""
        if len(self.step_s) < 2 or not self.save_s:
            return None
        split = self.split()
        step = split[0] if split is not None else statistics.median(self.step_s)
        restart = statistics.median(self.restore_s) if self.restore_s else 0.0
        save = statistics.median(self.save_s) + contention_s
        return Costs(step, save, restart, mtbf_s)
