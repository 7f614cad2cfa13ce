"""Preemption notices: the signal handler, its chaining, and a one-process job that saves on
SIGTERM and resumes there (the multi-process case is in test_multihost.py)."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import jaxckpt
from jaxckpt import errors
from jaxckpt._src import preemption
from jaxckpt._src.storage import location

HERE = os.path.dirname(os.path.abspath(__file__))
ONE = os.path.join(HERE, "workers", "preempt_one.py")


def test_a_notice_is_seen_at_the_next_step_and_the_handler_chained(tmp_path):
    calls = []

    def users_own(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGUSR1, users_own)
    try:
        opts = jaxckpt.Options(preemption_signals=("SIGUSR1",))
        with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
            assert signal.getsignal(signal.SIGUSR1) is users_own  # installed on first use
            assert not mgr.reached_preemption(1)
            assert signal.getsignal(signal.SIGUSR1) is not users_own
            os.kill(os.getpid(), signal.SIGUSR1)
            assert calls == [signal.SIGUSR1]  # the handler that was there still runs
            assert mgr.reached_preemption(2) and mgr.reached_preemption(3)
            mgr.save(2, {"x": np.arange(4)}, force=True)
        assert signal.getsignal(signal.SIGUSR1) is users_own  # put back on close
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_without_a_notice_nothing_is_installed_or_reached(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": np.arange(4)})
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        assert not any(mgr.reached_preemption(s) for s in range(5))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_watch_off_the_main_thread_warns_and_still_answers(tmp_path, caplog):
    import threading

    got = []
    t = threading.Thread(
        target=lambda: got.append(
            preemption.Watch(preemption.name_for(location(tmp_path)), [signal.SIGUSR2], 5.0)
        )
    )
    t.start()
    t.join()
    (watch,) = got
    assert "off the main thread" in caplog.text
    assert not watch.reached(1)
    watch.notify()
    assert watch.reached(2) and watch.stopping
    watch.close()


def test_unknown_signal_names_are_an_options_error():
    with pytest.raises(errors.OptionsError, match="SIGNOPE"):
        jaxckpt.Options(preemption_signals=("SIGNOPE",))


def _run_until_ready(directory) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, ONE, str(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)},
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("ready"):
            return proc, "".join(lines)
    proc.wait()
    raise AssertionError("".join(lines))


def test_sigterm_saves_a_one_process_job_which_resumes_there(tmp_path):
    """One process with 8 devices (one GPU host): SIGTERM mid-training saves the step it
    reached (not only the last interval's), exits 0; the next job resumes there with the
    values bit-exact (NaN payloads included), and is preempted in turn."""
    d = tmp_path / "run"
    resumed_from = None
    for _ in range(2):
        proc, before = _run_until_ready(d)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        out = before + out
        assert proc.returncode == 0, out
        if resumed_from is not None:
            assert f"RESUMED {resumed_from}" in out
        step = int(out.split("PREEMPTED ", 1)[1].split()[0])
        with jaxckpt.CheckpointManager(d, jaxckpt.Options(read_only=True)) as mgr:
            assert mgr.latest_step() == step
        resumed_from = step


def test_the_emergency_manager_saves_the_local_tier_on_the_notice(tmp_path):
    """After the notice, force=True writes the fastest tier only; the remote save in flight
    gets preemption_grace_s and is cancelled after it (here 0 s: at once)."""
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=100,
        remote=jaxckpt.Options(save_interval_steps=100),
        preemption_signals=("SIGUSR1",),
        preemption_grace_s=0.0,
    )
    state = {"w": np.random.default_rng(0).integers(0, 2**32, (256, 256), np.uint32)}
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "local", tmp_path / "remote", opts) as m:
        assert m.save(100, state)  # both tiers: the remote one may still be in flight
        assert not m.reached_preemption(101)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert m.reached_preemption(102)
        assert m.save(102, state, force=True)
        m.wait_until_finished()
        assert m.local_steps() == [100, 102]
        assert 102 not in m.remote.all_steps()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
