"""What a run's log says about its goodput: wall and productive time, ETTR, the failures and
what each cost (rework, restart, restore), the saves' overhead, the restores by tier, and the
save interval that would have maximized ETTR with the costs measured (docs/GOODPUT.md)."""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ...errors import OptionsError
from . import intervals, runlog
from .runlog import Event


@dataclass(frozen=True)
class Loss:
    """One failure: a job that died (no ``end``) and what it cost the job after it."""

    job: str
    failed_t: float  # the failed job's last event: the best known time of its death
    reached_step: int  # the highest step the failed job reached
    restored_step: int | None  # what the next job restored; None: nothing (it began at 0)
    steps_lost: int
    rework_s: float  # steps_lost x the median step time
    restart_s: float  # failed_t to when the next job began its restore (or started, without one)
    restore_s: float
    tier: str | None  # the tier the next job restored from


@dataclass(frozen=True)
class SaveCost:
    tier: str
    count: int
    blocking_s: float  # median, on the calling thread
    write_s: float  # median, in the background until committed


@dataclass(frozen=True)
class RestoreCost:
    tier: str
    count: int
    seconds: float  # median


@dataclass(frozen=True)
class Interval:
    """The save interval of a tier that maximizes the predicted ETTR, and the one used."""

    tier: str
    steps: int
    seconds: float
    predicted_ettr: float
    used_steps: int | None  # the median distance between this tier's saves in the run
    used_ettr: float | None  # the predicted ETTR at ``used_steps``


@dataclass(frozen=True)
class Goodput:
    """The goodput of one process's view of a run (``jaxckpt.goodput``)."""

    path: str
    process: int
    jobs: int
    wall_s: float
    productive_s: float
    ettr: float | None  # productive / wall (None for a log of one instant)
    save_overhead_s: float
    lost_s: float  # rework + restart + restore over the failures
    idle_s: float  # between a clean end and the next job's start, plus its restore
    failures: int
    mtbf_s: float | None  # wall / failures
    step_s: float | None  # median seconds per step
    last_step: int | None
    losses: tuple[Loss, ...]
    saves: tuple[SaveCost, ...]
    restores: tuple[RestoreCost, ...]
    intervals: tuple[Interval, ...]
    skipped: int  # lines of the log that were torn, garbled or newer
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        """A plain JSON-able dict (``jaxckpt goodput --json``)."""
        return json.loads(json.dumps(asdict(self)))

    def text(self) -> str:
        """A human report (``jaxckpt goodput``)."""
        return "\n".join(_lines(self)) + "\n"


def goodput(run: str | os.PathLike, *, process: int = 0) -> Goodput:
    """Analyses the run log under ``run`` (a manager's directory) as process ``process`` saw it."""
    log = runlog.read(run, process)
    jobs = _jobs(log.events)
    step_s = _step_time(jobs)
    notes = list(log.notes)
    losses, idle_s = [], 0.0
    for job, after in zip(jobs, jobs[1:], strict=False):
        if any(e.event == "end" for e in job):
            restore = _first(after, "restore")
            idle_s += max(0.0, (_first(after, "start") or after[0]).t - job[-1].t)
            idle_s += number(restore.fields, "seconds") if restore else 0.0
            continue
        losses.append(_loss(job, after, step_s or 0.0))
        if losses[-1].restored_step is None:
            notes.append(f"job {after[0].job} restored nothing after a failure: it began at step 0")
    if not any(e.event == "end" for e in jobs[-1]):
        notes.append(
            f"the last job ({jobs[-1][0].job}) has no end: still running, or it died and "
            "nothing restarted it (not counted as a failure)"
        )
    if step_s is None and losses:
        notes.append("step time unknown (fewer than two steps logged in a job): rework counted 0")
    events = log.events
    wall_s = events[-1].t - events[0].t
    saves = [e for e in events if e.event == "save"]
    overhead = sum(number(e.fields, "blocking_s") for e in saves)
    lost = sum(x.rework_s + x.restart_s + x.restore_s for x in losses)
    productive = max(0.0, wall_s - overhead - lost - idle_s)
    mtbf_s = wall_s / len(losses) if losses and wall_s > 0 else None
    save_costs = _save_costs(saves)
    restart_s = statistics.median([x.restart_s + x.restore_s for x in losses] or [0.0])
    return Goodput(
        path=log.path,
        process=process,
        jobs=len(jobs),
        wall_s=wall_s,
        productive_s=productive,
        ettr=productive / wall_s if wall_s > 0 else None,
        save_overhead_s=overhead,
        lost_s=lost,
        idle_s=idle_s,
        failures=len(losses),
        mtbf_s=mtbf_s,
        step_s=step_s,
        last_step=runlog.previous_step(events),
        losses=tuple(losses),
        saves=save_costs,
        restores=_restore_costs([e for e in events if e.event == "restore"]),
        intervals=tuple(
            i
            for c in save_costs
            if (i := _interval(c, jobs, step_s, mtbf_s, restart_s)) is not None
        ),
        skipped=log.skipped,
        notes=tuple(notes),
    )


