"""CheckpointManager: policies, async saves, staging, errors, option files, leftovers."""

import os
import shutil
import threading

import jax
import numpy as np
import pytest
from conftest import assert_tree_equal, listing, sharded

import jaxckpt
from jaxckpt import errors
from jaxckpt._src.options import OptionsError
from jaxckpt.errors import BackgroundSaveError

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "configs")


def _state(mesh, step):
    return {
        "w": sharded(np.full((64, 32), step, np.float32), mesh, ("data", "model")),
        "b": sharded(np.arange(32, dtype=np.float32) + step, mesh, ("model",)),
        "step": step,
    }


def test_async_save_restore_and_listing(mesh42, tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        for step in range(3):
            assert mgr.save(step, _state(mesh42, step))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 1, 2] and mgr.latest_step() == 2
        assert_tree_equal(mgr.restore(), _state(mesh42, 2))
        assert_tree_equal(mgr.restore(1, target=_state(mesh42, 0)), _state(mesh42, 1))
        assert mgr.metadata(1)["w"].shape == (64, 32)
    assert listing(tmp_path) == ["00000000", "00000001", "00000002"]
    # a fresh manager sees the same committed steps
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [0, 1, 2]


def test_snapshot_is_taken_when_save_returns(mesh42, tmp_path):
    """The async save writes what the state was at save(), whatever happens to it after."""
    host = np.full((64, 32), 1.0, np.float32)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": host})
        host[:] = 99.0  # mutate right after save returned
        mgr.wait_until_finished()
        np.testing.assert_array_equal(mgr.restore(1)["x"], np.full((64, 32), 1.0))


def test_stage_handle(mesh42, tmp_path):
    state = _state(mesh42, 5) | {"host": np.arange(16.0)}
    staged = jaxckpt.stage(state)
    assert staged.host_bytes == 16 * 8  # NumPy leaves are copied; CPU device buffers are not
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, staged)
        mgr.wait_until_finished()
        assert_tree_equal(mgr.restore(5, target=state), state)
    jaxckpt.save(tmp_path / "single", jaxckpt.stage(state))
    assert_tree_equal(jaxckpt.restore(tmp_path / "single", target=state), state)


def test_host_buffers_are_reused_across_saves(mesh42, tmp_path):
    """The second save's snapshot of NumPy leaves goes into the first one's host buffers:
    seen from outside as NumPy memory (traced by tracemalloc) that does not grow."""
    import tracemalloc

    def state(step):
        return {"a": np.full((512, 256), step, np.float32), "b": np.arange(8) * step}

    nbytes = 512 * 256 * 4
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        s0, s1 = state(0), state(1)
        tracemalloc.start()
        try:
            mgr.save(0, s0)
            mgr.wait_until_finished()
            first = tracemalloc.get_traced_memory()[1]
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            mgr.save(1, s1)
            mgr.wait_until_finished()
            second = tracemalloc.get_traced_memory()[1] - base
        finally:
            tracemalloc.stop()
        assert first >= nbytes  # the first save allocated the snapshot buffers
        assert second < nbytes / 4, (first, second)  # the second reused them
        assert_tree_equal(mgr.restore(0), s0)
        assert_tree_equal(mgr.restore(1), s1)


def test_donating_the_state_right_after_save_does_not_change_the_snapshot(mesh42, tmp_path):
    """The train step donates the state while the background save still writes it."""
    state = _state(mesh42, 3)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 0 - 1, s), donate_argnums=0)
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(3, state)
        arrays_only = {k: v for k, v in state.items() if k != "step"}
        new = step(arrays_only)  # runs while the save may be in flight
        jax.block_until_ready(new)
        mgr.wait_until_finished()
        assert_tree_equal(mgr.restore(3), _state(mesh42, 3))
        assert float(np.asarray(new["w"])[0, 0]) == -1.0


def test_sync_mode(mesh42, tmp_path):
    opts = jaxckpt.Options(async_save=False)
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        mgr.save(3, _state(mesh42, 3))
        assert mgr.all_steps() == [3]  # committed before save returned
        assert not any(t.name == "jaxckpt-writer" for t in threading.enumerate())


