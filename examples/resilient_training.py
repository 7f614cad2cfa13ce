"""N processes train with the EmergencyCheckpointManager; one dies; the job resumes.

    python examples/resilient_training.py --processes 2 --dir /tmp/resilient --steps 30

1. N processes of one jax.distributed job (8/N CPU devices each) train the Flax MLP with
   Optax AdamW of examples/train_flax.py on a (4, 2) mesh; local saves every 4 steps (replication=1: each process's shards also live
   on the next process's disk), remote saves every 10 steps.
2. At step --kill-at the last process SIGKILLs itself (a host failure); the launcher then
   stops the others, as a cluster scheduler would.
3. That host's local directory is deleted (the replacement machine has an empty disk) and the
   job is relaunched: every process restores the newest local step, the lost process's
   shards coming from their peer copy, checks the state equals what was saved, and trains on.

On a real cluster run the ``worker`` part once per host; the local directory is that host's
RAM disk or NVMe (see configs/emergency_gpu.toml), the remote one shared storage.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
LOCAL_EVERY, REMOTE_EVERY = 4, 10


def checksum(state) -> str:
    """A global checksum of the parameters and optimizer state's bits (every process gets
    it): a weighted sum of their 32-bit words modulo 2**32, which no summation order or
    sharding changes (a float sum would: a restored leaf may be sharded as the target is, not
    as the training step left it)."""
    import jax
    import jax.numpy as jnp

    def words(x):
        x = x if x.dtype.itemsize == 4 else x.astype(jnp.float32)
        return jax.lax.bitcast_convert_type(x, jnp.uint32)

    leaves = [x for x in jax.tree.leaves((state.params, state.opt_state)) if x.ndim]
    total = jax.jit(lambda xs: sum(jnp.sum(words(x) * jnp.uint32(2 * i + 1), dtype=jnp.uint32)
                                   for i, x in enumerate(xs)))(leaves)  # fmt: skip
    return f"{int(total):08x}"


def worker(directory: str, steps: int, kill_at: int) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, HERE)
    import multiproc

    multiproc.init()
    import jax
    from jax.sharding import AxisType

    # the Flax MLP + Optax AdamW, fed by a Grain pipeline per process
    from train_flax import batches, create_state, global_batch, train_step

    import jaxckpt

    pid, count = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=LOCAL_EVERY,
        replication=1,
        timeout_s=60,
        remote=jaxckpt.Options(save_interval_steps=REMOTE_EVERY, max_to_keep=3, timeout_s=60),
    )
    local_dir = os.path.join(directory, f"host{pid}")
    with jaxckpt.EmergencyCheckpointManager(
        local_dir, os.path.join(directory, "remote"), opts
    ) as mgr:
        state = create_state(mesh)  # also the restore target: shapes and shardings
        it = batches()
        start = 0
        # agreed on every process: a replaced host with an empty disk resumes too
        if mgr.latest_step() is not None:
            state = mgr.restore(target=state)
            it.set_state(mgr.per_process())  # for a replaced host: from a peer's copy
            rep = mgr.last_report
            start = rep.step
            print(
                f"[p{pid}] resumed from the {rep.tier} tier at step {rep.step}; "
                f"{len(rep.from_peers)} slices from peers; iterator position from process "
                f"{rep.per_process_from}; rejected: {list(rep.rejected)}; "
                f"checksum {checksum(state)}",
                flush=True,
            )
        for step in range(start + 1, steps + 1):
            if step == kill_at and pid == count - 1:
                print(f"[p{pid}] host failure at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            state, loss = train_step(state, *global_batch(next(it), mesh))  # step becomes step
            if mgr.reached_preemption(step):  # SIGTERM to any process: all stop at this step
                mgr.save(step, state, force=True, per_process=it.get_state())  # local tier
                mgr.wait_until_finished()
                print(f"[p{pid}] preempted: saved step {step}", flush=True)
                return
            saved = mgr.save(step, state, per_process=it.get_state())
            if saved and step % LOCAL_EVERY == 0:
                print(
                    f"[p{pid}] step {step} loss {float(loss):.5f} saved, checksum "
                    f"{checksum(state)}; local save blocked "
                    f"{mgr.last_save_figures.phases['local'] * 1e3:.1f} ms",
                    flush=True,
                )
        print(f"[p{pid}] done at step {steps}, loss {float(loss):.5f}", flush=True)


def check_resumed(outs: list[str], outs2: list[str], processes: int, kill_at: int) -> None:
    """Checks, from the two lives' output, that every process resumed from the newest local
    step before the failure with the state it had saved; prints the verdict as JSON."""
    newest = (kill_at - 1) // LOCAL_EVERY * LOCAL_EVERY
    saved = {
        line.split("checksum ")[1].split(";")[0]
        for out in outs
        for line in out.splitlines()
        if f"step {newest} loss" in line
    }
    resumed = [line for out in outs2 for line in out.splitlines() if "resumed from" in line]
    assert len(resumed) == processes, resumed
    assert all(f"local tier at step {newest}" in line for line in resumed), resumed
    assert {line.split("checksum ")[1] for line in resumed} == saved, (saved, resumed)
    print(json.dumps({"resumed_step": newest, "tier": "local", "state_equal": True}))


def launch(args, kill_at: int) -> tuple[list[int], list[str]]:
    from multiproc import start

    job = start(
        os.path.abspath(__file__),
        args.processes,
        devices_per_process=8 // args.processes,
        args=["--worker", "--dir", args.dir, "--steps", str(args.steps), "--kill-at", str(kill_at)],
    )
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in job.procs]
        if all(c is not None for c in codes):
            break
        if any(c not in (None, 0) for c in codes):  # one died: the scheduler stops the job
            time.sleep(1.0)
            for p in job.procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    res = job.wait(30)
    for out in res.outputs:
        for line in out.splitlines():
            if line.startswith("[p"):
                print(line)
    if any(c not in (0, -signal.SIGKILL) for c in res.returncodes):
        print(res.outputs[0][-3000:])
    return res.returncodes, res.outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2, choices=[2, 4, 8])
    ap.add_argument("--dir", default="/tmp/jaxckpt_resilient")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=18)
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.dir, args.steps, args.kill_at)
        return
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    shutil.rmtree(args.dir, ignore_errors=True)
    print(f"== run 1: {args.processes} processes; the last one dies at step {args.kill_at}")
    codes, outs = launch(args, args.kill_at)
    assert codes[-1] == -signal.SIGKILL, codes
    lost = os.path.join(args.dir, f"host{args.processes - 1}")
    print(f"== replacing host {args.processes - 1}: its local directory {lost} is gone")
    shutil.rmtree(lost)
    print("== run 2: relaunch")
    codes, outs2 = launch(args, kill_at=-1)
    assert all(c == 0 for c in codes), codes
    check_resumed(outs, outs2, args.processes, args.kill_at)


if __name__ == "__main__":
    main()
