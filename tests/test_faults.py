"""Real faults, nothing of ours mocked: an ext4 disk (a loop device) that fills up under a
CheckpointManager, a small tmpfs that fills up under an EmergencyCheckpointManager's local
tier, and an S3 server (moto) behind tests/faultproxy.py, which answers 503 SlowDown, resets
connections and stalls responses.

Every fault ends the same way: each step that is listed restores bit for bit (random bit
patterns: float32 NaN payloads, bfloat16, both float8s), nothing half-written stays behind,
and the manager that met the fault goes on saving once the fault is gone.

The mounts need root (or a mount namespace); where mounting is refused those tests skip.
"""

import contextlib
import gc
import os
import subprocess
from urllib.parse import urlparse

import jax
import numpy as np
import pytest
from conftest import assert_tree_equal
from faultproxy import FaultProxy
from hostile import step_values
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors

# --- the state: a deterministic function of the step -----------------------------------------


def values(step: int, rows: int = 512) -> dict:
    """``hostile.step_values`` of ``step``; ``rows`` = 512 makes about 1.3 MB."""
    return step_values(step, rows, 512)


def state(step: int, mesh, rows: int = 512) -> dict:
    """``values(step)`` as jax arrays sharded over ``mesh`` (the NumPy leaf stays one)."""
    v = values(step, rows)
    specs = {"w": P("data", "model"), "bf16": P("data"), "e4m3": P(None, "model"), "e5m2": P()}
    for name, spec in specs.items():
        v[name] = jax.device_put(v[name], NamedSharding(mesh, spec))
    return v


def assert_restores_exactly(mgr, steps, mesh, rows: int = 512) -> None:
    """Every step of ``steps`` restores from ``mgr`` bit for bit (and its arrays are let go,
    so that a deleted step's mapped files free their space)."""
    for step in steps:
        got = mgr.restore(step)
        assert_tree_equal(got, state(step, mesh, rows))
        del got
    gc.collect()


def leftovers(directory) -> list[str]:
    """What interrupted saves left in a run directory (temporary and claim directories),
    with the files in them."""
    out = []
    for name in sorted(os.listdir(directory)):
        if ".tmp-" in name or name.startswith(".init-"):
            top = os.path.join(directory, name)
            out += [name] + [
                os.path.relpath(os.path.join(r, f), top) for r, _, fs in os.walk(top) for f in fs
            ]
    return out


def no_space(error: BaseException) -> str:
    """The text of ``error`` and its causes, checked to say ENOSPC."""
    text, e = "", error
    while e is not None:
        text += f" {e}"
        e = e.__cause__
    assert "[Errno 28]" in text or "no space" in text.lower(), text
    return text


# --- mounts ---------------------------------------------------------------------------------


def _run(*cmd: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError as e:
        pytest.skip(f"{cmd[0]} is not installed: {e}")


def _refused(what: str, res: subprocess.CompletedProcess) -> str:
    return f"{what} is refused here (needs root): {(res.stderr or res.stdout).strip()[:200]}"


@pytest.fixture
def ext4_disk(tmp_path):
    """A 40 MB ext4 filesystem on a loop device, mounted; unmounted and detached after."""
    img, mnt = tmp_path / "disk.img", tmp_path / "ext4"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(40 << 20)
    if (res := _run("mkfs.ext4", "-q", "-F", str(img))).returncode:
        pytest.skip(_refused("mkfs.ext4", res))
    if (res := _run("losetup", "--find", "--show", str(img))).returncode:
        pytest.skip(_refused("losetup", res))
    device = res.stdout.strip()
    try:
        if (res := _run("mount", device, str(mnt))).returncode:
            pytest.skip(_refused("mounting ext4 on a loop device", res))
        try:
            yield mnt
        finally:
            _run("umount", "-l", str(mnt))
    finally:
        _run("losetup", "-d", device)


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MB tmpfs, mounted; unmounted after."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if (res := _run("mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt))).returncode:
        pytest.skip(_refused("mounting a tmpfs", res))
    try:
        yield mnt
    finally:
        _run("umount", "-l", str(mnt))


# --- disk full ------------------------------------------------------------------------------


