"""Worker: a one-process training job (8 CPU devices, no jax.distributed) under a
CheckpointManager, preempted by SIGTERM.

usage: preempt_one.py DIR   restores the newest step if there is one (``RESUMED <step>``,
                            checked bit-exactly), trains, saving every 10 steps; prints
                            ``ready`` at step 3 of its run; on the notice saves the step it
                            reached, prints ``PREEMPTED <step>`` and exits 0
"""

import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def state(mesh, step: int) -> dict:
    # hostile bits: every float32 pattern a step's seed draws, NaN payloads included
    bits = np.random.default_rng(step).integers(0, 2**32, (64, 32), dtype=np.uint32)
    w = bits.view(np.float32)
    return {"w": jax.device_put(w, NamedSharding(mesh, P("data", "model"))), "step": step}


def main(directory: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    opts = jaxckpt.Options(save_interval_steps=10, max_to_keep=2)
    with jaxckpt.CheckpointManager(directory, opts) as mgr:
        start = 0
        if mgr.latest_step() is not None:
            out = mgr.restore(target=state(mesh, 0))
            start = out["step"]
            want = state(mesh, start)
            assert np.asarray(out["w"]).tobytes() == np.asarray(want["w"]).tobytes()
            print("RESUMED", start, flush=True)
        for step in range(start + 1, start + 100_000):
            s = state(mesh, step)  # "training"
            if mgr.reached_preemption(step):
                mgr.save(step, s, force=True)
                mgr.wait_until_finished()
                print("PREEMPTED", step, flush=True)
                return
            mgr.save(step, s)
            if step == start + 3:
                print("ready", flush=True)
            time.sleep(0.01)
    raise SystemExit("never preempted")


if __name__ == "__main__":
    main(sys.argv[1])
