"""The writer's lease: one writing job per run directory, on local disks and on S3."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import assert_tree_equal, listing

import jaxckpt
from jaxckpt import errors
from jaxckpt._src import lease
from jaxckpt._src.storage import location

HERE = os.path.dirname(os.path.abspath(__file__))


def _state(v: float) -> dict:
    return {"w": np.full((16, 8), v, np.float32), "n": np.arange(5) * int(v)}


def test_a_second_manager_is_refused_naming_the_holder(tmp_path):
    with jaxckpt.CheckpointManager(tmp_path) as first:
        first.save(1, _state(1))
        with pytest.raises(errors.DirectoryInUseError) as got:
            jaxckpt.CheckpointManager(tmp_path)
        text = str(got.value)
        assert str(tmp_path) in text and f"pid {os.getpid()}" in text
        assert f"host {socket.gethostname()}" in text and "another manager of this process" in text
        assert got.value.holder.pid == os.getpid()
        # a reader needs no lease: it lists and restores while the writer runs
        first.wait_until_finished()
        with jaxckpt.CheckpointManager(tmp_path, jaxckpt.Options(read_only=True)) as reader:
            assert reader.all_steps() == [1]
            assert_tree_equal(reader.restore(), _state(1))
            with pytest.raises(errors.StorageError, match="read_only=True"):
                reader.save(2, _state(2))
            with pytest.raises(errors.StorageError, match="read_only=True"):
                reader.delete(1)
    # released on close: the file is gone and the next job takes the lease
    assert not os.path.exists(tmp_path / lease.LEASE_FILE)
    with jaxckpt.CheckpointManager(tmp_path) as again:
        assert again.all_steps() == [1]


def test_a_killed_holder_frees_the_lease_at_once(tmp_path):
    """SIGKILL leaves the record but not the flock: the next manager takes over."""
    code = (
        "import sys, time; from jaxckpt._src import lease; from jaxckpt._src.storage import "
        "location; lease.acquire(location(sys.argv[1]), stale_s=120); print('held', "
        "flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held"
        with pytest.raises(errors.DirectoryInUseError, match=f"pid {proc.pid}"):
            lease.acquire(location(tmp_path), stale_s=120)
    finally:
        proc.kill()
        proc.wait()
    assert lease.holder(location(tmp_path)).pid == proc.pid  # the dead holder's record stays
    taken = lease.acquire(location(tmp_path), stale_s=120)
    assert taken.holder.pid == os.getpid() and lease.holder(location(tmp_path)).pid == os.getpid()
    taken.release()


def _record(path, host: str, age_s: float) -> None:
    now = time.time()
    doc = {"host": host, "pid": 4242, "job": "job-7", "since": now - age_s, "renewed": now - age_s}
    doc["stale_s"] = 3.0  # its holder's lease_stale_s: a heartbeat every 0.5 s
    fd = os.open(path / lease.LEASE_FILE, os.O_CREAT | os.O_WRONLY, 0o644)
    try:  # as a holder writes it: in place, padded (never seen empty)
        os.pwrite(fd, json.dumps(doc).encode().ljust(lease.RECORD_BYTES), 0)
    finally:
        os.close(fd)


def test_a_renewed_record_of_another_host_is_refused_a_silent_one_taken_over(tmp_path, caplog):
    """flock may not reach across hosts: a record of another host that its holder keeps
    renewing is refused; one nobody renews (a crashed job) is taken after 2.5 heartbeats."""
    opts = jaxckpt.Options()
    stop = threading.Event()

    def holder_on_another_host() -> None:
        while not stop.is_set():
            _record(tmp_path, "other-host", age_s=0)
            time.sleep(0.3)

    _record(tmp_path, "other-host", age_s=0)
    renewing = threading.Thread(target=holder_on_another_host)
    renewing.start()
    try:
        with pytest.raises(errors.DirectoryInUseError) as got:
            jaxckpt.CheckpointManager(tmp_path, opts)
    finally:
        stop.set()
        renewing.join()
    assert "host other-host, pid 4242, job job-7" in str(got.value)
    assert "take_over_lease=True" in str(got.value)
    _record(tmp_path, "other-host", age_s=0)  # its holder died right after this renewal
    started = time.monotonic()
    with jaxckpt.CheckpointManager(tmp_path, opts) as mgr:
        mgr.save(1, _state(1))
    assert 1.0 < time.monotonic() - started < 3.0  # watched 2.5 heartbeats, then taken
    assert "taking over the writer's lease" in caplog.text and "other-host" in caplog.text
    _record(tmp_path, "other-host", age_s=0)
    with jaxckpt.CheckpointManager(tmp_path, jaxckpt.Options(take_over_lease=True)) as mgr:
        assert mgr.all_steps() == [1]  # taken at once: told the holder is gone


def test_the_holder_renews_its_record_and_notices_a_replaced_file(tmp_path):
    held = lease.acquire(location(tmp_path), stale_s=120)
    before = lease.holder(location(tmp_path)).renewed
    time.sleep(0.01)
    held.renew()
    assert lease.holder(location(tmp_path)).renewed > before
    held.check()
    os.remove(tmp_path / lease.LEASE_FILE)  # by hand: another job can take it now
    other = lease.acquire(location(tmp_path), stale_s=120)
    held.renew()
    with pytest.raises(errors.DirectoryInUseError, match="lost its writer's lease"):
        held.check()
    other.release()
    held.release()


def test_two_managers_racing_for_one_directory_one_wins(tmp_path):
    """20 trials of two managers started at once (threads: separate open files, so flock
    tells them apart as it does two processes): exactly one holds the lease each time."""
    for trial in range(20):
        (tmp_path / str(trial)).mkdir()
        _race_for(location(tmp_path / str(trial)), stale_s=120)


def _race_for(directory, stale_s: float) -> None:
    """Two threads take the lease on ``directory`` at once: exactly one wins."""
    go = threading.Barrier(2)
    won, refused = [], []

    def start() -> None:
        go.wait()
        try:
            won.append(lease.acquire(directory, stale_s=stale_s))
        except errors.DirectoryInUseError as e:
            refused.append(e)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(refused) == 1, (directory, won, refused)
    won[0].release()


def test_a_read_only_directory_lists_and_restores_and_refuses_a_save(tmp_path):
    """A real read-only mount (tmpfs remounted ro): the manager is read-only by itself."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("mounting a tmpfs is refused here (needs root in a mount namespace)")
    try:
        with jaxckpt.CheckpointManager(mnt / "run") as mgr:
            mgr.save(3, _state(3))
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with jaxckpt.CheckpointManager(mnt / "run") as mgr:
            assert mgr.all_steps() == [3]
            assert_tree_equal(mgr.restore(), _state(3))
            with pytest.raises(errors.StorageError) as got:
                mgr.save(4, _state(4))
        text = str(got.value)
        assert str(mnt / "run") in text and "read-only" in text and ".init-" not in text
        assert got.value.errno == 30  # EROFS, as the lease found it
        # a single save names the directory and the errno's meaning, not a hidden file
        with pytest.raises(errors.StorageError) as got:
            jaxckpt.save(mnt / "run" / "x", _state(1))
        assert "[Errno 30] the filesystem is mounted read-only" in str(got.value)
        assert ".init-" not in str(got.value) and str(mnt / "run" / "x") in str(got.value)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


