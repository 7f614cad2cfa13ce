"""Worker: a CheckpointManager (async saves) in a multi-process job.

usage: manager_loop.py save DIR N      saves steps 1..N, then closes
       manager_loop.py restore DIR S   restores the newest step, which must be S
       manager_loop.py preempt DIR     trains until reached_preemption, saves that step
Env JAXCKPT_TEST_KILL_RANK=r and JAXCKPT_TEST_KILL_STEP=s: process r SIGKILLs itself when
the save of step s reaches its "written" barrier (after writing, before the commit).
"""

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
from jaxckpt._src import multihost  # noqa: E402

if os.environ.get("JAXCKPT_TEST_HOSTS") == "separate":  # simulated machines
    os.environ["JAXCKPT_HOST"] = f"host{jax.process_index()}"

SPECS = {"w": P("data", "model"), "b": P("model")}


def expected(step: int) -> dict:
    return {
        "w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step,
        "b": np.arange(32, dtype=np.float32) * step,
        "step": step,
    }


def state(mesh, step: int) -> dict:
    exp = expected(step)
    out = {
        k: jax.make_array_from_callback(
            exp[k].shape, NamedSharding(mesh, spec), lambda i, v=exp[k]: v[i]
        )
        for k, spec in SPECS.items()
    }
    out["step"] = step
    return out


def check(out: dict, step: int) -> None:
    exp = expected(step)
    assert out["step"] == step, out["step"]
    for k in SPECS:
        for shard in out[k].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), exp[k][shard.index])


def kill_at_written(step_path: str) -> None:
    real = multihost.barrier

    def barrier(name: str, timeout_s: float, **kw) -> None:
        if name.endswith("/written") and kw.get("what", "").endswith(step_path):
            print("killing myself", jax.process_index(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real(name, timeout_s, **kw)

    multihost.barrier = barrier


def main(mode: str, directory: str, arg: str | None) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    timeout = float(os.environ.get("JAXCKPT_TEST_TIMEOUT", 60))
    opts = jaxckpt.Options(max_to_keep=2, async_save=True, timeout_s=timeout)
    mgr = jaxckpt.CheckpointManager(directory, opts)
    if mode == "save":
        if int(os.environ.get("JAXCKPT_TEST_KILL_RANK", -1)) == jax.process_index():
            kill_at_written(f"{int(os.environ['JAXCKPT_TEST_KILL_STEP']):08d}")
        for step in range(1, int(arg) + 1):
            mgr.save(step, state(mesh, step))
            print("saving", step, flush=True)
            if os.environ.get("JAXCKPT_TEST_WAIT"):  # wait right away, as the issue found
                mgr.wait_until_finished()
        mgr.close()
    elif mode == "restore":
        assert mgr.latest_step() == int(arg), mgr.all_steps()
        check(mgr.restore(), int(arg))
        mgr.close()
    elif mode == "preempt":  # saves every 5 steps; the notice's step with force=True
        for step in range(1, 100_000):
            if mgr.reached_preemption(step):
                mgr.save(step, state(mesh, step), force=True)
                mgr.close()
                print("preempted at", step, flush=True)
                return
            if step % 5 == 0:
                mgr.save(step, state(mesh, step))
            if step == 3:
                print("ready", flush=True)
            time.sleep(0.02)
        raise SystemExit("never preempted")
    print("ok", mode, jax.process_index(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