def _jobs(events: Sequence[Event]) -> list[tuple[Event, ...]]:
    """The events of each job (one process start), jobs in the order they began."""
    by_job: dict[str, list[Event]] = {}
    for e in events:
        by_job.setdefault(e.job, []).append(e)
    return [tuple(v) for v in by_job.values()]


def _first(job: Sequence[Event], kind: str) -> Event | None:
    return next((e for e in job if e.event == kind), None)


def number(fields: Mapping[str, Any], key: str) -> float:
    """A finite, non-negative number from an event's fields (0 when absent or damaged)."""
    v = fields.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float):
        return 0.0
    return float(v) if math.isfinite(v) and v >= 0 else 0.0


def _tier(e: Event) -> str:
    tier = e.fields.get("tier")
    return tier if isinstance(tier, str) else "?"


def _loss(job: Sequence[Event], after: Sequence[Event], step_s: float) -> Loss:
    reached = max((e.step for e in job if e.step is not None and e.event != "start"), default=0)
    restore = _first(after, "restore")
    restored = restore.step if restore is not None else None
    lost = max(0, reached - (restored or 0))
    start = _first(after, "start") or after[0]
    # the restart runs until the restore began (the next job's start-up, its model and
    # manager built, included), or until that job started when it restored nothing
    back = restore.t - number(restore.fields, "seconds") if restore else start.t
    return Loss(
        job=job[0].job,
        failed_t=job[-1].t,
        reached_step=reached,
        restored_step=restored,
        steps_lost=lost,
        rework_s=lost * step_s,
        restart_s=max(0.0, back - job[-1].t),
        restore_s=number(restore.fields, "seconds") if restore else 0.0,
        tier=_tier(restore) if restore else None,
    )


def _step_time(jobs: Sequence[Sequence[Event]]) -> float | None:
    """The median seconds per step between the steps a job logged (``step`` and ``save``).

    A step's time is its ``step`` event's; else, for a saved step, when its save was called:
    a save is logged as it commits, ``write_s + blocking_s`` after the call. The blocking
    time of a step's saves (save overhead, counted apart) is taken out of the interval that
    follows it."""
    rates = []
    for job in jobs:
        reached: dict[int, list[float]] = {}  # step -> [time reached, seconds blocked there]
        for e in job:
            if e.event == "save" and e.step is not None:
                blocking = number(e.fields, "blocking_s")
                at = reached.setdefault(e.step, [e.t - number(e.fields, "write_s") - blocking, 0])
                at[1] += blocking
        for e in job:
            if e.event == "step" and e.step is not None:
                reached.setdefault(e.step, [e.t, 0])[0] = e.t
        points = sorted(reached.items())
        for (s0, (t0, blocked)), (s1, (t1, _)) in zip(points, points[1:], strict=False):
            if t1 - t0 - blocked > 0:
                rates.append((t1 - t0 - blocked) / (s1 - s0))
    return statistics.median(rates) if rates else None


def _save_costs(saves: Sequence[Event]) -> tuple[SaveCost, ...]:
    tiers = sorted({_tier(e) for e in saves})
    return tuple(
        SaveCost(
            tier,
            len(mine := [e for e in saves if _tier(e) == tier]),
            statistics.median(number(e.fields, "blocking_s") for e in mine),
            statistics.median(number(e.fields, "write_s") for e in mine),
        )
        for tier in tiers
    )


def _restore_costs(restores: Sequence[Event]) -> tuple[RestoreCost, ...]:
    tiers = sorted({_tier(e) for e in restores})
    return tuple(
        RestoreCost(
            tier,
            len(mine := [e for e in restores if _tier(e) == tier]),
            statistics.median(number(e.fields, "seconds") for e in mine),
        )
        for tier in tiers
    )


