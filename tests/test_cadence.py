"""Which steps a tier saves: fixed intervals, "auto" ones chosen from measurement and
agreed between processes, and the run log the managers keep (read back by goodput)."""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import multiproc
import numpy as np
import pytest

import jaxckpt
from jaxckpt._src.goodput import intervals, runlog
from jaxckpt._src.goodput.cadence import Cadence, History
from jaxckpt._src.goodput.runlog import Event
from jaxckpt._src.writer import Writer

HERE = os.path.dirname(__file__)
LOOP = os.path.join(HERE, "workers", "goodput_loop.py")


def ev(event: str, t: float, job: str, step: int | None = None, **fields) -> Event:
    return Event(event, t, job, 0, step, fields)


def test_history_counts_failures_uptime_and_restarts():
    events = [
        ev("start", 0, "a"), ev("save", 50, "a", 10), ev("step", 100, "a", 12),  # dies
        ev("start", 130, "b"), ev("restore", 140, "b", 10), ev("end", 200, "b", 30),
        ev("start", 300, "c"), ev("step", 310, "c", 31),  # a clean restart, then running
    ]  # fmt: skip
    h = History.of(events)
    assert h.failures == 1
    assert h.uptime_s == 100 + 70 + 10
    assert h.restarts_s == (40.0,)  # from the failed job's last event to the restore
    assert History.of([]) == History()
    # a manager reads the history as it starts: the last job (c) did not end, so it died
    assert History.of(events, restarting=True).failures == 2
    assert History.of(events[:6], restarting=True).failures == 1  # (b ended: a clean stop)


def test_a_clock_stepped_back_gives_no_restart_figure():
    """A failed job's last event after the next job's restore (a clock stepped back, or a
    straggler of the old job): no negative restart time, and a cadence still starts."""
    events = [
        ev("start", 0, "a"), ev("step", 500, "a", 12),  # dies; its clock ran ahead
        ev("start", 100, "b"), ev("restore", 110, "b", 10),
    ]  # fmt: skip
    h = History.of(events)
    assert h.failures == 1 and h.restarts_s == ()
    Cadence("dir", "auto", mtbf_hours=1.0, history=h)  # raised on a negative restore time


def test_a_restarted_job_starts_where_the_last_one_chose():
    events = [
        ev("start", 0, "a"), ev("interval", 5, "a", 3, tier="local", steps=7),
        ev("interval", 9, "a", 10, tier="local", steps=12),
        ev("interval", 9, "a", 10, tier="remote", steps=300),
        ev("interval", 9, "a", 11, tier="local", steps="13"),  # garbled: ignored
        ev("start", 20, "b"),
    ]  # fmt: skip
    h = History.of(events)
    assert h.interval("local") == 12 and h.interval("remote") == 300
    assert h.interval("dir") is None
    c = Cadence("local", "auto", mtbf_hours=1, history=h, max_steps=100)
    assert c.interval == 1 and c.due(50)  # the same start on every process
    c.restored(50, 1.0)
    assert c.due(51)
    c.saved(51, 0.0)  # not measured yet: agreed to start from the last job's choice
    assert c.interval == 12 and not c.due(62) and c.due(63)
    r = Cadence("remote", "auto", mtbf_hours=1, history=h, max_steps=100)
    r.due(1)
    r.saved(1, 0.0)
    assert r.interval == 100  # held within the bounds


def test_a_replaced_host_learns_from_its_remote_log(tmp_path):
    """Its local log went with its disk; the copy in the remote directory still tells how
    often the run failed (each job's lines are in both, counted once)."""
    from jaxckpt._src.goodput.cadence import start_run
    from jaxckpt._src.storage import location

    local, remote = location(tmp_path / "local"), location(tmp_path / "remote")
    for job in range(3):  # three jobs, the first two killed (no end)
        log, _ = start_run([local, remote], ["local", "remote"], heartbeat_s=0)
        assert log is not None
        log.append("save", 10 * (job + 1), tier="local", blocking_s=0.01, write_s=0.1, bytes=1)
        if job == 2:
            log.close(30)
    log, both = start_run([local, remote], ["local", "remote"], heartbeat_s=0)
    assert log is not None
    log.close(30)  # this job ends cleanly
    shutil.rmtree(tmp_path / "local")
    _, remote_only = start_run([local, remote], ["local", "remote"], heartbeat_s=0)
    assert both.failures == remote_only.failures == 2


