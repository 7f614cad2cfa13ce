"""Goodput (jaxckpt/_src/goodput/, ``jaxckpt goodput``): logs of known histories written with
RunLog (real files, a clock set by hand), read back by the report, the command and the plot."""

import json
import math
import os
import subprocess
import sys

import pytest

import jaxckpt
from jaxckpt import errors
from jaxckpt._src.goodput import intervals
from jaxckpt._src.goodput.runlog import RunLog
from jaxckpt._src.storage import location

BLOCK, WRITE = 2.0, 3.0  # every save blocks 2 s, then writes 3 s in the background


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def train(d, job: str, start: float, first: int, last: int, saves: set[int], *,
          restore: tuple[str, float] | None = None, end: bool = True, beat: int = 10) -> float:  # fmt: skip
    """Logs one job as a manager would: start, an optional restore of ``first``, a heartbeat
    every ``beat`` steps of 1 s each, saves (blocking 2 s, logged as they commit 3 s later), and an
    ``end`` if it closes. Returns the time it stopped."""
    clock = Clock(start)
    log = RunLog([location(d)], 0, heartbeat_s=0, job=job, clock=clock)
    log.append("start", processes=1, previous_step=None, tiers=["local", "remote"])
    if restore is not None:
        clock.t += restore[1]
        log.append("restore", first, tier=restore[0], seconds=restore[1], sources={})
    commits = []  # (time, step): a save is logged by the writer thread once committed
    for step in range(first, last + 1):
        if step > first:
            clock.t += 1.0
        while commits and commits[0][0] <= clock.t:
            t, saved = commits.pop(0)
            now, clock.t = clock.t, t
            log.append("save", saved, tier="local", blocking_s=BLOCK, write_s=WRITE, bytes=100)
            clock.t = now
        if step % beat == 0:
            log.heartbeat(step)
        if step in saves:
            clock.t += BLOCK
            commits.append((clock.t + WRITE, step))
    assert not commits or not end  # the test's histories let every save commit
    if end:
        log.close(last)
    return clock.t


@pytest.fixture
def failed_run(tmp_path):
    """Job 1 reaches step 120 (saves at 50 and 100) and dies; job 2 starts 30 s later,
    restores step 100 from a peer in 4 s, runs to 200 (a save at 150) and closes."""
    died = train(tmp_path, "job-1", 1000.0, 0, 120, {50, 100}, end=False)
    train(tmp_path, "job-2", died + 30.0, 100, 200, {150}, restore=("peer", 4.0))
    return tmp_path


def test_a_failure_costs_rework_restart_and_restore(failed_run):
    g = jaxckpt.goodput(failed_run)
    assert isinstance(g, jaxckpt.Goodput)
    assert (g.jobs, g.failures, g.last_step, g.skipped) == (2, 1, 200, 0)
    assert g.step_s == pytest.approx(1.0)
    (loss,) = g.losses
    assert (loss.job, loss.reached_step, loss.restored_step, loss.steps_lost) == (
        "job-1", 120, 100, 20)  # fmt: skip
    assert loss.failed_t == 1124.0  # steps 0-120 at 1 s, two saves blocking 2 s each
    assert loss.rework_s == pytest.approx(20.0)
    assert (loss.restart_s, loss.restore_s, loss.tier) == (30.0, 4.0, "peer")
    # by hand: job 1 runs 124 s, 30 s pass, job 2 restores 4 s, runs 100 steps + one save
    assert g.wall_s == 124 + 30 + 4 + 100 + 2
    assert g.save_overhead_s == 3 * BLOCK
    assert g.lost_s == pytest.approx(20 + 30 + 4)
    assert g.productive_s == pytest.approx(200.0)  # the 200 steps, each once
    assert g.ettr == pytest.approx(200 / 260)
    assert g.mtbf_s == 260.0 and g.idle_s == 0.0
    assert [(c.tier, c.count, c.blocking_s, c.write_s) for c in g.saves] == [
        ("local", 3, BLOCK, WRITE)]  # fmt: skip
    assert [(c.tier, c.count, c.seconds) for c in g.restores] == [("peer", 1, 4.0)]
    (best,) = g.intervals
    want = intervals.best_interval_s(BLOCK, 260.0, 34.0)
    assert best.tier == "local" and best.steps == max(1, math.floor(want + 0.5))
    assert best.predicted_ettr == pytest.approx(intervals.ettr(best.steps, BLOCK, 260.0, 34.0))
    assert best.used_steps == 50
    assert best.used_ettr == pytest.approx(intervals.ettr(50.0, BLOCK, 260.0, 34.0))
    assert best.predicted_ettr >= best.used_ettr
    text = g.text()
    assert "ETTR 76.9 %" in text and "no failures" not in text
    row = next(ln.split() for ln in text.splitlines() if ln.strip().startswith("job-1"))
    assert row[:4] == ["job-1", "120", "100", "20"] and row[-1] == "peer"


