"""Worker: a training loop whose run log the goodput tests check.

usage: goodput_loop.py agree ROOT       2 processes, a CheckpointManager with an "auto"
                                        interval; process p's steps take (p + 1) * 8 ms:
                                        prints ``SAVED <json>`` (the steps saved and the
                                        chosen interval) on every process, then the
                                        same loop with "continuous": ``CONTINUOUS <json>``
       goodput_loop.py train ROOT K N   an EmergencyCheckpointManager (local every 5 steps,
                                        replication 1, heartbeat at every save call):
                                        restores if it can (``RESTORED <json>``), trains to
                                        step N; process 0 SIGKILLs itself once step K's save
                                        call returned (K = 0: never) and the job ends
                                        without close (a killed job), else it closes
       goodput_loop.py train ROOT K N auto  the same with local_interval_steps="auto" (at most 10): also
                                        prints ``SAVED <json>``, the steps it saved
"""

import json
import os
import signal
import sys
import time

import multiproc

multiproc.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

mode, root = sys.argv[1], sys.argv[2]
pid = jax.process_index()
if os.environ.get("JAXCKPT_TEST_HOSTS") == "separate":  # simulated machines
    os.environ["JAXCKPT_HOST"] = f"host{pid}"
mesh = jax.make_mesh((jax.device_count(),), ("data",))


def state(step: int) -> dict:
    w = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) + step
    arr = jax.make_array_from_callback(w.shape, NamedSharding(mesh, P("data")), lambda i: w[i])
    return {"w": arr, "step": step}


def steps_saved(name: str, opts: jaxckpt.Options, steps: int, pause_s: float) -> tuple:
    """A loop of ``steps`` steps, each process ``pause_s`` x (its index + 1) a step, saving
    every step it may: the steps saved, and the manager's cadence."""
    saved = []
    with jaxckpt.CheckpointManager(os.path.join(root, name), opts) as mgr:
        for step in range(1, steps + 1):
            time.sleep((pid + 1) * pause_s)
            if mgr.save(step, state(step)):
                saved.append(step)
    return saved, mgr._cadence


if mode == "agree":
    opts = jaxckpt.Options(save_interval_steps="auto", mtbf_hours=0.01, heartbeat_s=0)
    saved, cadence = steps_saved("run", opts, 60, 0.008)
    choice = cadence.choice
    out = {"saved": saved, "steps": choice.steps, "step_s": choice.costs.step_s}
    print("SAVED", json.dumps(out), flush=True)
    # each process sees its writer finish at its own step: the steps saved are agreed
    opts = jaxckpt.Options(save_interval_steps="continuous", heartbeat_s=0)
    saved, _ = steps_saved("continuous", opts, 40, 0.004)
    print("CONTINUOUS", json.dumps(saved), flush=True)
else:
    kill_at, last = int(sys.argv[3]), int(sys.argv[4])
    auto = sys.argv[5:] == ["auto"]
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps="auto" if auto else 5, replication=1, heartbeat_s=0,
        async_save=False, mtbf_hours=0.02, max_interval_steps=10,
        remote=jaxckpt.Options(save_interval_steps=10**6, max_to_keep=3, async_save=False),
    )  # fmt: skip
    mgr = jaxckpt.EmergencyCheckpointManager(
        os.path.join(root, f"host{pid}"), os.path.join(root, "remote"), opts
    )
    start = 0
    if mgr.latest_step() is not None:
        s = mgr.restore(target=state(0))
        start = s["step"]
        tier = "peer" if mgr.last_report.from_peers else mgr.last_report.tier
        print("RESTORED", json.dumps({"step": start, "tier": tier}), flush=True)
    saved = []
    for step in range(start + 1, last + 1):
        time.sleep(0.01)
        if mgr.save(step, state(step)):
            saved.append(step)
        if pid == 0 and step == kill_at:
            print("KILLED AT", step, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    print("SAVED", json.dumps(saved), flush=True)
    print("DONE", flush=True)