def save_until_full(mgr, make, most: int) -> tuple[list[int], tuple[int, Exception]]:
    """Saves steps 1, 2, ... (``make(step)``, each waited for) until one fails; the steps
    saved and (the step that failed, its error). That ``most`` steps fit is a failure."""
    saved: list[int] = []
    for step in range(1, most):
        try:
            mgr.save(step, make(step))
            mgr.wait_until_finished()
        except (errors.BackgroundSaveError, errors.StorageError) as e:
            return saved, (step, e)
        saved.append(step)
    raise AssertionError(f"{most} steps fit on a disk meant to fill up: {saved}")


def test_a_full_ext4_disk_fails_one_save_and_loses_nothing(ext4_disk, mesh42, o_direct_opens):
    """Steps of 2.4 MB into 30 MB of ext4 (O_DIRECT writes, the default on a disk): the save
    that does not fit raises naming ENOSPC and the run directory; the steps before it all
    restore exactly; no temporary directory stays; deleting a step makes room and the same
    manager saves the step that did not fit."""
    run = ext4_disk / "run"
    mgr = jaxckpt.CheckpointManager(run, jaxckpt.Options())
    try:
        saved, (step, error) = save_until_full(mgr, lambda s: state(s, mesh42, rows=1024), 40)
        text = no_space(error)
        assert str(run) in text, text
        assert len(saved) >= 5, saved
        assert any(p.startswith(str(ext4_disk)) for p in o_direct_opens), o_direct_opens
        assert mgr.all_steps() == saved  # the failed step is not listed
        assert leftovers(run) == []
        assert_restores_exactly(mgr, saved, mesh42, rows=1024)
        mgr.reload()
        assert mgr.all_steps() == saved

        mgr.delete(saved[0])
        mgr.save(step, state(step, mesh42, rows=1024))  # the step that did not fit
        mgr.wait_until_finished()
        assert mgr.all_steps() == [*saved[1:], step]
        assert leftovers(run) == []
    finally:
        with contextlib.suppress(errors.CheckpointError):
            mgr.close()
    with jaxckpt.CheckpointManager(run, jaxckpt.Options(read_only=True)) as ro:
        assert ro.all_steps() == [*saved[1:], step]
        assert_restores_exactly(ro, ro.all_steps(), mesh42, rows=1024)


def test_a_full_tmpfs_under_the_emergency_local_tier(small_tmpfs, tmp_path, mesh42):
    """The local tier on an 8 MB tmpfs (2 MB of it taken by another file) fills up step by
    step: the local save that does not fit raises naming ENOSPC and the local directory; the
    local steps before it restore exactly from the local tier; no temporary directory stays;
    once the other file is gone the same manager saves the step that did not fit."""
    local = small_tmpfs / "local"
    ballast = small_tmpfs / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\xa5" * (2 << 20))
    opts = jaxckpt.EmergencyOptions(local_interval_steps=1, local_max_to_keep=None)
    mgr = jaxckpt.EmergencyCheckpointManager(local, tmp_path / "remote", opts)
    try:
        saved, (step, error) = save_until_full(mgr, lambda s: state(s, mesh42), 20)
        text = no_space(error)
        assert str(local) in text, text
        assert saved and mgr.local_steps() == saved
        assert mgr.remote.all_steps() == []
        assert leftovers(local) == []
        for s in saved:
            assert_tree_equal(mgr.restore(step=s), state(s, mesh42))
            assert (mgr.last_report.tier, mgr.last_report.step) == ("local", s)
        gc.collect()

        os.remove(ballast)
        mgr.save(step, state(step, mesh42))
        mgr.wait_until_finished()
        assert mgr.local_steps() == [*saved, step]
        assert leftovers(local) == []
        assert_tree_equal(mgr.restore(), state(step, mesh42))
        assert (mgr.last_report.tier, mgr.last_report.step) == ("local", step)
    finally:
        with contextlib.suppress(errors.CheckpointError):
            mgr.close()


