"""Goodput under injected failures: measured ETTR against the interval model, 2 processes.

usage: python bench/goodput.py [--quick] [--intervals 1,5,25,100,auto,continuous]
                               [--mtbf-s 10] [--failures 10] [--seed 5] [--no-wipe]
                               [--plot docs/goodput.png]

For each local save interval (steps, "auto" or "continuous"), a 2-process jax.distributed job on 127.0.0.1
(bench/goodput_worker.py: a Flax MLP with Optax AdamW, a Grain pipeline per process, an
EmergencyCheckpointManager with replication=1 and each process's iterator state saved with
each step) trains until one of its processes is SIGKILLed; the other is killed too (a real
job restarts whole), the victim's local directory is wiped (a replaced host: its shards and
iterator state come back from its peer's copy; ``--no-wipe`` keeps it) and the job is
relaunched. ``--failures`` kills per interval, after delays drawn once from a seeded
exponential (mean ``--mtbf-s``), each counted from the job's first training step (start-up is
a restart cost, not luck): the same delays and victims for every interval. Relaunches use
jax's persistent compilation cache, as a production job would (``--no-compile-cache``).

The intervals run interleaved: the first job of every interval, then the second of every
interval, and so on, so that the shared machine's slow and fast minutes fall on all alike.

Measured from outside the library (the workers' clocks around steps and ``save`` calls, the
launcher's around kills; all ``time.time()`` of this one machine):
  step     median step of the first jobs' baseline phases (no saves, no failures), pooled
           over the intervals: the same program on the same machine, and one run's 50
           steps move by 5-10 % on this shared VM, which ETTR would inherit;
  save     seconds ``save`` blocked the training loop (the slower process), saves that wrote;
  restart  kill to the relaunched job's first training step: killing the survivor, wiping,
           starting, joining, restoring, saving the restored step again (a replaced host
           gets its local copy back; the peer exchange compiles), the first step;
  run      mean seconds from a job's first step to its failure (the realized delays);
  window   from the first job's first step after its baseline (a checkpoint) to the last
           job's first step: whole cycles of (run, failure, restart), so every failure's
           rework is inside it and no unfailed tail dilutes it;
  ETTR     (step at the window's end - step at its start) x step / the window's seconds:
           each step counted once, at its pure cost;
  loop     the loop's mean step over the jobs' runs, less the saves' blocking: the pure step
           slowed by the background writes (and, for "continuous", the agreement each step
           makes while a save is in flight); ``x pure`` is it over the pure step;
  MB/h     bytes of files both processes wrote (``/proc/self/io`` write_bytes: what the
           storage gets; ``wchar`` would count the collectives' sockets too) from each
           job's first to its last recorded step, per hour of those runs: what the policy
           writes while training (the checkpoints; the run log and event lines are small).
Predicted: ``jaxckpt._src.goodput.intervals.ettr(interval_s = steps between saves x step, save_s,
mtbf_s, restart_s)``, with means for save and restart (what the wall pays; medians printed
too). That model (Daly's complete one) lets failures strike a restart too (its e^(R/M)
factor); here none does, so a cycle is a run of mean M then a restart R. Passing mtbf_s = M
(observed: the realized delays over the failures, which removes the Poisson noise of a short
run) and restart_s = M ln(1 + R/M) makes the library's formula this process's expectation
exactly (renewal-reward: E[work per cycle] / (M + R)); column ``M=wall/f`` shows the formula
with mtbf_s = wall / failures and restart_s = R instead. A save costs its blocking time, and
its background write slows the steps around it (on 2 cores it competes with training for
them): the model's work between saves is those steps at the window's mean step time, of
which only the pure step's share counts as productive (both measured here, from outside).
"auto": ``EmergencyOptions(local_interval_steps="auto", mtbf_hours=--mtbf-s x processes /
3600)`` (a per-host MTBF: the library divides it by the process count). "continuous":
``local_interval_steps="continuous"``, the next save at the first step after the last one
committed (Orbax 0.12's default); its row is compared with auto's at the end, as ratios.

Targets: measured ETTR within 3 points of predicted for each interval; "auto" within 1 point
of the best fixed interval and at least 5 points above the worst; every resume restored the
step, the model's step counter and the data position alike, a wiped host from its peer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, fields, replace

import harness
import multiproc
from harness import median

WORKER = os.path.join(harness.HERE, "goodput_worker.py")
PROCESSES = 2


@dataclass(frozen=True)
class Settings:
    """What every interval's run shares."""

    delays: tuple[float, ...]  # seconds from a job's first step to its failure
    victims: tuple[int, ...]  # the process killed at each failure
    width: int
    batch: int
    baseline_steps: int
    mtbf_s: float
    wipe: bool
    start_timeout_s: float
    compile_cache: str | None  # jax's persistent compilation cache, shared by the runs
    seed: int