def _interval(
    cost: SaveCost,
    jobs: Sequence[Sequence[Event]],
    step_s: float | None,
    mtbf_s: float | None,
    restart_s: float,
) -> Interval | None:
    """The best interval of one tier with the measured costs (None without failures or a
    step time: no MTBF to weigh the saves against)."""
    if mtbf_s is None or not step_s:
        return None
    gaps = []
    for job in jobs:
        saved = [e.step for e in job if e.event == "save" and _tier(e) == cost.tier]
        held = sorted(s for s in saved if s is not None)
        gaps += [b - a for a, b in zip(held, held[1:], strict=False) if b > a]
    used = round(statistics.median(gaps)) if gaps else None
    try:
        best = intervals.best_interval_s(cost.blocking_s, mtbf_s, restart_s)
        steps = max(1, math.floor(best / step_s + 0.5))  # halves up, as intervals.choose
        predicted = intervals.ettr(steps * step_s, cost.blocking_s, mtbf_s, restart_s)
        used_ettr = (
            intervals.ettr(used * step_s, cost.blocking_s, mtbf_s, restart_s) if used else None
        )
    except (OptionsError, ValueError, OverflowError, ZeroDivisionError):
        return None
    return Interval(cost.tier, steps, steps * step_s, predicted, used, used_ettr)


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    """``rows`` under ``header`` in aligned columns, after a ``title`` line."""
    cells = [list(header), *([str(c) for c in r] for r in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return [title] + [
        "  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells
    ]


def _lines(g: Goodput) -> list[str]:
    losses = g.losses
    rework, restart = sum(x.rework_s for x in losses), sum(x.restart_s for x in losses)
    step = "-" if g.step_s is None else f"{g.step_s:.4g} s"
    out = [
        f"run log {g.path} (process {g.process}): {g.jobs} job(s), last step {'-' if g.last_step is None else g.last_step}",
        f"  wall time       {_s(g.wall_s)}",
        f"  productive      {_s(g.productive_s)}   ETTR {_pct(g.ettr)}",
        f"  save overhead   {_s(g.save_overhead_s)}   ({sum(c.count for c in g.saves)} saves, blocking)",
        f"  lost            {_s(g.lost_s)}   (rework {_s(rework)}, restart {_s(restart)}, "
        f"restore {_s(sum(x.restore_s for x in losses))})",
        f"  idle            {_s(g.idle_s)}   (from a clean end to the next job's start)",
        f"  step time       {step} (median)",
    ]
    if not losses:
        out.append("  failures        no failures observed (no MTBF, so no best interval)")
    else:
        out.append(f"  failures        {g.failures}, MTBF observed {_s(g.mtbf_s)}")
        out += _table(
            "failures:",
            ("job", "reached", "restored", "steps lost", "rework", "restart", "restore", "tier"),
            [
                (
                    x.job,
                    x.reached_step,
                    "nothing" if x.restored_step is None else x.restored_step,
                    x.steps_lost,
                    _s(x.rework_s),
                    _s(x.restart_s),
                    _s(x.restore_s),
                    x.tier or "-",
                )
                for x in losses
            ],  # fmt: skip
        )
    out += _table(
        "saves by tier (medians):",
        ("tier", "count", "blocking", "write"),
        [(c.tier, c.count, f"{c.blocking_s:.3f} s", f"{c.write_s:.3f} s") for c in g.saves],
    )
    out += _table(
        "restores by tier (median):",
        ("tier", "count", "seconds"),
        [(c.tier, c.count, f"{c.seconds:.3f} s") for c in g.restores],
    )
    if g.intervals:
        out += _table(
            "the interval that maximizes ETTR with these costs (and the one used):",
            ("tier", "best steps", "seconds", "predicted ETTR", "used steps", "its ETTR"),
            [
                (
                    i.tier,
                    i.steps,
                    _s(i.seconds),
                    _pct(i.predicted_ettr),
                    i.used_steps or "-",
                    _pct(i.used_ettr),
                )
                for i in g.intervals
            ],  # fmt: skip
        )
    if g.skipped:
        out.append(f"{g.skipped} line(s) of the log skipped (torn, garbled or newer)")
    return out + [f"note: {n}" for n in g.notes]
