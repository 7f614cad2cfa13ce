"""What per-process values (data-iterator positions) cost a save, in both managers.

    python bench/per_process.py [--mib 64] [--saves 10] [--processes 2]

N processes (8/N CPU devices each) save the same sharded state ``--saves`` times with each
manager, with and without ``per_process=`` (a Grain iterator's state), alternating so that
disk noise hits both alike. Prints the median blocking and wall (save + wait) seconds of the
slowest process and the ratio with/without, in the same run.
Target: the value costs at most 10% of the save's wall time in both managers.
"""

from __future__ import annotations

import argparse
import os
import sys

import harness


def worker(root: str, mib: int, saves: int) -> dict:
    """One process: its medians of blocking and wall seconds, by manager and with_value."""
    import time

    import grain
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt._src import multihost

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows = mib * (1 << 20) // (1024 * 4)
    state = {
        "w": jax.make_array_from_callback(
            (rows, 1024),
            NamedSharding(mesh, P("data")),
            lambda i: np.full((rows, 1024), 1.0, np.float32)[i],
        )
    }
    it = iter(grain.MapDataset.range(10**6).shuffle(seed=1).batch(32).to_iter_dataset())
    next(it)
    pid = jax.process_index()

    def managers():
        yield (
            "CheckpointManager",
            jaxckpt.CheckpointManager(os.path.join(root, "m"), jaxckpt.Options(max_to_keep=2)),
        )
        opts = jaxckpt.EmergencyOptions(
            local_interval_steps=1,
            replication=1,
            local_max_to_keep=2,
            remote=jaxckpt.Options(save_interval_steps=10**9),
        )
        yield (
            "EmergencyCheckpointManager",
            jaxckpt.EmergencyCheckpointManager(
                os.path.join(root, f"host{pid}"), os.path.join(root, "r"), opts
            ),
        )

    out = {}
    step = 0
    for name, mgr in managers():
        times = {False: ([], []), True: ([], [])}
        for r in range(2 * saves + 2):
            with_value = r % 2 == 1
            step += 1
            value = it.get_state() if with_value else None
            multihost.barrier(f"bench/{name}/{r}", 60)
            t = time.perf_counter()
            mgr.save(step, state, per_process=value)
            blocking = time.perf_counter() - t
            mgr.wait_until_finished()
            wall = time.perf_counter() - t
            if r >= 2:  # the first pair compiles and warms up
                times[with_value][0].append(blocking)
                times[with_value][1].append(wall)
        mgr.close()
        out[name] = {str(k): [harness.median(b), harness.median(w)] for k, (b, w) in times.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64, help="state size per process")
    ap.add_argument("--saves", type=int, default=10, help="saves with and without, each")
    ap.add_argument("--processes", type=int, default=2)
    args = ap.parse_args()
    with harness.scratch(parent=None) as root:
        results = harness.run_job(
            __file__, args.processes, devices=8 // args.processes, timeout_s=600,
            root=root, mib=args.mib * args.processes, saves=args.saves,
        )  # fmt: skip
    print(f"{args.processes} processes, {args.mib} MiB each, {args.saves} saves of each kind")
    table = harness.Table(
        (("manager", "<28"), ("per_process", ">12"), ("blocking s", ">12.4f"), ("wall s", ">10.4f"))
    )
    print(table.head())
    ok = True
    for name in results[0]:
        walls = {}
        for with_value in ("False", "True"):
            blocking = max(r[name][with_value][0] for r in results)
            wall = max(r[name][with_value][1] for r in results)
            walls[with_value] = wall
            label = "yes" if with_value == "True" else "no"
            print(table.row(name, label, blocking, wall))
        ratio = walls["True"] / walls["False"]
        passed = ratio <= 1.10
        ok &= passed
        print(f"  {harness.verdict(passed)} wall with / without: {ratio:.3f} (target <= 1.10)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    harness.entry(main, worker)