@dataclass(frozen=True)
class Life:
    """One job of a run: its first training step (launcher's view) and its end."""

    first_t: float
    first_step: int
    kill_t: float
    gap_s: float = 0.0  # before it was launched: the other intervals' turns (not a restart)


@dataclass(frozen=True)
class Costs:
    """What the model takes, as measured (seconds): means, which is what the wall pays."""

    step_s: float  # the pure step (the baselines' median, pooled over the intervals)
    save_s: float  # a save's blocking
    restart_s: float  # kill to the relaunched job's first step
    uptime_s: float  # a job's run from its first step to its failure
    loop_step_s: float  # the mean step in the window: slowed by the background writes

    def ettr(self, every: float) -> float:
        """The model's ETTR with saves every ``every`` steps (see the top for the mapping):
        the work between saves is ``every`` steps at the window's step time, of which only
        the pure step's share is productive."""
        m, s = self.uptime_s, self.loop_step_s
        model = ettr(every * s, self.save_s, m, m * math.log1p(self.restart_s / m))
        return model * self.step_s / s


@dataclass(frozen=True)
class Run:
    """One interval's measurements (seconds; steps)."""

    interval: int | str
    costs: Costs
    baseline_s: tuple[float, ...]  # this run's baseline step times
    save_every: float  # median steps between saves
    window_step_s: float  # median step in the window (the baseline's, slowed by writes)
    save_median_s: float
    restart_median_s: float
    restart_parts: tuple[tuple[str, float], ...]  # (phase, median seconds)
    wall_s: float
    steps: int  # progress over the window
    failures: int
    lost_steps: tuple[int, ...]  # per failure: last step reached - step restored
    checks: tuple[str, ...]  # what failed the resume checks (empty: all good)
    written_per_h: float  # bytes handed to write calls per hour of the jobs' runs

    @property
    def ettr(self) -> float:
        return self.steps * self.costs.step_s / self.wall_s

    @property
    def predicted(self) -> float:
        return self.costs.ettr(self.save_every)

    @property
    def naive(self) -> float:
        """The model with mtbf_s = wall / failures and the measured restart (see the top)."""
        c = self.costs
        return ettr(self.save_every * c.step_s, c.save_s, self.wall_s / self.failures, c.restart_s)


def ettr(interval_s: float, save_s: float, mtbf_s: float, restart_s: float) -> float:
    """jaxckpt's model: ``jaxckpt._src.goodput.intervals.ettr``."""
    from jaxckpt._src.goodput import intervals

    return intervals.ettr(interval_s, save_s, mtbf_s, restart_s)


# --- running -------------------------------------------------------------------------------