def test_fixed_interval_saves_the_multiples():
    c = Cadence("dir", 4)
    assert [s for s in range(1, 20) if c.due(s)] == [4, 8, 12, 16]


def test_continuous_is_due_at_the_first_step_after_the_last_save_committed():
    w = Writer("test-writer", timeout_s=10)
    c = Cadence("dir", "continuous", writer=w)
    assert c.due(7)  # nothing saved by this job yet: the first step is due
    go = threading.Event()
    w.submit("a write", go.wait)
    c.saved(7, 0.001)
    assert not any(c.due(s) for s in range(8, 20))  # the write is in flight
    go.set()
    w.wait("here")
    assert c.due(20) and c.due(20)  # committed: due, and asking again changes nothing
    c.saved(20, 0.001)  # saved synchronously (nothing submitted): the next step is due
    assert c.due(21)
    w.close("here")


def test_continuous_counts_a_cancelled_save_as_ended():
    w = Writer("test-writer", timeout_s=10)
    c = Cadence("dir", "continuous", writer=w)
    go = threading.Event()
    w.submit("a write", go.wait)
    c.saved(1, 0.001)
    assert not c.due(2)
    assert w.cancel(0.05)  # never commits: the next save need not wait for it
    assert c.due(3)
    go.set()
    w.close("here")


def test_auto_waits_for_measurements_then_follows_its_choice():
    c = Cadence("dir", "auto", mtbf_hours=1.0, min_steps=2, max_steps=50)
    assert c.interval == 2 and c.due(1)  # nothing measured: the first step is due
    time.sleep(0.01)  # a slow first save...
    c.saved(1, 0.01)
    assert not c.due(2) and c.due(3)
    time.sleep(0.01)
    c.saved(3, 0.01)
    assert c.choice is None  # the first two saves are the job's warm-up: not measured
    assert c.due(5)
    c.saved(5, 0.0)  # two step times and a save by now (one that cost nothing): decided
    assert c.choice is not None and c.interval == c.choice.steps
    assert c.choice.costs.save_s == 0.0  # the warm-up's slow saves are left out
    assert 2 <= c.interval <= 50
    assert c.due(5 + c.interval) and not c.due(4 + c.interval)


def test_warm_up_writes_are_left_out_of_what_a_write_costs():
    """A job's first two writes are slow (300 ms against 20 ms later) and slow the loop more
    (50 ms steps against 8 ms): what a write costs the loop is measured from the later ones
    only, already at the first decisions."""
    w = Writer("test-writer", timeout_s=10)
    c = Cadence("dir", "auto", mtbf_hours=0.01, min_steps=6, max_steps=6, writer=w)
    writes = 0
    for step in range(42):  # 7 saves: the warm-up's 2, then 5 measured
        if c.due(step):
            w.wait("here")
            w.submit("a write", time.sleep, 0.3 if writes < 2 else 0.02)
            writes += 1
            c.saved(step, 0.0005)
        time.sleep((0.05 if writes <= 2 else 0.008) if w.activity()[1] else 0.002)
    w.close("here")
    assert [n for n, s in w.job_seconds if s >= 0.3] == [1, 2]  # the warm-up's writes
    # the warm-up's ~12 steps of 50 ms are left out; a step stalled by a loaded machine may
    # still take 40 ms now and then, so a couple are allowed
    busy = c.measured.busy_step_s
    assert busy and sum(s >= 0.04 for s in busy) <= 2, sorted(busy)
    assert 0.005 < c._contention_s() < 0.02  # about 20 × (1 − 2/8) = 15 ms
    assert c.choice is not None and c.choice.costs.save_s < 0.03