@pytest.mark.parametrize("beat", [10, 1000])
def test_step_time_leaves_the_saves_blocking_out(tmp_path, beat):
    """A save every 10 steps: every interval holds a save's 2 s. With heartbeats (beat=10) and
    without (1000: the steps are known from the saves alone, logged 5 s after their call)."""
    train(tmp_path, "job-1", 0.0, 0, 100, set(range(10, 100, 10)), beat=beat)
    g = jaxckpt.goodput(tmp_path)
    assert g.step_s == pytest.approx(1.0)
    assert g.save_overhead_s == 9 * BLOCK and g.productive_s == pytest.approx(100.0)


def test_a_job_that_restored_nothing_lost_every_step(tmp_path):
    died = train(tmp_path, "job-1", 0.0, 0, 40, set(), end=False)
    train(tmp_path, "job-2", died + 10.0, 0, 30, set())
    g = jaxckpt.goodput(tmp_path)
    (loss,) = g.losses
    assert (loss.restored_step, loss.steps_lost, loss.restore_s, loss.tier) == (None, 40, 0.0, None)
    assert any("restored nothing" in n for n in g.notes)
    assert "nothing" in g.text()


def test_a_run_without_failures_says_so_and_prints_its_costs(tmp_path):
    end = train(tmp_path, "job-1", 0.0, 0, 100, {30, 60})
    # a clean close and a restart are no failure: the gap and the restore are idle time
    train(tmp_path, "job-2", end + 20.0, 100, 120, set(), restore=("local", 1.5))
    g = jaxckpt.goodput(tmp_path)
    assert (g.failures, g.mtbf_s, g.losses, g.intervals) == (0, None, (), ())
    assert g.idle_s == pytest.approx(21.5)
    assert g.productive_s == pytest.approx(120.0)  # each step once
    text = g.text()
    assert "no failures observed" in text
    assert "local" in text and "2.000 s" in text and "3.000 s" in text  # the save costs
    assert "1.500 s" in text  # the restore's


def test_the_last_job_without_end_is_no_failure(tmp_path):
    train(tmp_path, "job-1", 0.0, 0, 50, {20}, end=False)
    g = jaxckpt.goodput(tmp_path)
    assert g.failures == 0 and any("has no end" in n for n in g.notes)


def test_process_picks_the_log(tmp_path):
    log = RunLog([location(tmp_path)], 1, job="j", clock=Clock(5.0))
    log.append("start", processes=2, previous_step=None, tiers=["dir"])
    log.close(0)
    assert jaxckpt.goodput(tmp_path, process=1).process == 1
    with pytest.raises(errors.RunLogError, match=r"process= one of \[1\]"):
        jaxckpt.goodput(tmp_path)


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxckpt", "goodput", *map(str, args)],
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))  # fmt: skip


def test_command_prints_the_report_json_and_plot(failed_run, tmp_path):
    res = cli(failed_run)
    assert res.returncode == 0, res.stderr
    assert res.stdout == jaxckpt.goodput(failed_run).text()
    out = tmp_path / "timeline.png"
    res = cli(failed_run, "--json", "--plot", out)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc == jaxckpt.goodput(failed_run).to_json()
    assert doc["failures"] == 1 and doc["losses"][0]["steps_lost"] == 20
    assert math.isclose(doc["ettr"], 200 / 260) and doc["losses"][0]["tier"] == "peer"
    with open(out, "rb") as f:
        png = f.read()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_command_without_a_log_names_the_path(tmp_path):
    res = cli(tmp_path)
    assert res.returncode == 2 and f"{tmp_path}/runlog" in res.stderr, res.stderr


def test_plot_without_matplotlib_names_the_package(failed_run, tmp_path, monkeypatch):
    from jaxckpt._src.goodput.plot import plot

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if it were not installed
    with pytest.raises(errors.MissingDependencyError, match="pip install matplotlib"):
        plot(failed_run, tmp_path / "t.png")
    assert not (tmp_path / "t.png").exists()


def test_a_with_block_left_by_an_exception_is_a_failure(tmp_path):
    """The saves of a loop that crashed inside ``with manager:`` still commit, but its job
    logs no ``end``: the next job's start makes it a failure, for both managers."""
    import numpy as np

    from jaxckpt._src.goodput import runlog

    state = {"w": np.arange(64, dtype=np.float32)}
    opts = jaxckpt.Options(heartbeat_s=0)
    eopts = jaxckpt.EmergencyOptions(
        1, heartbeat_s=0, remote=jaxckpt.Options(save_interval_steps=2)
    )
    for make in (
        lambda: jaxckpt.CheckpointManager(tmp_path / "dir", opts),
        lambda: jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", eopts),
    ):
        with pytest.raises(RuntimeError, match="the loop crashed"), make() as mgr:
            mgr.save(1, state)
            mgr.save(2, state)
            raise RuntimeError("the loop crashed")
        with make() as mgr:
            assert mgr.latest_step() == 2
            mgr.restore(target=state)
            mgr.save(3, state)
    for where in (tmp_path / "dir", tmp_path / "l"):
        events = runlog.read(where).events
        assert [e.event for e in events].count("end") == 1, [e.event for e in events]
        g = jaxckpt.goodput(where)
        assert g.jobs == 2 and g.failures == 1 and g.losses[0].restored_step == 2