def test_intervals_and_force(mesh42, tmp_path):
    with jaxckpt.CheckpointManager(tmp_path, jaxckpt.Options(save_interval_steps=5)) as mgr:
        saved = [s for s in range(12) if mgr.save(s, {"s": s})]
        assert saved == [0, 5, 10]
        assert mgr.save(7, {"s": 7}, force=True)
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 5, 7, 10]
        assert not mgr.save(5, {"s": 5})  # already saved: the policy says no
        with pytest.raises(errors.CheckpointExistsError, match="step 5"):
            mgr.save(5, {"s": 5}, force=True)


def test_continuous_skips_steps_while_the_last_save_is_written(tmp_path):
    """``"continuous"``: the first step is saved; while its write is in flight (16 MiB: it
    outlasts the next call by far) a step is skipped; the first step after it committed is
    saved. Invalid values name the field and the fix."""
    state = {"w": np.arange(4 << 20, dtype=np.float32)}
    opts = jaxckpt.Options(save_interval_steps="continuous")
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        assert mgr.save(1, state)
        assert not mgr.save(2, state)  # step 1 is being written
        mgr.wait_until_finished()
        assert mgr.save(3, state)  # the first step after step 1 committed
        assert not mgr.should_save(4)
        mgr.wait_until_finished()
        assert mgr.should_save(5) and mgr.save(5, state)
    assert mgr.all_steps() == [1, 3, 5]
    with pytest.raises(OptionsError, match="save_interval_steps.*'continuous'"):
        jaxckpt.Options(save_interval_steps="continous")
    with pytest.raises(OptionsError, match="save_interval_steps='continuous' needs async_save"):
        jaxckpt.Options(save_interval_steps="continuous", async_save=False)
    toml = tmp_path / "continuous.toml"
    toml.write_text('save_interval_steps = "continuous"\n')
    assert jaxckpt.Options.from_file(toml).save_interval_steps == "continuous"


def test_max_to_keep_and_keep_period(tmp_path):
    opts = jaxckpt.Options(max_to_keep=2, keep_period=4)
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        for s in range(10):
            mgr.save(s, {"s": np.int32(s)})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [0, 4, 8, 9]
    assert listing(tmp_path) == ["00000000", "00000004", "00000008", "00000009"]


def test_best_n_by_metric_keeps_newest(tmp_path):
    losses = [5.0, 1.0, 4.0, 0.5, 3.0, 2.0]
    opts = jaxckpt.Options(max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        for s, loss in enumerate(losses):
            mgr.save(s, {"s": s}, metrics={"loss": loss})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3, 5]  # best two, plus the newest
        assert mgr.best_step() == 3
        assert mgr.metrics(1) == {"loss": 1.0}
    # metrics survive a restart
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        assert mgr.best_step() == 3


def test_best_mode_max(tmp_path):
    opts = jaxckpt.Options(max_to_keep=1, best_fn=lambda m: m["acc"], best_mode="max")
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        for s, acc in enumerate([0.1, 0.9, 0.5, 0.3]):
            mgr.save(s, {"s": s}, metrics={"acc": acc})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 3]


def test_delete_and_reload(tmp_path):
    reader = jaxckpt.Options(read_only=True)  # a second writer would be refused (the lease)
    with (
        jaxckpt.CheckpointManager(tmp_path) as mgr,
        jaxckpt.CheckpointManager(tmp_path, reader) as other,
    ):
        mgr.save(1, {"a": 1})
        mgr.save(2, {"a": 2})
        mgr.delete(1)
        assert mgr.all_steps() == [2]
        assert other.all_steps() == []
        other.reload()
        assert other.all_steps() == [2]
        with pytest.raises(errors.CheckpointNotFoundError, match="step 1"):
            mgr.restore(1)