def test_the_writer_reports_its_background_jobs():
    w = Writer("test-writer", timeout_s=10)
    assert w.activity() == (0, False)
    go = threading.Event()
    w.submit("a job", go.wait)
    deadline = time.monotonic() + 5
    while w.activity() != (1, True) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert w.activity() == (1, True)
    go.set()
    w.wait("here")
    assert w.activity() == (2, False) and len(w.job_seconds) == 1
    w.submit("a failing job", lambda: 1 / 0)
    with pytest.raises(jaxckpt.errors.BackgroundSaveError, match="a failing job"):
        w.wait("here")
    assert w.activity() == (4, False) and len(w.job_seconds) == 1  # its time is not kept
    w.run_now("in the caller", lambda: None)
    assert w.activity() == (4, False)  # not a background job
    w.close("here")


def test_auto_counts_what_its_background_writes_cost_the_loop():
    """Steps take 2 ms, 8 ms while the tier's writer runs (a 40 ms write): each write costs
    the loop about 40 × (1 − 2/8) = 30 ms besides its blocking, and the chosen interval is
    the one for that cost."""
    w = Writer("test-writer", timeout_s=10)
    c = Cadence("dir", "auto", mtbf_hours=0.01, min_steps=1, max_steps=1000, writer=w)
    for step in range(400):
        if c.due(step):
            w.wait("here")
            w.submit("a write", time.sleep, 0.04)
            c.saved(step, 0.0005)
        time.sleep(0.008 if w.activity()[1] else 0.002)
    w.close("here")
    m = c.measured
    assert len(m.idle_step_s) >= 2 and len(m.busy_step_s) >= 2
    idle, busy = sorted(m.idle_step_s)[len(m.idle_step_s) // 2], sorted(m.busy_step_s)[-1]
    assert idle < busy
    contention = c._contention_s()
    assert 0.01 < contention < 0.04, contention
    assert c.choice is not None
    assert c.choice.costs.save_s == pytest.approx(0.0005 + contention, rel=0.5)
    blocking_only = intervals.choose(
        intervals.Costs(c.choice.costs.step_s, 0.0005, 0.0, c.choice.costs.mtbf_s), 1, 1000
    )
    assert c.interval > blocking_only.steps


def test_a_manager_with_auto_saves_at_the_interval_it_logged(tmp_path):
    opts = jaxckpt.Options(save_interval_steps="auto", mtbf_hours=0.05, heartbeat_s=0)
    state = {"w": np.arange(4096, dtype=np.float32)}
    saved = []
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        for step in range(1, 80):
            if mgr.save(step, state):
                saved.append(step)
    log = runlog.read(tmp_path)
    chosen = [e for e in log.events if e.event == "interval"]
    assert chosen, [e.event for e in log.events]
    last = chosen[-1].fields
    costs = intervals.Costs(last["step_s"], last["save_s"], last["restart_s"], last["mtbf_s"])
    assert intervals.choose(costs, 1, 10_000).steps == last["steps"]
    after = [s for s in saved if s > chosen[-1].step]
    assert all(b - a == last["steps"] for a, b in zip(after, after[1:], strict=False))
    assert [e.step for e in log.events if e.event == "save"] == saved
    assert log.events[0].event == "start" and log.events[-1].event == "end"
    assert log.events[-1].step == 79


def test_run_log_off_writes_nothing(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, jaxckpt.Options(run_log=False)) as mgr:
        mgr.save(1, {"x": np.zeros(3)})
    assert not (tmp_path / "runlog").exists()


@pytest.mark.slow
def test_processes_agree_on_the_auto_interval_and_the_continuous_steps(tmp_path):
    res = multiproc.run(LOOP, 2, args=["agree", str(tmp_path)], timeout_s=180).check()
    got = [json.loads(o.split("SAVED ", 1)[1].splitlines()[0]) for o in res.outputs]
    assert got[0]["saved"] == got[1]["saved"] and got[0]["steps"] == got[1]["steps"]
    assert got[0]["step_s"] == got[1]["step_s"] >= 0.016  # the slower process's steps
    assert len(got[0]["saved"]) < 60
    continuous = [json.loads(o.split("CONTINUOUS ", 1)[1].splitlines()[0]) for o in res.outputs]
    assert continuous[0] == continuous[1] and continuous[0][:1] == [1], continuous
    assert len(continuous[0]) >= 2, continuous


@pytest.mark.slow
def test_goodput_of_a_run_with_a_kill(tmp_path):
    """Process 0 dies by SIGKILL right after step 23's save call (the last local step, 20,
    is committed: synchronous saves); the job is torn down, host 1 is replaced (its disk
    wiped), and the relaunched job restores step 20: 3 steps lost in process 0's log."""
    job = multiproc.start(LOOP, 2, args=["train", str(tmp_path), "23", "100"])
    out0, _ = job.procs[0].communicate(timeout=180)
    assert job.procs[0].returncode == -9 and "KILLED AT 23" in out0, out0
    job.procs[1].kill()  # its peer is dead: a real launcher tears the job down
    job.procs[1].communicate(timeout=60)
    shutil.rmtree(tmp_path / "host1")
    res = multiproc.run(LOOP, 2, args=["train", str(tmp_path), "0", "30"], timeout_s=180)
    res.check()
    restored = [json.loads(o.split("RESTORED ", 1)[1].splitlines()[0]) for o in res.outputs]
    assert restored == [{"step": 20, "tier": "local"}, {"step": 20, "tier": "peer"}]

    g = jaxckpt.goodput(tmp_path / "host0")
    assert g.jobs == 2 and g.failures == 1 and g.last_step == 30
    (loss,) = g.losses
    assert (loss.reached_step, loss.restored_step, loss.steps_lost) == (23, 20, 3)
    assert loss.tier == "local" and loss.restart_s > 0 and loss.restore_s > 0
    assert 0 < g.ettr < 1 and g.mtbf_s == pytest.approx(g.wall_s)
    # process 1's log survived the wiped disk in the remote directory: it restored from peers
    g1 = jaxckpt.goodput(tmp_path / "remote", process=1)
    assert g1.failures == 1 and g1.losses[0].tier == "peer"
    # the command says the same
    cmd = [sys.executable, "-m", "jaxckpt", "goodput", str(tmp_path / "host0"), "--json"]
    doc = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    assert doc["failures"] == 1 and doc["losses"][0]["steps_lost"] == 3


@pytest.mark.slow
@pytest.mark.parametrize("hosts", ["one host", "a host each"])
def test_auto_after_a_restart_with_a_wiped_host_saves_the_same_steps(tmp_path, hosts):
    """Job 1 chooses an "auto" local interval and is killed; host 1 is replaced (its disk,
    and its run log there, wiped), so the two processes start job 2 from different logs:
    they must still save the same steps (the peer exchange is a collective)."""
    env = {"JAXCKPT_TEST_HOSTS": "separate"} if hosts == "a host each" else {}
    job = multiproc.start(LOOP, 2, args=["train", str(tmp_path), "40", "100", "auto"], env=env)
    out0, _ = job.procs[0].communicate(timeout=180)
    assert job.procs[0].returncode == -9 and "KILLED AT 40" in out0, out0
    job.procs[1].kill()
    job.procs[1].communicate(timeout=60)
    assert any(e.event == "interval" for e in runlog.read(tmp_path / "host0").events)
    shutil.rmtree(tmp_path / "host1")
    args = ["train", str(tmp_path), "0", "80", "auto"]
    res = multiproc.run(LOOP, 2, args=args, timeout_s=180, env=env)
    res.check()
    saved = [json.loads(o.split("SAVED ", 1)[1].splitlines()[0]) for o in res.outputs]
    assert saved[0] == saved[1] and len(saved[0]) >= 3, saved
    restored = json.loads(res.outputs[0].split("RESTORED ", 1)[1].splitlines()[0])["step"]
    # the first save after the restore, then at the interval job 1 chose (agreed from
    # process 0's log: process 1's was wiped), re-decided as job 2 measures
    assert saved[0][0] == restored + 1 and saved[0][1] - saved[0][0] > 1, (restored, saved)
