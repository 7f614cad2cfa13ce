"""Real multi-process runs through jax.distributed on 127.0.0.1 (CPU devices, gloo)."""

import json
import os
import pathlib
import signal
import socket
import time

import multiproc
import pytest
from conftest import listing
from hypothesis import given, settings
from hypothesis import strategies as st

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "workers", "save_restore.py")
LOOP = os.path.join(HERE, "workers", "manager_loop.py")
HOSTILE = os.path.join(HERE, "workers", "hostile_job.py")


@pytest.mark.slow
def test_two_processes_save_one_process_restores(tmp_path):
    path = str(tmp_path / "c")
    multiproc.run(WORKER, 2, devices_per_process=4, args=["save", path]).check()
    manifest = json.loads(pathlib.Path(path, "manifest.json").read_text())
    assert manifest["process_count"] == 2
    assert manifest["process_hosts"] == [socket.gethostname()] * 2
    # each process wrote its own shards once: bytes per process sum to the logical bytes
    logical = 64 * 32 * 4 + 32 * 4 + 16 * 16 * 4
    assert sum(manifest["bytes_per_process"]) == logical
    assert all(b > 0 for b in manifest["bytes_per_process"])
    assert sorted(os.listdir(os.path.join(path, "arrays"))) == ["d", "manifest.ocdbt", "p0", "p1"]
    multiproc.run(WORKER, 1, devices_per_process=8, args=["restore", path]).check()


@pytest.mark.slow
def test_one_process_saves_two_processes_restore(tmp_path):
    path = str(tmp_path / "c")
    multiproc.run(WORKER, 1, devices_per_process=8, args=["save", path]).check()
    multiproc.run(WORKER, 2, devices_per_process=4, args=["restore", path]).check()


# Another process count: 2 -> 1 (test_two_processes_save_one_process_restores), 1 -> 2
# (test_one_process_saves_two_processes_restore), 4 -> 4 and 4 -> 2 with permuted ids (below),
# 2 -> 4 with every dtype's random bits (the separate-hosts run of
# test_random_layouts_and_bits_through_every_multi_process_path). Each restore run checks a
# target on another layout, ``mesh=`` and neither (saved mesh by position).
@pytest.mark.slow
def test_restart_with_permuted_process_ids(tmp_path):
    """Processes come back in another order: devices have new ids; restore by position."""
    path = str(tmp_path / "c")
    multiproc.run(WORKER, 4, devices_per_process=2, args=["save", path]).check()
    multiproc.run(
        WORKER, 4, devices_per_process=2, args=["restore", path], process_ids=[2, 0, 3, 1]
    ).check()
    multiproc.run(
        WORKER, 2, devices_per_process=4, args=["restore", path], process_ids=[1, 0]
    ).check()


@pytest.mark.slow
def test_manager_async_saves_then_restore_in_another_layout(tmp_path):
    d = str(tmp_path / "run")
    multiproc.run(LOOP, 2, devices_per_process=4, args=["save", d, "3"]).check()
    assert listing(d) == ["00000002", "00000003"]  # max_to_keep=2
    multiproc.run(LOOP, 4, devices_per_process=2, args=["restore", d, "3"]).check()


@pytest.mark.slow
@pytest.mark.parametrize("wait", ["", "1"], ids=["close", "wait_until_finished"])
def test_process_killed_mid_save(tmp_path, wait):
    """Survivors raise CoordinationError naming the dead process, whether they wait for the
    async save at close() or right after save() (the wait outlives the writer's barrier);
    the previous step restores (checked once: the files are the same either way)."""
    d = str(tmp_path / "run")
    env = {
        "JAXCKPT_TEST_KILL_RANK": "1",
        "JAXCKPT_TEST_KILL_STEP": "2",
        "JAXCKPT_TEST_TIMEOUT": "3",
        "JAXCKPT_TEST_WAIT": wait,
        "JAXCKPT_SHUTDOWN_TIMEOUT": "1",  # the survivor's wait for the dead process at exit
    }
    t = time.monotonic()
    res = multiproc.run(LOOP, 2, devices_per_process=4, args=["save", d, "2"], env=env)
    elapsed = time.monotonic() - t
    assert res.returncodes[1] == -signal.SIGKILL, res.outputs[1]
    assert res.returncodes[0] != 0
    out = res.outputs[0]
    assert "CoordinationError" in out and "process(es) [1] of 2 never arrived" in out, out
    assert "within 3s" in out and "00000002" in out, out
    assert elapsed < 30, elapsed  # 3 s save timeout + 1 s shutdown timeout + start-up
    assert not any(n.startswith("00000002") for n in os.listdir(d)), os.listdir(d)
    if not wait:
        multiproc.run(LOOP, 2, devices_per_process=4, args=["restore", d, "1"]).check()