def test_background_failure_surfaces_with_step(tmp_path):
    directory = tmp_path / "run"
    mgr = jaxckpt.CheckpointManager(directory)
    shutil.rmtree(directory)
    directory.write_text("not a directory any more")  # the next write must fail
    assert mgr.save(7, {"x": np.ones(4)})
    with pytest.raises(BackgroundSaveError, match="step 7") as info:
        mgr.wait_until_finished()
    assert info.value.__cause__ is not None
    mgr.close()  # the error was raised once; close is clean
    assert not any(t.name == "jaxckpt-writer" for t in threading.enumerate())


def test_background_failure_raised_at_next_save_and_close(tmp_path):
    directory = tmp_path / "run"
    mgr = jaxckpt.CheckpointManager(directory)
    shutil.rmtree(directory)
    directory.write_text("x")
    mgr.save(1, {"x": np.ones(4)})
    with pytest.raises(BackgroundSaveError, match="step 1"):  # failed or failing meanwhile
        mgr.save(2, {"x": np.ones(4)})
    mgr2 = jaxckpt.CheckpointManager(tmp_path / "run2")
    shutil.rmtree(tmp_path / "run2")
    (tmp_path / "run2").write_text("x")
    mgr2.save(3, {"x": np.ones(4)})
    with pytest.raises(BackgroundSaveError, match="step 3"):
        mgr2.close()
    mgr.close()


def test_close_with_save_in_flight_finishes_it(mesh42, tmp_path):
    big = {"w": sharded(np.ones((2048, 1024), np.float32), mesh42, ("data",))}
    mgr = jaxckpt.CheckpointManager(tmp_path)
    mgr.save(1, big)
    mgr.close()
    assert not any(t.name == "jaxckpt-writer" for t in threading.enumerate())
    assert listing(tmp_path) == ["00000001"]
    assert_tree_equal(jaxckpt.restore(tmp_path / "00000001", target=big), big)
    with pytest.raises(errors.CheckpointError, match="closed"):
        mgr.save(2, big)


def test_leftovers_are_cleaned_and_never_listed(tmp_path):
    jaxckpt.save(tmp_path / "00000001", {"a": 1})
    jaxckpt.save(tmp_path / "00000002", {"a": 2})
    os.remove(tmp_path / "00000002" / "COMMITTED")  # crashed before its marker
    (tmp_path / "00000003.tmp-abc" / "arrays").mkdir(parents=True)  # crashed mid-write
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        assert mgr.all_steps() == [1]
        assert listing(tmp_path) == ["00000001"]
        mgr.save(2, {"a": 22})
        mgr.wait_until_finished()
        assert mgr.restore(2) == {"a": 22}


def test_staging_budget_falls_back_to_sync(mesh42, tmp_path):
    opts = jaxckpt.Options(staging_budget_bytes=1024)
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        mgr.save(0, _state(mesh42, 0))
        assert mgr.all_steps() == [0]  # written before save returned: no staging


def test_restore_empty_directory(tmp_path):
    with (
        jaxckpt.CheckpointManager(tmp_path) as mgr,
        pytest.raises(errors.CheckpointNotFoundError, match="no committed step"),
    ):
        mgr.restore()