def fill_up(directory, leave: int = 0) -> str:
    """A file in ``directory`` taking its filesystem's free space but ``leave`` bytes."""
    path = os.path.join(directory, "ballast")
    fd = os.open(path, os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        left = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize - leave
        while left > 0:
            left -= os.write(fd, b"\xa5" * min(left, 1 << 20))
    except OSError as e:
        assert e.errno == 28, e
    finally:
        os.close(fd)
    return path


def test_a_full_disk_mid_write_says_errno_28_and_the_step(small_tmpfs):
    """A save that runs out of space while writing its arrays raises a StorageError with
    ``errno`` 28 that names the step (not its temporary directory) and what to do; nothing
    of it stays."""
    run = small_tmpfs / "run"
    with jaxckpt.CheckpointManager(run, jaxckpt.Options(async_save=False, run_log=False)) as mgr:
        fill_up(small_tmpfs, leave=256 << 10)
        with pytest.raises(errors.CheckpointError) as got:
            mgr.save(1, {"w": np.arange(1 << 20, dtype=np.float32)})  # 4 MB
        text = no_space(got.value)
        assert mgr.all_steps() == [] and leftovers(run) == []
        storage = got.value
        while not isinstance(storage, errors.StorageError):
            storage = storage.__cause__
        assert storage.errno == 28, text
        assert ".tmp-" not in str(storage) and "free space" in str(storage), text


def test_a_disk_too_full_for_the_owner_file_leaves_nothing_behind(small_tmpfs):
    """A disk so full that even the save's owner file can't be written: the save raises
    naming ENOSPC and the step, no hidden claim directory (``.init-*``) stays, and once
    space is freed the same manager saves."""
    run = small_tmpfs / "run"
    small = {"w": np.arange(1024, dtype=np.float32)}
    with jaxckpt.CheckpointManager(run, jaxckpt.Options(async_save=False, run_log=False)) as mgr:
        ballast = fill_up(small_tmpfs)
        with pytest.raises(errors.CheckpointError) as got:
            mgr.save(1, small)
        text = no_space(got.value)
        assert str(run / "00000001") in text, text
        os.remove(ballast)
        mgr.save(2, small)
        assert mgr.all_steps() == [2]
        assert_tree_equal(mgr.restore(2), small)
        assert leftovers(run) == []


# --- S3 through a faulty network --------------------------------------------------------------


@pytest.fixture
def quick_retries(monkeypatch):
    """TensorStore's own S3 retries (its logic and its 32 attempts), with a first backoff of
    0.1 s instead of its default 1 s: the few dozen retried requests of a test then cost
    seconds, not a minute. Set through the kvstore spec's ``s3_request_retries``."""
    from jaxckpt._src import storage

    real = storage.s3_options
    retries = {"max_retries": 32, "initial_delay": "0.1s", "max_delay": "2s"}
    monkeypatch.setattr(
        storage, "s3_options", lambda environ=None: {**real(environ), "s3_request_retries": retries}
    )


def _moto() -> tuple[str, int]:
    target = urlparse(os.environ["AWS_ENDPOINT_URL"])
    return target.hostname, target.port


def test_s3_through_503s_dropped_connections_and_stalls(s3_url, mesh42, monkeypatch, quick_retries):
    """Four async saves and their restores through a proxy that answers 10 % of requests
    503 SlowDown, resets 3 % of connections (before the request is forwarded, or after,
    with the response cut short) and holds 5 % back: every step commits and restores bit
    for bit, through the faulty proxy and through a read-only manager."""
    with FaultProxy(
        _moto(), p_503=0.1, p_drop=0.03, p_slow=0.05, slow_s=0.3, seed=7, midway_conditional=False
    ) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with jaxckpt.CheckpointManager(s3_url, jaxckpt.Options(max_to_keep=None)) as mgr:
            for step in range(1, 5):
                assert mgr.save(step, state(step, mesh42, rows=256))
            mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 2, 3, 4]
            assert_restores_exactly(mgr, mgr.all_steps(), mesh42, rows=256)
        with jaxckpt.CheckpointManager(s3_url, jaxckpt.Options(read_only=True)) as ro:
            assert ro.all_steps() == [1, 2, 3, 4]
            assert_restores_exactly(ro, ro.all_steps(), mesh42, rows=256)
    got = dict(proxy.injected)
    assert got["503"] > 0 and got["slow"] > 0, got
    assert got["drop_before"] + got["drop_midway"] > 0, got
    assert proxy.requests > 50, proxy.requests


