"""Worker: saves a deterministic state every step, forever, until it is killed.

usage: crash_loop.py DIR      (prints "ready" once DIR holds a committed step: a kill from
then on must leave one, however slow the storage; a save is issued before it is committed)
The state at step s is ``expected(s)`` so the parent can check any restored step.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def expected(step: int) -> dict:
    return {
        "w": np.full((512, 256), step, np.float32),
        "b": np.arange(256, dtype=np.float32) * step,
        "step": step,
    }


def main(directory: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    specs = {"w": P("data", "model"), "b": P("model")}
    # a short lease: the test's next manager takes it over 0.5 s after this job is killed
    mgr = jaxckpt.CheckpointManager(directory, jaxckpt.Options(max_to_keep=3, lease_stale_s=1.2))
    step = (mgr.latest_step() or 0) + 1
    said = False
    while True:
        state = {
            k: jax.device_put(v, NamedSharding(mesh, specs[k])) if k in specs else v
            for k, v in expected(step).items()
        }
        mgr.save(step, state)
        if not said and mgr.all_steps():
            print("ready", step, flush=True)
            said = True
        step += 1


if __name__ == "__main__":
    main(sys.argv[1])