def test_s3_two_managers_one_lease(s3_url):
    """On an object store the lease is a conditional write: the second manager is refused,
    the released record is taken, a stale one taken over."""
    # a heartbeat every 0.5 s: a manager that finds the lease renewed watches it that long
    opts = jaxckpt.Options(async_save=False, run_log=False, lease_stale_s=3)
    with jaxckpt.CheckpointManager(s3_url, opts) as first:
        first.save(1, _state(1))
        with pytest.raises(errors.DirectoryInUseError, match=f"pid {os.getpid()}"):
            jaxckpt.CheckpointManager(s3_url, opts)
    assert lease.holder(location(s3_url)).released
    with jaxckpt.CheckpointManager(s3_url, opts) as second:
        assert second.all_steps() == [1]
        # another job takes it over (its holder looked gone): this one notices and stops
        thief = lease.acquire(location(s3_url), stale_s=3, take_over=True)
        second._verdict.lease.renew()
        with pytest.raises(errors.DirectoryInUseError, match="lost its writer's lease"):
            second.save(2, _state(2))
        thief.release()


def test_s3_racing_for_the_lease_one_wins(s3_url):
    """Ten rounds of two threads creating the lease object at once: one winner each."""
    for trial in range(10):
        _race_for(location(f"{s3_url}/{trial}"), stale_s=3)


