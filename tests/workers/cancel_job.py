"""Worker: saves cancelled in a multi-process job whose remote storage is slow.

usage: cancel_job.py LOCAL_ROOT REMOTE_A REMOTE_B
Env JAXCKPT_TEST_ENDPOINTS: a JSON list, the S3 endpoint of each process (a slow proxy for
some). A CheckpointManager on REMOTE_A saves step 5 and cancels it; then an
EmergencyCheckpointManager (local LOCAL_ROOT/p<i>, remote REMOTE_B) saves step 5 remotely,
cancels it, saves it again with force=True (its local step must commit) and closes with
cancel=True. Prints ``RESULT <json>`` (the times measured, what was listed).
"""

import json
import os
import sys
import time

import multiproc

multiproc.init()

import jax  # noqa: E402

os.environ["AWS_ENDPOINT_URL"] = json.loads(os.environ["JAXCKPT_TEST_ENDPOINTS"])[
    jax.process_index()
]

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

STEP = 5
WRITING_S = 3.0  # the remote save is in flight by then: the slow process still writes


def state(mesh) -> dict:
    """2 MiB of float32, half on each process."""
    w = np.arange(1024 * 512, dtype=np.float32).reshape(1024, 512)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "step": STEP}


def timed(fn, *args, **kw) -> tuple:
    start = time.monotonic()
    out = fn(*args, **kw)
    return out, round(time.monotonic() - start, 3)


def main(local_root: str, remote_a: str, remote_b: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    tree = state(mesh)
    out: dict = {}

    mgr = jaxckpt.CheckpointManager(remote_a, jaxckpt.Options(timeout_s=60))
    mgr.save(STEP, tree)
    time.sleep(WRITING_S)
    out["manager_cancelled"], out["manager_cancel_s"] = timed(mgr.cancel)
    mgr.reload()
    out["manager_listed"] = mgr.all_steps()
    _, out["manager_close_s"] = timed(mgr.close)

    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1000,
        replication=1,
        timeout_s=60,
        remote=jaxckpt.Options(save_interval_steps=STEP, max_to_keep=3, timeout_s=60),
    )
    local = os.path.join(local_root, f"p{jax.process_index()}")
    emgr = jaxckpt.EmergencyCheckpointManager(local, remote_b, opts)
    emgr.save(STEP, tree)  # remote only
    time.sleep(WRITING_S)
    out["emergency_cancelled"], out["emergency_cancel_s"] = timed(emgr.cancel)
    emgr.remote.reload()
    out["emergency_listed"] = emgr.remote.all_steps()
    start = time.monotonic()
    emgr.save(STEP, tree, force=True)
    while STEP not in emgr.local_steps() and time.monotonic() - start < 60:
        time.sleep(0.02)
    out["local_steps"], out["local_save_s"] = emgr.local_steps(), time.monotonic() - start
    _, out["emergency_close_s"] = timed(emgr.close, cancel=True)
    print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
