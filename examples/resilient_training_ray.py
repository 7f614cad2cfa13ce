"""The resilient-training example launched with Ray: one actor per host, one dies, relaunch.

    pip install ray
    python examples/resilient_training_ray.py --processes 2 --dir /tmp/resilient_ray

The same job as examples/resilient_training.py (the Flax MLP + Optax AdamW of
examples/train_flax.py, emergency saves to each host's local directory with one peer copy),
with Ray as the cluster scheduler instead of subprocesses:

1. ``--processes`` Ray actors, each its own process of one ``jax.distributed`` job (8/N CPU
   devices each; on a real cluster, one actor per GPU host with ``num_gpus``).
2. The last actor dies at step ``--kill-at`` (SIGKILL: a host failure). Ray reports
   ``ActorDiedError``; the launcher stops the other actors, as a scheduler stops a job.
3. The lost host's local directory is deleted (a replacement machine) and a new set of actors
   is started: every process restores the newest local step, the lost shards coming from
   their peer copies, and the state is checked against what was saved.

Ray is not a dependency of jaxckpt; CI runs the plain launcher (resilient_training.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import sys
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from resilient_training import ROOT, check_resumed  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(ray, args, kill_at: int, life: int) -> tuple[list[str], list[str]]:
    """Runs one life of the job; returns (each actor's output or "", the actors that died)."""
    port = _free_port()

    @ray.remote(num_cpus=0)  # this demo oversubscribes the CPUs on purpose
    class Host:
        def run(self, directory: str, steps: int, kill: int, log: str) -> None:
            sys.path.insert(0, HERE)
            from resilient_training import worker

            # a file, line by line: what a killed actor printed survives it
            with open(log, "w", buffering=1) as f, contextlib.redirect_stdout(f):
                worker(directory, steps, kill)

    actors = []
    for pid in range(args.processes):
        env = {
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={8 // args.processes}",
            "JAXCKPT_COORD": f"127.0.0.1:{port}",
            "JAXCKPT_NPROC": str(args.processes),
            "JAXCKPT_PID": str(pid),
            "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests"), HERE]),
        }
        actors.append(Host.options(runtime_env={"env_vars": env}).remote())
    os.makedirs(args.dir, exist_ok=True)
    logs = [os.path.join(args.dir, f"life{life}_p{i}.log") for i in range(len(actors))]
    pending = {
        a.run.remote(args.dir, args.steps, kill_at, logs[i]): i for i, a in enumerate(actors)
    }
    died = []
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=args.timeout)
        if not ready:
            raise TimeoutError(f"the job did not finish within {args.timeout}s")
        i = pending.pop(ready[0])
        try:
            ray.get(ready[0])
        except ray.exceptions.RayActorError as e:
            died.append(f"actor {i}: {type(e).__name__}")
            pending.clear()  # a host is gone: the scheduler stops the whole job
    for a in actors:
        ray.kill(a)
    outputs = [Path(log).read_text() if os.path.exists(log) else "" for log in logs]
    for text in outputs:
        for line in text.splitlines():
            if line.startswith("[p"):
                print(line)
    return outputs, died


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2, choices=[2, 4, 8])
    ap.add_argument("--dir", default="/tmp/jaxckpt_resilient_ray")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=18)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    import ray

    shutil.rmtree(args.dir, ignore_errors=True)
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        print(f"== life 1: {args.processes} Ray actors; the last dies at step {args.kill_at}")
        outs, died = launch(ray, args, args.kill_at, life=1)
        assert died, "no actor died"
        print(f"== {died}; the job was stopped")
        lost = os.path.join(args.dir, f"host{args.processes - 1}")
        print(f"== replacing host {args.processes - 1}: its local directory {lost} is gone")
        shutil.rmtree(lost)
        print("== life 2: new actors")
        outs2, died2 = launch(ray, args, kill_at=-1, life=2)
        assert not died2, died2
    finally:
        ray.shutdown()
    check_resumed(outs, outs2, args.processes, args.kill_at)


if __name__ == "__main__":
    main()