TWO_JOBS = os.path.join(HERE, "workers", "two_jobs.py")


@pytest.mark.parametrize("steps, trials", [("same step", 20), ("different steps", 4)])
def test_two_jobs_saving_at_once_never_lose_a_step(tmp_path, steps, trials):
    """The issue's case: two jobs call ``CheckpointManager(d).save(7, ...)`` (or 7 and 8)
    at the same moment, 20 times. Every time: a step is listed only if it restores
    bit-exactly to the values of the job that reported it saved, and a refused job's error
    names the other job's host and pid."""
    sys.path.insert(0, os.path.join(HERE, "workers"))
    from two_jobs import values

    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    extra = ["different"] if steps == "different steps" else []
    procs = [
        subprocess.Popen(
            [sys.executable, TWO_JOBS, str(tmp_path), str(trials), str(j), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for j in range(2)
    ]
    try:
        for t in range(trials):
            (tmp_path / f"go-{t}").touch()
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"done-{t}-{j}").exists() for j in range(2)):
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
                time.sleep(0.01)
        outs = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    lines = [json.loads(line) for out in outs for line in out.splitlines()]
    refused = 0
    for t in range(trials):
        got = {r["job"]: r for r in lines if r["trial"] == t}
        saved = {r["step"]: j for j, r in got.items() if r.get("saved")}
        assert saved, got  # one of them always commits
        with jaxckpt.CheckpointManager(tmp_path / str(t), jaxckpt.Options(read_only=True)) as m:
            assert m.all_steps() == sorted(saved), (t, got)  # exactly the reported saves
            for step, job in saved.items():
                out = m.restore(step)
                assert out["job"] == job
                assert np.asarray(out["w"]).tobytes() == values(job, t)["w"].tobytes()
        for j, r in got.items():
            if r.get("error") == "DirectoryInUseError":
                refused += 1
                other = procs[1 - j].pid
                assert f"pid {other}" in r["text"] and f"host {socket.gethostname()}" in r["text"]
            elif not r.get("saved"):  # the other job committed step 7 first, then closed
                assert steps == "same step" and r.get("error") in (None, "CheckpointExistsError")
    assert refused > 0  # the jobs did overlap


def test_every_process_of_a_second_job_is_refused(tmp_path):
    """Multi-process: process 0 takes the lease, the others learn the verdict, so a whole
    second job stops at construction, every process naming the holder."""
    sys.path.insert(0, HERE)
    import multiproc

    loop = os.path.join(HERE, "workers", "manager_loop.py")
    with jaxckpt.CheckpointManager(tmp_path / "run"):
        res = multiproc.run(loop, 2, args=["save", str(tmp_path / "run"), "2"], timeout_s=120)
    assert res.returncodes == [1, 1], res.outputs
    for out in res.outputs:
        assert "DirectoryInUseError" in out and f"pid {os.getpid()}" in out, out
    assert listing(tmp_path / "run") == []  # nothing written


def test_a_takeover_from_another_host_is_noticed_by_the_holder(tmp_path):
    """On a shared filesystem whose flock stays on each host, a job on another host that
    takes the lease over (take_over_lease) rewrites the record: the holder stops saving."""
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, _state(1))
        mgr.wait_until_finished()
        _record(tmp_path, "other-host", age_s=0)  # what the other host's manager wrote
        mgr._verdict.lease.renew()
        with pytest.raises(errors.DirectoryInUseError, match="taken over by host other-host"):
            mgr.save(2, _state(2))