@pytest.mark.slow
def test_processes_saving_different_steps_fail_before_writing(tmp_path):
    path = str(tmp_path / "c")
    res = multiproc.run(
        WORKER, 2, devices_per_process=4, args=["save", path], env={"JAXCKPT_TEST_SKEW": "1"}
    )
    assert res.returncodes == [1, 1], res.outputs
    for out in res.outputs:
        assert "processes disagree on what to save" in out, out
        assert "process(es) [0]" in out and "process(es) [1]" in out, out
    assert os.listdir(tmp_path) == []  # nothing written, not even a temporary directory


@pytest.mark.slow
def test_sigterm_to_one_process_saves_an_agreed_step(tmp_path):
    """SIGTERM to process 1 of 2 (each its own host), JAX's preemption service off (jaxckpt
    agrees through the key-value store; orbax#3406 raised there): both stop at one step,
    save it, exit 0, and the next job resumes there bit-exactly."""
    d = str(tmp_path / "run")
    env = {"JAXCKPT_TEST_HOSTS": "separate", "JAXCKPT_TEST_NO_PREEMPTION_SERVICE": "1"}
    job = multiproc.start(LOOP, 2, devices_per_process=4, args=["preempt", d], env=env)
    first = job.procs[1].stdout
    for line in first:
        if line.startswith("ready"):
            break
    job.procs[1].send_signal(signal.SIGTERM)
    res = job.wait(60).check()
    steps = {
        line.split()[-1]
        for out in res.outputs
        for line in out.splitlines()
        if "preempted at" in line
    }
    assert len(steps) == 1, res.outputs
    (step,) = steps
    assert f"{int(step):08d}" in listing(d)
    multiproc.run(LOOP, 2, devices_per_process=4, args=["restore", d, step], env=env).check()


# --- replica-parallel writes ---------------------------------------------------------------

DATA_PARALLEL = os.path.join(HERE, "workers", "data_parallel.py")
DP_LOGICAL = 4 * 1024 * 1024 * 4 + 12 * 16 * 4 + (1 << 19) * 4 + 256 * 4096 * 4 + 10 * 4


def _bytes_by_rule(path: str, n: int) -> list[int]:
    import math

    from jaxckpt._src.manifest import Manifest
    from jaxckpt._src.sharding import saved_writers

    m = Manifest.from_json(pathlib.Path(path, "manifest.json").read_text(), where=path)
    per = [0] * n
    for rec in m.leaves:
        if not rec.has_array or not rec.nbytes:
            continue
        itemsize = rec.nbytes // math.prod(rec.shape)
        for coords, p in saved_writers(rec, m.meshes).items():
            extent = [
                min(c, s - i * c)
                for i, c, s in zip(coords, rec.chunk_shape, rec.shape, strict=True)
            ]
            per[p] += math.prod(extent) * itemsize
    return per


def _restore_io(path: str, n: int, hosts: str) -> list[dict]:
    """Each process's I/O counters over a restore, its chunks read with read calls, which
    the OS counts (``JAXCKPT_MAP=0``: mapped onto CPU devices, they would be faulted in)."""
    res = multiproc.run(
        DATA_PARALLEL, n, devices_per_process=8 // n, args=["restore", path],
        env={"JAXCKPT_TEST_HOSTS": hosts, "JAXCKPT_MAP": "0"},
    )  # fmt: skip
    return [
        json.loads(line.split(" ", 1)[1])
        for out in res.check().outputs
        for line in out.splitlines()
        if line.startswith("IO ")
    ]