def test_option_files(tmp_path):
    for name in ("default.toml", "large_run.toml", "best_of.toml"):
        opts = jaxckpt.Options.from_file(os.path.join(CONFIGS, name))
        assert isinstance(opts, jaxckpt.Options)
    best = jaxckpt.Options.from_file(os.path.join(CONFIGS, "best_of.toml"))
    assert best.best_fn({"eval_loss": 0.25}) == 0.25 and best.max_to_keep == 2
    assert (
        jaxckpt.Options.from_file(os.path.join(CONFIGS, "default.toml"), max_to_keep=3).max_to_keep
        == 3
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("save_interval_steps = 10\nmax_to_kep = 3\n")
    with pytest.raises(OptionsError, match="max_to_kep"):
        jaxckpt.Options.from_file(bad)
    bad.write_text("save_interval_steps = 0\n")
    with pytest.raises(OptionsError, match="save_interval_steps"):
        jaxckpt.Options.from_file(bad)
    bad.write_text("save_interval_steps = \n")
    with pytest.raises(OptionsError, match="not valid TOML"):
        jaxckpt.Options.from_file(bad)


def test_prng_and_python_leaves_through_manager(mesh42, tmp_path):
    state = {"key": jax.random.key(3), "lr": 0.1, "name": "run"}
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(0, state)
        mgr.wait_until_finished()
        assert_tree_equal(mgr.restore(0, target=state), state)


@pytest.mark.slow
def test_sigkill_at_random_moments_never_exposes_a_partial_step(tmp_path):
    """4 trials: a saving loop is SIGKILLed at a moment drawn from each quarter of its first
    0.8 s of saving in turn; only committed steps show (bench/faults.py kills at random for
    minutes)."""
    import random
    import subprocess
    import sys
    import time

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    from crash_loop import expected

    worker = os.path.join(os.path.dirname(__file__), "workers", "crash_loop.py")
    rng = random.Random(1234)
    directory = tmp_path / "run"
    newest_seen = 0
    trials = 4
    for trial in range(trials):
        proc = subprocess.Popen(
            [sys.executable, worker, str(directory)], stdout=subprocess.PIPE, text=True
        )
        line = proc.stdout.readline()
        assert line.startswith("ready"), f"trial {trial}: worker said {line!r}"
        time.sleep((trial + rng.random()) * 0.8 / trials)
        proc.kill()
        proc.wait()
        with jaxckpt.CheckpointManager(directory, jaxckpt.Options(max_to_keep=3)) as mgr:
            steps = mgr.all_steps()
            assert steps, f"trial {trial}: nothing committed"
            leftovers = [n for n in listing(directory) if not n.isdigit()]
            assert leftovers == [], f"trial {trial}: leftovers not cleaned: {leftovers}"
            assert all((directory / f"{s:08d}" / "COMMITTED").exists() for s in steps)
            newest = mgr.latest_step()
            assert newest >= newest_seen
            newest_seen = newest
            assert_tree_equal(mgr.restore(), expected(newest) | {"step": newest})


@pytest.mark.slow
def test_resume_after_kill_is_bit_identical(tmp_path):
    """2N steps straight == N steps, SIGKILL, resume, N more: same losses, same parameters."""
    import json
    import signal
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "train_flax.py")

    def start(directory, log, *extra):
        cmd = [sys.executable, example, "--dir", str(directory), "--steps", "12"]
        cmd += ["--save-every", "3", "--log", str(log), *extra]
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(proc):
        out, err = proc.communicate(timeout=300)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    # the straight run and the run that is killed are independent: side by side
    straight_proc = start(tmp_path / "a", tmp_path / "a.log")
    killed = run(start(tmp_path / "b", tmp_path / "b.log", "--kill-at", "6"))
    straight = run(straight_proc)
    assert straight.returncode == 0, straight.stderr
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    # the resume and a run that gets SIGTERM at step 7 (below), side by side too
    termed_proc = start(tmp_path / "c", tmp_path / "c.log", "--term-at", "7")
    resumed = run(start(tmp_path / "b", tmp_path / "b.log", "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 6" in resumed.stdout

    def losses(log):
        return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines())}

    assert losses(tmp_path / "a.log") == losses(tmp_path / "b.log")
    assert len(losses(tmp_path / "a.log")) == 12
    digest = [line for line in straight.stdout.splitlines() if "digest" in line]
    assert digest and digest == [line for line in resumed.stdout.splitlines() if "digest" in line]

    # SIGTERM at step 7 (saves every 3): the example saves step 7 itself and exits 0 (the
    # resume from such a step: test_preemption.py)
    termed = run(termed_proc)
    assert termed.returncode == 0, termed.stderr
    assert "preempted: saved step 7" in termed.stdout
    with jaxckpt.CheckpointManager(tmp_path / "c", jaxckpt.Options(read_only=True)) as mgr:
        assert mgr.latest_step() == 7


