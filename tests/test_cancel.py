"""Cancelling a save in flight (``mgr.cancel()``, ``close(cancel=True)``): it returns within
its bound, the step never shows, its leftovers go, and the manager saves again."""

import json
import os
import time
from urllib.parse import urlparse

import jax
import multiproc
import numpy as np
import pytest
from conftest import listing
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from slowproxy import SlowProxy

import jaxckpt
from jaxckpt._src import writer
from jaxckpt._src.goodput import runlog
from jaxckpt._src.writer import Cancel
from jaxckpt.errors import SaveCancelledError

HERE = os.path.dirname(os.path.abspath(__file__))
BOUND_S = 2.0


def big_state(mesh, mib: int = 96) -> dict:
    """Enough bytes that the background write is still going when cancel() comes."""
    w = np.random.default_rng(0).standard_normal((mib << 18,), dtype=np.float32).reshape(-1, 1024)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("x"))), "step": 1}


@pytest.fixture
def mesh8():
    return jax.make_mesh((8,), ("x",))


def test_cancel_with_nothing_in_flight_is_a_noop(ckpt_dir, tmp_path, mesh8):
    with jaxckpt.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.cancel() is False
        mgr.save(1, {"a": np.arange(4)}, force=True)
        mgr.wait_until_finished()
        assert mgr.cancel() is False  # committed: nothing to cancel
        assert mgr.all_steps() == [1]
    opts = jaxckpt.EmergencyOptions(local_interval_steps=1)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts) as em:
        assert em.cancel() is False


def test_cancel_an_async_save_on_a_local_dir(ckpt_dir, mesh8):
    mgr = jaxckpt.CheckpointManager(ckpt_dir, jaxckpt.Options(async_save=True))
    state = big_state(mesh8)
    mgr.save(1, state, force=True)
    start = time.monotonic()
    assert mgr.cancel() is True
    assert time.monotonic() - start < BOUND_S
    mgr.wait_until_finished()  # the cancelled save's error is not raised
    mgr.reload()
    assert mgr.all_steps() == []
    assert not os.path.exists(mgr.step_path(1).url)
    mgr.save(1, state, force=True)  # the same step again: it commits
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1]
    np.testing.assert_array_equal(mgr.restore()["w"], np.asarray(state["w"]))
    mgr.close()
    assert listing(ckpt_dir) == ["00000001"]  # nothing of the cancelled save
    events = [(e.event, e.step) for e in runlog.read(ckpt_dir).events]
    assert events == [("start", None), ("cancel", 1), ("save", 1), ("restore", 1), ("end", 1)]


def test_close_with_cancel(ckpt_dir, mesh8):
    mgr = jaxckpt.CheckpointManager(ckpt_dir, jaxckpt.Options(async_save=True))
    mgr.save(1, big_state(mesh8), force=True)
    start = time.monotonic()
    mgr.close(cancel=True)
    assert time.monotonic() - start < BOUND_S
    with jaxckpt.CheckpointManager(ckpt_dir) as again:
        assert again.all_steps() == []
    assert listing(ckpt_dir) == []


def test_a_cancel_and_a_commit_are_decided_once():
    first = Cancel("save 1")
    first.claim()  # the commit came first: a later cancel loses
    assert first.cancel() is False
    second = Cancel("save 2")
    assert second.cancel() is True
    assert second.cancel() is True  # asking again changes nothing
    with pytest.raises(SaveCancelledError, match="save 2 was cancelled"):
        second.claim()


def test_a_save_outside_a_manager_cannot_be_cancelled(tmp_path):
    """``jaxckpt.save`` commits with ``writer.NEVER``: its checks pass, a cancel never wins,
    and its waits stay uninterruptible (no check to poll between slices)."""
    assert writer.NEVER.cancel() is False and not writer.NEVER.cancelled
    for step in (writer.NEVER.check, writer.NEVER.poll, writer.NEVER.claim):
        step()  # none raises
    assert writer.NEVER.waits_check() is None and not writer.NEVER.follows_cancel
    assert Cancel("save 3").waits_check() is not None
    jaxckpt.save(tmp_path / "c", {"a": np.arange(4)})
    assert jaxckpt.restore(tmp_path / "c")["a"].tolist() == [0, 1, 2, 3]


def _objects(s3_url: str) -> list[str]:
    import boto3

    parsed = urlparse(s3_url)
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    pages = s3.get_paginator("list_objects_v2").paginate(
        Bucket=parsed.netloc, Prefix=parsed.path.lstrip("/") + "/"
    )
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def test_cancel_a_slow_remote_save_in_a_two_process_job(tmp_path, s3_url):
    """Process 1 reaches S3 through a proxy at 64 KiB/s (its 1 MiB takes 16 s); process 0
    directly, so it has written its part and waits for process 1 when both cancel."""
    target = urlparse(os.environ["AWS_ENDPOINT_URL"])
    remote_a, remote_b = f"{s3_url}/a", f"{s3_url}/b"
    with SlowProxy((target.hostname, target.port), rate=64 << 10) as proxy:
        endpoints = [os.environ["AWS_ENDPOINT_URL"], proxy.endpoint]
        result = multiproc.run(
            os.path.join(HERE, "workers", "cancel_job.py"),
            2,
            args=[str(tmp_path / "local"), remote_a, remote_b],
            env={"JAXCKPT_TEST_ENDPOINTS": json.dumps(endpoints)},
            timeout_s=180,
        ).check()
    got = [json.loads(o.split("RESULT ", 1)[1].splitlines()[0]) for o in result.outputs]
    print(got)
    for out in got:
        assert out["manager_cancelled"] is True and out["emergency_cancelled"] is True
        for key in ("manager_cancel_s", "manager_close_s", "emergency_cancel_s"):
            assert out[key] < BOUND_S, (key, out)
        assert out["emergency_close_s"] < BOUND_S, out
        assert out["manager_listed"] == [] and out["emergency_listed"] == []
        assert out["local_steps"] == [5]  # the grace period's local save committed
    # process 0 waited at a barrier for process 1: its job stopped, it was not abandoned at
    # the bound (process 1's is still inside its slow TensorStore write)
    assert got[0]["manager_cancel_s"] < 0.95 and got[0]["emergency_cancel_s"] < 0.95, got
    leftovers = _objects(remote_a)
    assert any("/00000005/" in k for k in leftovers)  # process 0's part of the cancelled save
    with jaxckpt.CheckpointManager(remote_a) as mgr:  # the next start clears it
        assert mgr.all_steps() == []
    assert [k for k in _objects(remote_a) if "/runlog/" not in k and "lease" not in k] == []
    for pid in (0, 1):  # each process's run log (an object per job on S3) has the cancel
        events = runlog.read(remote_a, pid).events
        assert [e.step for e in events if e.event == "cancel"] == [5], events