@pytest.mark.slow
@pytest.mark.parametrize("n", [4])  # (2 processes: the other multi-process tests)
def test_data_parallel_state_is_written_by_every_process(tmp_path, n):
    """Parameters replicated over 'data' (spanning the processes) are written in parts, one
    per replica's process; small leaves go round-robin. Bytes written per process, measured
    by each process from /proc/self/io, stay within 1.25x of the mean; restores are exact on
    the same mesh, another mesh and another process count."""
    path = str(tmp_path / "c")
    res = multiproc.run(DATA_PARALLEL, n, devices_per_process=8 // n, args=["save", path])
    written = [
        json.loads(line.split(" ", 1)[1])["write_bytes"]
        for out in res.check().outputs
        for line in out.splitlines()
        if line.startswith("IO ")
    ]
    assert len(written) == n
    mean = sum(written) / n
    print("bytes written per process", written, "bytes_per_process in the manifest", end=" ")
    assert max(written) <= 1.25 * mean, written
    assert sum(written) >= DP_LOGICAL  # every byte went to disk, once (plus small metadata)
    manifest = json.loads(pathlib.Path(path, "manifest.json").read_text())
    print(manifest["bytes_per_process"])
    assert sum(manifest["bytes_per_process"]) == DP_LOGICAL
    assert max(manifest["bytes_per_process"]) <= 1.25 * DP_LOGICAL / n, manifest
    # the manifest lists no chunk writers for named shardings: the rule gives them, and it
    # accounts for exactly the bytes each process reported writing
    assert _bytes_by_rule(path, n) == manifest["bytes_per_process"]
    # Read once: on separate (simulated) machines, what all processes read from storage is
    # about the logical bytes and each reads about its share (TensorStore's file kvstore
    # counter, and the OS's rchar), page cache dropped first.
    reads = _restore_io(path, n, "separate")
    for key in ("ts_file_bytes_read", "rchar"):
        got = [r[key] for r in reads]
        print(key, got, end=" ")
        assert sum(got) <= 1.2 * DP_LOGICAL, (key, got)
        assert max(got) <= 1.25 * DP_LOGICAL / n, (key, got)
    # On one machine the processes share its page cache: each reads what it needs itself
    # (the OS's rchar: the direct read path reads data files with preadv, not TensorStore)
    got = [r["rchar"] for r in _restore_io(path, n, "same")]
    assert min(got) >= 0.9 * DP_LOGICAL, got
    other = 1 if n == 2 else 2
    multiproc.run(
        DATA_PARALLEL, other, devices_per_process=8 // other, args=["restore", path]
    ).check()


@pytest.mark.slow
def test_leaf_on_one_process_restores_everywhere(tmp_path):
    """A leaf that lives only on process 0's devices (a pipeline stage) restores in a
    2-process job through jaxckpt.restore, the manager and the emergency manager: the
    process holding none of it builds its (empty) part too; and again from the peer copies,
    which that leaf reaches as a packed row, after process 0's local disk is lost."""
    worker = os.path.join(HERE, "workers", "submesh_leaf.py")
    res = multiproc.run(worker, 2, devices_per_process=4, args=[str(tmp_path)]).check()
    for pid, out in enumerate(res.outputs):
        for how in (
            "jaxckpt.restore",
            "CheckpointManager",
            "EmergencyCheckpointManager",
            "from peer copies",
        ):
            assert f"restored {how} {pid}" in out, out


@pytest.mark.slow
def test_processes_of_one_host_read_an_object_store_once(s3_url):
    """An object store has no page cache the processes of a host share: 2 processes on one
    host restoring a data-parallel state from s3:// (moto on 127.0.0.1) read it from the
    bucket about once in all (TensorStore's s3 kvstore counter), not once each."""
    multiproc.run(DATA_PARALLEL, 2, args=["save", s3_url], timeout_s=240).check()
    got = [r["ts_s3_bytes_read"] for r in _restore_io(s3_url, 2, "same")]
    print("bytes read from the bucket per process", got)
    assert sum(got) <= 1.2 * DP_LOGICAL, got
    assert max(got) <= 0.65 * DP_LOGICAL, got


@pytest.mark.slow
@pytest.mark.property
@pytest.mark.parametrize("machines", ["one host", "separate hosts"])
@settings(max_examples=max(1, settings().max_examples // 20))  # ci: 1, fuzz: 10
@given(seed=st.integers(0, 2**31 - 1))
def test_random_layouts_and_bits_through_every_multi_process_path(machines, seed):
    """Every dtype (bf16, float8s, int1/int2 included), random shapes and PartitionSpecs and
    random bits drawn from ``seed`` (tests/workers/hostile_job.py), 2 processes of one host
    or as separate hosts, in one job: saved, restored (read once + move where hosts differ)
    onto saved, replicated and random specs; an async manager; the emergency tier with the
    last host's local directory wiped (its shards from the other's peer copies); as separate
    hosts also an async manager and exported parameters (as NumPy values and as arrays on
    another mesh), and restored by 4 processes too (onto the saved and random specs). Every
    shard compared as bytes, every leaf's fingerprint checked against the values, and no
    warning from a restore."""
    import tempfile

    env = {"JAXCKPT_TEST_SEED": str(seed)}
    if machines == "separate hosts":
        env["JAXCKPT_TEST_MACHINES"] = "separate"
    # the manager's and the export's paths do not depend on how hosts are laid out: one
    # host runs the paths that do (read once and the moves, peer copies)
    modes = "save,restore,emergency"
    if machines == "separate hosts":
        modes += ",manager,export"
    with tempfile.TemporaryDirectory() as root:
        res = multiproc.run(HOSTILE, 2, args=[modes, root], env=env, timeout_s=300).check()
        assert "from_peers=(PeerSlice(" in res.outputs[1], res.outputs[1][-2000:]
        for mode in modes.split(","):
            assert all(f"ok {mode} {pid}" in out for pid, out in enumerate(res.outputs)), mode
        if machines == "separate hosts":
            args = ["regrid", root]
            multiproc.run(
                HOSTILE, 4, devices_per_process=2, args=args, env=env, timeout_s=240
            ).check()