def test_manager_on_s3(s3_url, mesh42):
    """Save, list, restore and retention against the local S3 server."""
    opts = jaxckpt.Options(max_to_keep=2)
    with jaxckpt.CheckpointManager(s3_url, opts) as mgr:
        for step in range(4):
            mgr.save(step, _state(mesh42, step))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
        assert_tree_equal(mgr.restore(), _state(mesh42, 3))
    with jaxckpt.CheckpointManager(s3_url, opts) as mgr:
        assert mgr.all_steps() == [2, 3]
        assert_tree_equal(mgr.restore(2, target=_state(mesh42, 0)), _state(mesh42, 2))
        assert sorted(mgr.directory.list_children()) == [
            ".jaxckpt-lease",  # the lease object, held now (it says released once closed)
            "00000002",
            "00000003",
            "runlog",
        ]


@pytest.mark.slow
def test_interrupted_saves_on_s3_never_show(s3_url):
    """A saving loop writing to S3 is SIGKILLed; a fresh manager lists committed steps only."""
    import random
    import subprocess
    import sys
    import time

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))
    from crash_loop import expected

    worker = os.path.join(os.path.dirname(__file__), "workers", "crash_loop.py")
    rng = random.Random(7)
    for trial in range(3):
        proc = subprocess.Popen([sys.executable, worker, s3_url], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().startswith("ready"), f"trial {trial}"
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.wait()
        # the killed job's lease is taken over after 2.5 of its heartbeats (0.2 s each)
        with jaxckpt.CheckpointManager(s3_url, jaxckpt.Options(max_to_keep=3)) as mgr:
            newest = mgr.latest_step()
            assert newest is not None
            committed = [
                n for n in mgr.directory.list_children() if n not in ("runlog", ".jaxckpt-lease")
            ]
            assert all(name.isdigit() for name in committed)
            assert [int(n) for n in committed] == mgr.all_steps()
            assert_tree_equal(mgr.restore(), expected(newest) | {"step": newest})


def test_interpreter_exit_finishes_the_save_in_flight(tmp_path):
    """A script that returns right after an async save still commits it (atexit)."""
    import subprocess
    import sys

    script = (
        "import jaxckpt, numpy as np\n"
        f"mgr = jaxckpt.CheckpointManager({str(tmp_path)!r})\n"
        "mgr.save(4, {'w': np.ones((1024, 1024), np.float32)})\n"
        "print('returned', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert listing(tmp_path) == ["00000004"]
    np.testing.assert_array_equal(
        jaxckpt.restore(tmp_path / "00000004")["w"], np.ones((1024, 1024), np.float32)
    )


def test_second_manager_leaves_a_save_in_progress_alone(mesh42, tmp_path):
    """Opening another manager (an evaluator, read-only: a second writer is refused) while a
    save writes must not delete it."""
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": sharded(np.ones((2048, 1024), np.float32), mesh42, ("data",))})
        with pytest.raises(errors.DirectoryInUseError):
            jaxckpt.CheckpointManager(tmp_path)
        with jaxckpt.CheckpointManager(tmp_path, jaxckpt.Options(read_only=True)) as evaluator:
            assert evaluator.all_steps() in ([], [1])
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1]
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        np.testing.assert_array_equal(np.asarray(mgr.restore(1)["w"]), np.ones((2048, 1024)))
        assert sorted(os.listdir(tmp_path / "00000001")) == ["COMMITTED", "arrays", "manifest.json"]


def test_best_n_ignores_nan_and_missing_metrics(tmp_path):
    opts = jaxckpt.Options(max_to_keep=2, best_fn=lambda m: m["loss"])
    metrics = [
        {"loss": 3.0},
        {"loss": float("nan")},
        {"loss": 1.0},
        {"acc": 1},
        {"loss": 0.5},
        None,
    ]
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        for step, m in enumerate(metrics):
            mgr.save(step, {"s": step}, metrics=m)
        mgr.wait_until_finished()
        assert mgr.best_step() == 4
        assert mgr.all_steps() == [2, 4, 5]  # best two, plus the newest
    with jaxckpt.CheckpointManager(tmp_path / "b", opts) as mgr:
        mgr.save(0, {"s": 0})
        mgr.wait_until_finished()
        assert mgr.best_step() == 0  # no metrics anywhere: the newest


def test_metrics_and_metadata_must_be_json(tmp_path):
    import jax.numpy as jnp

    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(errors.ManifestError, match="metrics must be JSON"):
            mgr.save(0, {"s": 0}, metrics={"loss": jnp.float32(0.5)})
        with pytest.raises(errors.ManifestError, match="custom_metadata must be JSON"):
            mgr.save(0, {"s": 0}, custom_metadata={"cfg": object()})
        assert mgr.save(0, {"s": 0}, metrics={"loss": 0.5}, custom_metadata={"cfg": "a"})
        assert mgr.save(1, {"s": 1}, force=True)
        mgr.wait_until_finished()
        assert mgr.custom_metadata(0) == {"cfg": "a"} and mgr.custom_metadata() is None
    with pytest.raises(errors.ManifestError, match="custom_metadata"):
        jaxckpt.save(tmp_path / "x", {"s": 0}, custom_metadata={"cfg": object()})
    assert not (tmp_path / "x").exists()


def test_close_reports_a_save_it_could_not_finish(mesh42, tmp_path):
    big = {"w": sharded(np.ones((4096, 4096), np.float32), mesh42, ("data",))}
    mgr = jaxckpt.CheckpointManager(tmp_path, jaxckpt.Options(timeout_s=0.001))
    mgr.save(1, big)
    with pytest.raises(BackgroundSaveError, match="still writing"):
        mgr.close()
    # the save goes on in the background and its thread ends after it (joined here, so its
    # figures don't reach the next test's listeners)
    for t in [t for t in threading.enumerate() if t.name == "jaxckpt-writer"]:
        t.join(120)
        assert not t.is_alive()


def test_random_bits_of_every_dtype_through_a_manager(mesh42, tmp_path):
    """One process: sync and async saves of random bits of every dtype, restored exactly."""
    from hostile import DTYPES, random_bits

    rng = np.random.default_rng(7)
    state = {
        d.name: sharded(random_bits((8, 4), d, rng), mesh42, ("data", "model"))
        for d in DTYPES
        if jax.dtypes.canonicalize_dtype(d) == d
    }
    for async_save in (False, True):
        with jaxckpt.CheckpointManager(
            tmp_path / str(async_save), jaxckpt.Options(async_save=async_save)
        ) as mgr:
            mgr.save(1, state)
            mgr.wait_until_finished()
            assert_tree_equal(mgr.restore(1, target=state), state)


def test_a_committed_step_without_its_manifest_is_skipped_with_a_warning(mesh42, tmp_path, caplog):
    """What the old commit race left (COMMITTED alone), an older version's crash or a hand:
    the run goes on from the newest step that reads, and the warning names the step."""
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(mesh42, 1))
        mgr.save(2, _state(mesh42, 2))
    os.remove(tmp_path / "00000002" / "manifest.json")
    shutil.rmtree(tmp_path / "00000002" / "arrays")
    (tmp_path / "00000003").mkdir()
    (tmp_path / "00000003" / "COMMITTED").touch()
    (tmp_path / "00000004").mkdir()  # a manifest that does not parse
    (tmp_path / "00000004" / "manifest.json").write_text('{"format_version": ')
    (tmp_path / "00000004" / "COMMITTED").touch()
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        assert "00000002" in caplog.text and "00000003" in caplog.text
        assert "no manifest.json" in caplog.text
        assert mgr.all_steps() == [1, 4]
        assert_tree_equal(mgr.restore(target=_state(mesh42, 0)), _state(mesh42, 1))
        assert "skipping step 4" in caplog.text
        mgr.save(5, _state(mesh42, 5))  # and the run goes on
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        assert_tree_equal(mgr.restore(target=_state(mesh42, 0)), _state(mesh42, 5))