def first_step(root: str, life: int, job: multiproc.Job, timeout_s: float) -> tuple[float, int]:
    """Waits for the job's first training step: (unix time, step). Raises if a process died."""
    path = os.path.join(root, f"first-{life}.json")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        dead = [p.returncode for p in job.procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            for p in job.procs:
                p.kill()
            out = job.wait(30).outputs
            why = f"exited {dead}" if dead else f"no first step in {timeout_s:.0f} s"
            raise RuntimeError(f"life {life}: {why}\n" + "\n".join(o[-3000:] for o in out))
        time.sleep(0.005)
    with open(path) as f:
        first = json.load(f)
    return first["t"], first["step"]


def run_interval(interval: int | str, root: str, s: Settings) -> Iterator[Life]:
    """One interval's jobs, each killed (its victim first, then the survivor) and, after its
    victim's local directory is wiped, relaunched; the last one is stopped at its first step.
    Yields after each job, so that intervals can take turns; the time until its next job
    launches is each Life's ``gap_s``, out of every figure."""
    kwargs = dict(
        root=root,
        interval=interval,
        mtbf_hours=s.mtbf_s * PROCESSES / 3600,
        width=s.width,
        batch=s.batch,
        baseline_steps=s.baseline_steps,
        compile_cache=s.compile_cache,
    )
    gap = 0.0
    for life in range(len(s.delays) + 1):
        failing = life < len(s.delays)
        delay = s.delays[life] if failing else 0.0
        deadline = time.time() + s.start_timeout_s + delay + 60  # no orphans, whatever happens
        args = ["--worker", json.dumps({**kwargs, "life": life, "deadline": deadline})]
        job = multiproc.start(WORKER, PROCESSES, devices_per_process=8 // PROCESSES, args=args)
        try:
            t, step = first_step(root, life, job, s.start_timeout_s)
            time.sleep(max(0.0, t + delay - time.time()))
            kill_t = time.time()
            if failing:
                os.kill(job.procs[s.victims[life]].pid, signal.SIGKILL)
        finally:
            for p in job.procs:  # the survivor: the job restarts whole
                p.kill()
            job.wait(30)
        harness.log(f"  interval {interval}: life {life} from step {step}, ran {kill_t - t:.1f} s")
        if failing and s.wipe:
            shutil.rmtree(os.path.join(root, f"host{s.victims[life]}"))
        paused = time.time()
        yield Life(t, step, kill_t, gap)
        gap = time.time() - paused


def _loop_step(lives: Sequence[Life], window: Sequence[dict], blocking: dict[int, float]) -> float:
    """The loop's wall per step outside save blocking (its steps slowed by the background
    writes, and its own work), by the launcher's clock: each failed job's run (first step to
    kill) over the steps it took, less the saves' blocking (the slower process's)."""
    reached: dict[int, int] = {}
    for e in window:
        if e["e"] == "step":
            reached[e["life"]] = max(reached.get(e["life"], 0), e["step"])
    runs = lives[:-1]
    steps = sum(reached[i] - life.first_step + 1 for i, life in enumerate(runs) if i in reached)
    seconds = sum(life.kill_t - life.first_t for life in runs) - sum(blocking.values())
    return seconds / steps if steps else math.nan


def read_events(root: str) -> list[dict]:
    """Every process's events (torn lines of a killed process skipped)."""
    out = []
    for pid in range(PROCESSES):
        with open(os.path.join(root, f"events-p{pid}.jsonl")) as f:
            for line in f:
                try:
                    out.append({**json.loads(line), "p": pid})
                except json.JSONDecodeError:
                    continue
    return out


def measure(interval: int | str, lives: Sequence[Life], events: Sequence[dict], wipe: bool) -> Run:
    """The run's figures from the launcher's lives and the workers' events (the pure step:
    this run's baseline; ``main`` pools it over the runs)."""
    failures = len(lives) - 1
    window = [e for e in events if e["life"] < failures]
    blocking: dict[int, float] = {}  # step -> the slower process's blocking
    for e in window:
        if e["e"] == "save" and not e.get("first"):
            blocking[e["step"]] = max(blocking.get(e["step"], 0.0), e["blocking_s"])
    saved = sorted({e["step"] for e in window if e["e"] == "save"})
    spacing = [b - a for a, b in zip(saved, saved[1:], strict=False)]
    reached: dict[int, int] = {}
    firsts = {(life.first_step, i) for i, life in enumerate(lives)}
    stepped = [e["dt"] for e in window if e["e"] == "step" and (e["step"], e["life"]) not in firsts]
    for e in window:
        if e["e"] == "step":
            reached[e["life"]] = max(reached.get(e["life"], 0), e["step"])
    restores = [e for e in events if e["e"] == "restored"]
    step_of = {e["life"]: e["step"] for e in restores}
    checks = [
        f"life {e['life']} process {e['p']}: step {e['step']}, model {e['model_step']}, "
        f"data position {e['data']}"
        for e in restores
        if not e["step"] == e["model_step"] == e["data"]
    ]
    if len(step_of) < failures:
        checks.append(f"restores in {len(step_of)} relaunches of {failures}")
    if wipe and failures and all(e["per_process_from"] == e["p"] for e in restores):
        checks.append("no process got its state from a peer's copy")
    restarts = [b.first_t - a.kill_t - b.gap_s for a, b in zip(lives, lives[1:], strict=False)]
    baseline = tuple(e["dt"] for e in events if e["e"] == "baseline")
    return Run(
        interval=interval,
        baseline_s=baseline,
        costs=Costs(
            step_s=median(baseline),
            save_s=statistics.fmean(blocking.values()) if blocking else 0.0,
            restart_s=statistics.fmean(restarts),
            uptime_s=sum(a.kill_t - a.first_t for a in lives[:-1]) / failures,
            loop_step_s=_loop_step(lives, window, blocking),
        ),
        save_every=median(spacing) if spacing else math.nan,
        window_step_s=median(stepped) if stepped else math.nan,
        save_median_s=median(blocking.values()) if blocking else 0.0,
        restart_median_s=median(restarts),
        restart_parts=restart_parts(lives, events),
        wall_s=lives[-1].first_t - lives[0].first_t - sum(life.gap_s for life in lives[1:]),
        steps=lives[-1].first_step - lives[0].first_step,
        failures=failures,
        lost_steps=tuple(reached[life - 1] - step_of[life] for life in range(1, len(lives))),
        checks=tuple(checks),
        written_per_h=written_per_hour(window),
    )


def written_per_hour(window: Sequence[dict]) -> float:
    """Bytes of files both processes wrote per hour of training: per job and process, the
    ``written`` of its last recorded step less its first's, over those steps' time apart
    (start-up, restores and the restored step's save are left out)."""
    runs: dict[tuple[int, int], list[dict]] = {}
    for e in window:
        if e["e"] == "step" and "written" in e:
            runs.setdefault((e["life"], e["p"]), []).append(e)
    written = seconds = 0.0
    for (_, p), steps in runs.items():
        first, last = min(steps, key=lambda e: e["t"]), max(steps, key=lambda e: e["t"])
        written += last["written"] - first["written"]
        seconds += (last["t"] - first["t"]) if p == 0 else 0.0  # the job's time, once
    return written / seconds * 3600 if seconds > 0 else math.nan


def restart_parts(lives: Sequence[Life], events: Sequence[dict]) -> tuple[tuple[str, float], ...]:
    """Where a restart's seconds go (process 0's clock, median over the restarts)."""
    marks = ("start", "init", "restored", "save")
    parts: dict[str, list[float]] = {}
    for life in range(1, len(lives)):
        at = {
            e["e"]: e["t"]
            for e in events
            if e["life"] == life and e["p"] == 0 and (e["e"] != "save" or e.get("first"))
        }
        if not all(m in at for m in marks):
            continue
        resumed = lives[life - 1].kill_t + lives[life].gap_s  # the turns between are no restart
        times = [resumed, *(at[m] for m in marks), lives[life].first_t]
        names = ("kill to jax up", "model, manager", "restore", "first save", "first step")
        for name, a, b in zip(names, times, times[1:], strict=False):
            parts.setdefault(name, []).append(b - a)
    return tuple((name, median(v)) for name, v in parts.items())


def supported(interval: str, mtbf_hours: float) -> bool:
    """Whether this jaxckpt's emergency manager saves with ``local_interval_steps=interval``
    ("auto" or "continuous"): a few one-process saves of a small tree (options that accept
    the value are not enough)."""
    import jax.numpy as jnp
    from goodput_worker import options

    import jaxckpt

    with harness.scratch("jaxckpt_goodput_probe_") as d:
        try:
            opts = options(interval, mtbf_hours)
            with jaxckpt.EmergencyCheckpointManager(f"{d}/local", f"{d}/remote", opts) as mgr:
                saved = [mgr.save(step, {"x": jnp.arange(4.0)}) for step in range(1, 4)]
                mgr.wait_until_finished()
                if not any(saved) or not mgr.save(4, {"x": jnp.arange(4.0)}):
                    return False
        except (TypeError, ValueError, jaxckpt.errors.CheckpointError):
            return False
    return True


# --- reporting -----------------------------------------------------------------------------


def pooled(runs: Sequence[Run]) -> Costs:
    """The runs' median costs (the model's curve in the plot)."""
    return Costs(*(median(getattr(r.costs, f.name) for r in runs) for f in fields(Costs)))


def plot(runs: Sequence[Run], path: str) -> None:
    """ETTR against the save interval: measured points, and the model's curve with the runs'
    median costs over a range of intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    c = pooled(runs)
    every = [1.08**i for i in range(100)]  # 1 to ~2000 steps
    ax.plot(every, [c.ettr(k) for k in every], "-", color="0.6", label="model (median costs)")
    fixed = [r for r in runs if isinstance(r.interval, int)]
    ax.plot([r.save_every for r in fixed], [r.ettr for r in fixed], "o", label="measured")
    ax.plot(
        [r.save_every for r in fixed],
        [r.predicted for r in fixed],
        "x",
        color="k",
        label="predicted (each run's own costs)",
    )
    for r in runs:
        if r.interval == "auto":
            ax.plot([r.save_every], [r.ettr], "*", ms=14, label=f"auto (every {r.save_every:g})")
        if r.interval == "continuous":
            ax.plot(
                [r.save_every],
                [r.ettr],
                "D",
                ms=9,
                label=f"continuous (every {r.save_every:g}, median)",
            )
    ax.set_xscale("log")
    ax.set_xlabel("local save interval (steps)")
    ax.set_ylabel("ETTR (productive / wall)")
    ax.set_title(
        f"step {c.step_s * 1e3:.0f} ms, save {c.save_s * 1e3:.0f} ms, restart "
        f"{c.restart_s:.1f} s, run to a failure {c.uptime_s:.1f} s",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets(runs: Sequence[Run]) -> None:
    """PASS/FAIL of the targets, with ratios: measured / predicted, auto / best, auto / worst."""
    print("\ntargets (ratios within this run)")

    def line(ok: bool, what: str, ratio: float) -> None:
        print(f"  {harness.verdict(ok)} {what:<58} {ratio:6.2f}x")

    for r in runs:
        what = f"interval {r.interval}: measured ETTR within 3 points of predicted"
        line(abs(r.ettr - r.predicted) <= 0.03, what, r.ettr / r.predicted)
    fixed = [r.ettr for r in runs if isinstance(r.interval, int)]
    for auto in [r for r in runs if r.interval == "auto"]:
        if not fixed:
            print("  SKIP auto against the fixed intervals (none ran)")
            continue
        best, worst = max(fixed), min(fixed)
        line(auto.ettr >= best - 0.01, "auto within 1 point of the best fixed interval",
             auto.ettr / best)  # fmt: skip
        line(auto.ettr >= worst + 0.05, "auto at least 5 points above the worst fixed interval",
             auto.ettr / worst)  # fmt: skip
    for r in runs:
        if r.checks:
            print(f"  FAIL interval {r.interval}: resume checks: {'; '.join(r.checks)}")
    if all(not r.checks for r in runs):
        print(
            "  PASS every resume: step restored = model's step = data position; "
            "a wiped host restored from its peer's copy"
        )
    versus(runs)


def versus(runs: Sequence[Run]) -> None:
    """What "continuous" costs against "auto", in this run (same failure times)."""
    by = {r.interval: r for r in runs}
    if "continuous" not in by or "auto" not in by:
        return
    c, a = by["continuous"], by["auto"]
    pure = c.costs.step_s
    print(
        f"\ncontinuous against auto (same failures): ETTR {c.ettr:.3f} vs {a.ettr:.3f} "
        f"({(c.ettr - a.ettr) * 100:+.1f} points, {c.ettr / a.ettr:.2f}x); saves every "
        f"{c.save_every:g} vs {a.save_every:g} steps; bytes written per hour "
        f"{c.written_per_h / 1e6:.0f} vs {a.written_per_h / 1e6:.0f} MB "
        f"({c.written_per_h / a.written_per_h:.1f}x; per step "
        f"{_per_step(c) / _per_step(a):.1f}x); loop step "
        f"{c.costs.loop_step_s * 1e3:.1f} vs {a.costs.loop_step_s * 1e3:.1f} ms "
        f"({c.costs.loop_step_s / a.costs.loop_step_s:.2f}x; pure {pure * 1e3:.1f} ms); lost "
        f"steps per failure {_mean(c.lost_steps):.1f} vs {_mean(a.lost_steps):.1f}"
    )


def _per_step(r: Run) -> float:
    """Bytes written per training step: the hourly bytes over the steps of an hour."""
    return r.written_per_h * r.costs.loop_step_s / 3600


def _mean(values: Sequence[int]) -> float:
    return statistics.fmean(values) if values else math.nan


def report(runs: Sequence[Run], s: Settings) -> None:
    """The settings, one row per interval, and where a restart's time goes."""
    print(
        f"\n{PROCESSES} processes (CPU devices), MLP width {s.width}, global batch {s.batch}; "
        f"failures after {', '.join(f'{d:.1f}' for d in s.delays)} s of running "
        f"(exponential, mean {s.mtbf_s:g} s, seed {s.seed}), victims {list(s.victims)}, "
        f"their local directory {'wiped' if s.wipe else 'kept'}"
    )
    table = harness.Table(
        (
            ("interval", "<8"),
            ("every", ">6.0f"),
            ("ETTR", ">6.3f"),
            ("predicted", ">9.3f"),
            ("M=wall/f", ">8.3f"),
            ("failures", ">8d"),
            ("lost steps/f", ">12.1f"),
            ("save ms med/mean", ">16"),
            ("restart s med/mean", ">18"),
            ("baseline ms", ">11.1f"),
            ("in window", ">9.1f"),
            ("loop ms", ">7.1f"),
            ("x pure", ">6.2f"),
            ("MB/h", ">6.0f"),
            ("run s/f", ">7.2f"),
            ("wall s", ">6.1f"),
        ),
        markdown=True,
    )
    table.print(
        (
            str(r.interval), r.save_every, r.ettr, r.predicted, r.naive, r.failures,
            statistics.fmean(r.lost_steps) if r.lost_steps else None,
            f"{r.save_median_s * 1e3:.1f}/{r.costs.save_s * 1e3:.1f}",
            f"{r.restart_median_s:.2f}/{r.costs.restart_s:.2f}",
            median(r.baseline_s) * 1e3, r.window_step_s * 1e3, r.costs.loop_step_s * 1e3,
            r.costs.loop_step_s / r.costs.step_s, r.written_per_h / 1e6,
            r.costs.uptime_s, r.wall_s,
        )
        for r in runs
    )  # fmt: skip
    parts = {name for r in runs for name, _ in r.restart_parts}
    if parts:
        each = [
            f"{name} {median(v for r in runs for n, v in r.restart_parts if n == name):.2f}"
            for name in dict.fromkeys(n for r in runs for n, _ in r.restart_parts)
        ]
        print(f"\na restart (s, median): {', '.join(each)}")
    print(f"pure step (every run's baseline, pooled): {runs[0].costs.step_s * 1e3:.1f} ms")
    print(
        "predicted: the model with each run's save and restart (means), run to a failure, and "
        "the loop's step (launcher's clock, saves' blocking out; baseline's share productive);\nM=wall/f: the same with mtbf_s = wall / failures (see "
        "the docstring: the bench's failures never strike a restart);\nin window: the median "
        "step between failures (above the baseline's: background writes compete for the cores);"
        "\nloop ms: the mean step of the jobs' runs without the saves' blocking (x pure: over "
        "the pure step); MB/h: bytes of files written per hour of training, both processes"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a ~1 minute smoke run")
    ap.add_argument(
        "--intervals", default="1,5,25,100,auto,continuous", help="steps, auto or continuous"
    )
    ap.add_argument("--mtbf-s", type=float, default=10.0, help="mean run time to a failure")
    ap.add_argument("--failures", type=int, default=10, help="per interval")
    ap.add_argument("--seed", type=int, default=5, help="of the delays and victims")
    ap.add_argument("--width", type=int, default=512, help="MLP width")
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--baseline-steps", type=int, default=50)
    ap.add_argument("--no-wipe", action="store_true", help="keep the killed host's directory")
    ap.add_argument("--start-timeout", type=float, default=180.0, help="per relaunch")
    ap.add_argument("--plot", default=os.path.join(harness.ROOT, "docs", "goodput.png"))
    ap.add_argument("--no-compile-cache", action="store_true", help="relaunches compile again")
    ap.add_argument("--json", help="write the runs' figures here")
    args = ap.parse_args()
    harness.cpu_devices(1)  # this process only probes the manager; the jobs have their own
    if args.quick:
        args.intervals, args.failures, args.mtbf_s = "1,25,auto,continuous", 1, 5.0
    import numpy as np

    rng = np.random.default_rng(args.seed)
    notes: list[str] = []
    runs: list[Run] = []
    with harness.scratch("jaxckpt_goodput_cache_") as cache:
        s = Settings(
            delays=tuple(float(d) for d in rng.exponential(args.mtbf_s, args.failures)),
            victims=tuple(int(v) for v in rng.integers(0, PROCESSES, args.failures)),
            width=args.width,
            batch=args.batch,
            baseline_steps=args.baseline_steps,
            mtbf_s=args.mtbf_s,
            wipe=not args.no_wipe,
            start_timeout_s=args.start_timeout,
            compile_cache=None if args.no_compile_cache else cache,
            seed=args.seed,
        )
        with contextlib.ExitStack() as stack:
            turns: dict[int | str, tuple[str, Iterator[Life], list[Life]]] = {}
            for item in args.intervals.split(","):
                interval: int | str = item if item in ("auto", "continuous") else int(item)
                if isinstance(interval, str) and not supported(
                    interval, args.mtbf_s * PROCESSES / 3600
                ):
                    notes.append(f"{interval}: not supported by this jaxckpt yet")
                    continue
                root = stack.enter_context(harness.scratch("jaxckpt_goodput_"))
                turns[interval] = (root, run_interval(interval, root, s), [])
            for _ in range(args.failures + 1):  # every interval's next job, in turn
                for interval, (_, jobs, lives) in list(turns.items()):
                    try:
                        lives.append(next(jobs))
                    except RuntimeError as e:
                        notes.append(f"interval {interval}: failed: {str(e)[-3000:]}")
                        harness.log(notes[-1])
                        del turns[interval]
            for interval, (root, _, lives) in turns.items():
                runs.append(measure(interval, lives, read_events(root), s.wipe))
        pure = median(t for r in runs for t in r.baseline_s)
        runs = [replace(r, costs=replace(r.costs, step_s=pure)) for r in runs]
    for note in notes:
        print(note)
    if not runs:
        raise SystemExit("no interval ran")
    report(runs, s)
    targets(runs)
    if args.plot:
        plot(runs, args.plot)
        print(f"\nplot: {args.plot}")
    if args.json:
        harness.write_json(args.json, [{**asdict(r), "ettr": r.ettr} for r in runs])


if __name__ == "__main__":
    main()