def _once(method: str, suffix: str, condition: str, fault: str = "drop_midway"):
    """A ``FaultProxy.decide`` that injects ``fault`` into the first ``method`` request on a
    key ending in ``suffix`` that carries the header ``condition`` (and nothing else)."""
    hits: list[str] = []

    def decide(m: str, path: str, headers: dict[str, str]) -> str | None:
        conditional = condition.lower() in {k.lower() for k in headers}
        if not hits and m == method and path.endswith(suffix) and conditional:
            hits.append(path)
            return fault
        return None

    decide.hits = hits  # type: ignore[attr-defined]
    return decide


def test_s3_a_lost_answer_to_a_database_commit_never_lists_a_broken_step(
    s3_url, mesh42, monkeypatch, quick_retries
):
    """The server applies the conditional PUT of a step's OCDBT manifest (If-Match: the
    database's second commit, which most saves make), its answer is lost. TensorStore's
    retry of the commit then finds its own write and fails (ALREADY_EXISTS), or the save
    commits: either way no broken step is ever listed, and the same manager saves that step
    again."""
    decide = _once("PUT", "/arrays/manifest.ocdbt", "If-Match")
    with FaultProxy(_moto(), decide=decide) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with jaxckpt.CheckpointManager(s3_url, jaxckpt.Options(max_to_keep=None)) as mgr:
            for step in range(1, 5):
                try:
                    mgr.save(step, state(step, mesh42, rows=64))
                    mgr.wait_until_finished()
                except errors.BackgroundSaveError:
                    assert step not in mgr.all_steps()
                    mgr.save(step, state(step, mesh42, rows=64))
                    mgr.wait_until_finished()
            assert mgr.all_steps() == [1, 2, 3, 4]
            assert_restores_exactly(mgr, [1, 2, 3, 4], mesh42, rows=64)
    assert decide.hits and proxy.injected["drop_midway"] == 1, decide.hits


def test_s3_a_lost_answer_to_taking_the_lease_still_starts_the_manager(
    s3_url, monkeypatch, quick_retries
):
    """The server applies the lease's conditional create (If-None-Match), its answer is
    lost: the manager recognises its own record and starts (not refused naming itself)."""
    decide = _once("PUT", "/.jaxckpt-lease", "If-None-Match")
    with FaultProxy(_moto(), decide=decide) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with jaxckpt.CheckpointManager(s3_url, jaxckpt.Options(async_save=False)) as mgr:
            mgr.save(1, values(1, rows=64))
            assert mgr.all_steps() == [1]
    assert decide.hits


def test_s3_a_lost_answer_to_a_lease_heartbeat_keeps_the_lease(s3_url, monkeypatch, quick_retries):
    """The server applies the heartbeat's conditional rewrite of the lease (If-Match), its
    answer is lost: the manager recognises its own record and keeps the lease and saving."""
    decide = _once("PUT", "/.jaxckpt-lease", "If-Match")
    with FaultProxy(_moto(), decide=decide) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with jaxckpt.CheckpointManager(s3_url, jaxckpt.Options(async_save=False)) as mgr:
            mgr.save(1, values(1, rows=64))
            mgr._verdict.lease.renew()  # the heartbeat, now rather than in 10 s
            assert decide.hits
            mgr.save(2, values(2, rows=64))
            assert mgr.all_steps() == [1, 2]


def test_a_read_only_local_tier_refuses_a_save_up_front(small_tmpfs, tmp_path):
    """An emergency manager whose local directory is on a read-only mount lists and
    restores, and refuses a save at the call, naming errno 30, instead of failing later in
    the background."""
    local = small_tmpfs / "local"
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1, remote=jaxckpt.Options(save_interval_steps=10)
    )
    small = {"w": np.arange(1024, dtype=np.float32)}
    with jaxckpt.EmergencyCheckpointManager(local, tmp_path / "remote", opts) as mgr:
        mgr.save(1, small)
    assert _run("mount", "-o", "remount,ro", str(small_tmpfs)).returncode == 0
    with jaxckpt.EmergencyCheckpointManager(local, tmp_path / "remote", opts) as mgr:
        assert mgr.local_steps() == [1]
        assert_tree_equal(mgr.restore(), small)
        with pytest.raises(errors.StorageError) as got:
            mgr.save(2, small)
    assert got.value.errno == 30 and str(local) in str(got.value)
    assert "read-only" in str(got.value)
