"""Which steps a tier saves: a fixed interval, ``"continuous"``, or ``"auto"``, chosen from
measurement.

A fixed interval saves the multiples of it, as always. ``"continuous"`` saves the first step
after the previous save committed (the tier's writer has no save in flight): the next save
starts as soon as the last one is written. With several processes, whether it committed is
agreed at each step until it has, in one key-value round (``multihost.decided``: process 0
says yes once every process's writer is done), so every process saves the same steps; the
first step of a job is due. ``"auto"`` saves every ``interval``
steps after the last save, the interval being the one that maximizes the expected goodput
(:mod:`jaxckpt._src.goodput.intervals`) given the step time, the save's blocking time and the
restart cost measured here, and the job's MTBF (``mtbf_hours`` per host, divided by the
process count; learned from the run log with that as prior). A save's cost is its blocking
plus what its background write costs the loop (steps run slower while the tier's writer
runs: measured, not assumed). It is re-decided after the first saves and then every
``REDECIDE_EVERY`` saves, from inputs agreed between processes (process 0 takes the worst
of every process's figures and publishes them), so every process saves the same steps.
Until every process has measured enough, the first decision agrees on where to start: the
interval the run log says an earlier job chose (the largest any process's log gives; a
replaced host's log is gone), so a restarted job does not measure its way up again.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import json
import statistics
import time
from dataclasses import dataclass

import jax

from ...errors import RunLogError
from .. import multihost
from ..storage import Location
from ..writer import Writer
from . import intervals, runlog
from .runlog import Event, RunLog

REDECIDE_EVERY = 8
"""Measured saves between two decisions, after those at the 1st, 2nd and 4th measured save
(and one at a job's first save, on where to start)."""

WARMUP_SAVES = 2
"""A job's first saves, left out of what is measured: they compile, make the first peer
exchanges and find cold caches (they block many times as long as a later save:
docs/MEASURED.md), a cost each job pays once, not one each save pays."""

# names of the agreement rounds: the n-th cadence of a directory and tier in this process
# (every process makes its managers of a run in the same order)
_instances: collections.Counter[str] = collections.Counter()


@dataclass(frozen=True)
class Blocking:
    """How long a save blocked its caller: from ``since`` to ``until`` (a background save:
    when it was handed to the writer), or to when ``seconds`` is asked (a save written on
    the calling thread, asked once written)."""

    since: float
    until: float | None

    def seconds(self) -> float:
        return (self.until or time.perf_counter()) - self.since


@dataclass(frozen=True)
class History:
    """What the run log says about earlier jobs of this run: time up, failures, restarts."""

    uptime_s: float = 0.0
    failures: int = 0
    restarts_s: tuple[float, ...] = ()
    intervals: tuple[tuple[str, int], ...] = ()  # (tier, steps): the last "auto" choices

    @classmethod
    def of(cls, events: tuple[Event, ...] | list[Event], *, restarting: bool = False) -> History:
        """From the events of one process's log (a job that ends without ``end`` and is
        followed by another job failed; its restart runs to the next job's ``restore``).
        ``restarting``: a new job starts after these events, so the last job failed too if
        it did not end (a manager reads the history as it starts)."""
        jobs: dict[str, list[Event]] = {}
        for e in sorted(events, key=lambda e: e.t):
            jobs.setdefault(e.job, []).append(e)
        runs = list(jobs.values())
        uptime = sum(run[-1].t - run[0].t for run in runs)
        failures, restarts = 0, []
        for run, after in itertools.pairwise([*runs, *([[]] if restarting else [])]):
            if any(e.event == "end" for e in run):
                continue
            failures += 1
            back = next((e for e in after if e.event == "restore"), None)
            if back is not None and back.t >= run[-1].t:  # (a clock stepped back: no figure)
                restarts.append(back.t - run[-1].t)
        chosen = {
            e.fields["tier"]: e.fields["steps"]
            for e in sorted(events, key=lambda e: e.t)
            if e.event == "interval"
            and isinstance(e.fields.get("tier"), str)
            and type(e.fields.get("steps")) is int
            and 1 <= e.fields["steps"] < 2**63
        }
        return cls(max(0.0, uptime), failures, tuple(restarts), tuple(sorted(chosen.items())))

    def interval(self, tier: str) -> int | None:
        """The interval an earlier job last chose for ``tier`` (None: none did)."""
        return dict(self.intervals).get(tier)


class Cadence:
    """Decides, for one tier, whether a step is due; every process must give it the same
    steps (``due`` at every ``save`` call, ``saved`` after every save of this tier)."""

    def __init__(
        self,
        tier: str,
        interval: int | str,
        *,
        mtbf_hours: float | None = None,
        min_steps: int = 1,
        max_steps: int = 10_000,
        history: History | None = None,
        log: RunLog | None = None,
        timeout_s: float = 600.0,
        writer: Writer | None = None,
        where: str = "",
    ) -> None:
        self.tier, self.auto = tier, interval == "auto"
        self.continuous = interval == "continuous"
        # every process starts "auto" at the same interval, whatever its log says (a
        # replaced host has none): they must save the same steps before they first agree
        self.interval = min_steps if self.auto else 1 if self.continuous else int(interval)
        self.min_steps, self.max_steps = min_steps, max_steps
        self.history = history or History()
        self.measured = intervals.Measurements()
        for r in self.history.restarts_s:
            self.measured.restore(r)
        self.prior_s = (
            intervals.job_mtbf_s(mtbf_hours, multihost.process_count()) if mtbf_hours else None
        )
        self.choice: intervals.Choice | None = None
        self._log, self._timeout_s = log, timeout_s
        self._writer = writer  # this tier's background writes: their time and contention
        self._activity: tuple[int, bool] | None = None
        self._warmup_writes: int | None = None  # the number of the warm-up's last write
        self._measuring = False  # the warm-up's writes ended before the last due()
        self._last: int | None = None
        self._saves = 0
        self._committed = True  # "continuous": the last save committed on every process
        self._rounds = 0  # "continuous": agreement rounds so far (their names)
        run = f"{hashlib.sha256(where.encode()).hexdigest()[:12]}/{tier}"
        self._name = f"jaxckpt/cadence/{run}/{_instances[run]}"
        _instances[run] += 1
        self._started = time.monotonic()

    def due(self, step: int) -> bool:
        """Whether ``step`` is one this tier saves (also records when it was reached)."""
        if self.continuous:
            return self._last_committed()
        if not self.auto:
            return step % self.interval == 0
        busy = None
        if self._writer is not None:
            before, self._activity = self._activity, self._writer.activity()
            if before is not None and self._measuring:
                busy = before[1] or before[0] != self._activity[0]
            self._measuring = (
                self._warmup_writes is not None and self._writer.ended() >= self._warmup_writes
            )
        self.measured.step(step, time.perf_counter(), busy)
        return self._last is None or step - self._last >= self.interval

    def _last_committed(self) -> bool:
        """Whether this tier's last save committed on every process ("continuous"): this
        process's writer has no save in flight (a cancelled one counts as ended), agreed in
        one round per call while any process may still be writing."""
        if self._committed:
            return True
        mine = self._writer is None or self._writer.idle_within(0.0)
        if multihost.process_count() == 1:
            self._committed = mine
        else:
            self._rounds += 1
            agreed = multihost.decided(
                f"{self._name}/committed/{self._rounds}",
                "1" if mine else "0",
                _all_committed,
                self._timeout_s,
                what=f"agreeing whether the {self.tier} tier's last save committed (continuous)",
            )
            self._committed = agreed == "1"
        return self._committed

    def restored(self, step: int, seconds: float) -> None:
        """A restore of ``step`` took ``seconds``: part of the restart cost; saves count
        from it."""
        self._last = step
        self.measured.restore(seconds)

    def saved(self, step: int, blocking_s: float) -> None:
        """``step`` was saved, blocking the caller ``blocking_s``; maybe decides again."""
        self._last = step
        self._committed = False  # "continuous": due again once this one committed
        if not self.auto:
            return
        self._saves += 1
        self.measured.save(blocking_s, warmup=self._saves <= WARMUP_SAVES)
        if self._saves == WARMUP_SAVES and self._writer is not None:
            self._warmup_writes = self._writer.submitted
        measured = self._saves - WARMUP_SAVES
        if (
            self._saves == 1
            or measured in (1, 2, 4)
            or (measured > 0 and measured % REDECIDE_EVERY == 0)
        ):
            self._decide(measured)

    def _mtbf_s(self) -> float:
        assert self.prior_s is not None  # options refuse "auto" without mtbf_hours
        uptime = self.history.uptime_s + time.monotonic() - self._started
        return intervals.learned_mtbf_s(self.prior_s, uptime, self.history.failures)

    def _contention_s(self) -> float:
        """What a background write of this tier costs the loop (see ``Measurements``)."""
        if self._writer is None or self._warmup_writes is None:
            return 0.0
        after = [s for n, s in list(self._writer.job_seconds) if n > self._warmup_writes]
        return self.measured.contention_s(statistics.median(after)) if after else 0.0

    def _decide(self, measured: int) -> None:
        contention = self._contention_s()
        mine = self.measured.costs(self._mtbf_s(), contention)
        if self._writer is not None and self.measured.split() is None and measured < 4:
            mine = None  # what a write costs the loop is not known yet: not measured enough
        figures = None if mine is None else [mine.step_s, mine.save_s, mine.restart_s, mine.mtbf_s]
        text = json.dumps({"figures": figures, "earlier": self.history.interval(self.tier)})
        agreed = json.loads(
            multihost.decided(
                f"{self._name}/{self._saves}",
                text,
                _worst,
                self._timeout_s,
                what="agreeing on the save interval",
            )
        )
        if "start" in agreed:  # not measured enough everywhere yet
            if agreed["start"] is not None:
                self.interval = min(max(agreed["start"], self.min_steps), self.max_steps)
            return
        costs = intervals.Costs(*agreed["figures"])
        choice = intervals.choose(costs, self.min_steps, self.max_steps)
        changed = choice.steps != self.interval
        self.interval, self.choice = choice.steps, choice
        jax.monitoring.record_scalar(
            f"/jaxckpt/goodput/{self.tier}/interval_steps", float(choice.steps)
        )
        jax.monitoring.record_scalar(
            f"/jaxckpt/goodput/{self.tier}/predicted_ettr", choice.predicted_ettr
        )
        if changed and self._log is not None:
            self._log.append(
                "interval",
                self._last,
                tier=self.tier,
                steps=choice.steps,
                predicted_ettr=choice.predicted_ettr,
                step_s=costs.step_s,
                save_s=costs.save_s,
                restart_s=costs.restart_s,
                mtbf_s=costs.mtbf_s,
            )


def _all_committed(values: list[str]) -> str:
    """Process 0's part of a "continuous" round: "1" when every process's last save
    committed."""
    return "1" if all(v == "1" for v in values) else "0"


def _worst(values: list[str]) -> str:
    """Process 0's part of a decision (each value: a process's figures and the interval its
    log says an earlier job chose): the largest times and the smallest MTBF; while some
    process has no figures yet, where to start (the largest earlier interval, or null)."""
    got = [json.loads(v) for v in values]
    figures = [g["figures"] for g in got]
    if any(f is None for f in figures):
        earlier = [g["earlier"] for g in got if g["earlier"] is not None]
        return json.dumps({"start": max(earlier, default=None)})
    worst = [max(f[i] for f in figures) for i in range(3)]
    return json.dumps({"figures": [*worst, min(f[3] for f in figures)]})


def start_run(
    directories: list[Location], tiers: list[str], heartbeat_s: float, enabled: bool = True
) -> tuple[RunLog | None, History]:
    """Opens this process's run log in ``directories``, reads what earlier jobs of the
    run left in all of them (a replaced host's local log is gone, its remote one is not),
    and logs this job's start (with the step they reached). Not ``enabled``: no log, and
    no history to learn from."""
    if not enabled:
        return None, History()
    pid = multihost.process_index()
    seen: dict[tuple, Event] = {}
    for d in directories:
        try:
            for e in runlog.read(d, pid).events:
                seen.setdefault((e.job, e.t, e.event, e.step), e)
        except RunLogError:  # a new run (or a log nobody can read: it is only figures)
            pass
    before = sorted(seen.values(), key=lambda e: e.t)
    log = RunLog(directories, pid, heartbeat_s=heartbeat_s)
    log.append(
        "start",
        processes=multihost.process_count(),
        previous_step=runlog.previous_step(before),
        tiers=tiers,
    )
    return log, History.of(before, restarting=True)
