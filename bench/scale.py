"""Multi-process scaling: fixed bytes per process, 1, 2 and 4 processes on 127.0.0.1.

usage: python bench/scale.py [--mib-per-process 64] [--repeats 3] [--procs 1,2,4]
                            [--protocol-procs 2,4,8] [--data-parallel GIB]

Prints save and restore time and the time spent in coordination (barriers and key-value
traffic, timed in ``jaxckpt._src.multihost``) with its share of the save time. Each process has
2 CPU devices; the state is one float32 array sharded over all devices plus a small one.
A second table repeats the saves with 64 KiB per process, where the processes are not busy
writing, to show the protocol's own cost as the process count grows.
"""

from __future__ import annotations

import argparse
import os

import harness

os.environ["JAXCKPT_PROTOCOL_TIMING"] = "1"  # inherited by the workers


def worker(directory: str, kib: int, repeats: int) -> dict:
    """One process of the job: saves ``repeats`` times, restores; its timings."""
    import time

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt._src import multihost

    n = jax.process_count()
    cols = 1024
    rows = max(1, (kib << 10) // (4 * cols) // 2) * 2 * n  # kib per process, even shards
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sh = NamedSharding(mesh, P("data"))
    tree = {
        "w": jax.make_array_from_callback(
            (rows, cols), sh, lambda i: np.full((i[0].stop - i[0].start, cols), 1.0, np.float32)
        ),
        "b": jax.device_put(np.arange(1024, dtype=np.float32), NamedSharding(mesh, P())),
    }
    saves, coords, restores, protocols = [], [], [], []
    for r in range(repeats):
        # every save starts together, as after a training step (not after the tail of the
        # previous restore on another process)
        multihost.barrier(f"bench/start/{r}", 600)
        multihost.coordination_stats(reset=True)
        t = time.perf_counter()
        jaxckpt.save(os.path.join(directory, f"s{r}"), tree)
        saves.append(time.perf_counter() - t)
        st = multihost.coordination_stats()
        coords.append(st["barrier_s"] + st["kv_s"])
        protocols.append(st["protocol_s"])
        t = time.perf_counter()
        out = jaxckpt.restore(os.path.join(directory, f"s{r}"), target=tree)
        jax.block_until_ready(out)
        restores.append(time.perf_counter() - t)
    calls = int(st["barriers"] + st["kv_calls"])
    return dict(n=n, save=saves, coord=coords, protocol=protocols, restore=restores, calls=calls)


def run_table(kib: int, procs: list[int], repeats: int) -> list[dict]:
    rows = []
    for n in procs:
        with harness.scratch(parent=None) as d:
            per = harness.run_job(__file__, n, directory=d, kib=kib, repeats=repeats)
        row = per[0]  # rank 0 is process 0
        # per process: best of repeats, like the save and restore columns (scheduling noise
        # on a shared 2-core machine only adds); then the mean over processes
        best = [min(p["protocol"]) for p in per]
        medians = [harness.median(p["protocol"]) for p in per]
        row["proto"] = sum(best) / len(best)
        row["proto_median"] = sum(medians) / len(medians)
        rows.append(row)
    table = harness.Table(
        (("procs", ">5"), ("KiB/proc", ">8"), ("save s", ">8.3f"), ("restore s", ">9.3f"))
        + (("wait ms", ">8.2f"), ("wait %", ">6.2f"), ("protocol ms", ">11.2f"))
        + (("protocol %", ">10.2f"), ("median ms", ">9.2f"), ("calls", ">5")),
        sep=" ",
    )
    print(table.head())
    for r in rows:
        save, wait, rest = min(r["save"]), harness.median(r["coord"]), min(r["restore"])
        proto = (r["proto"] * 1e3, 100 * r["proto"] / save, r["proto_median"] * 1e3)
        print(table.row(r["n"], kib, save, rest, wait * 1e3, 100 * wait / save, *proto, r["calls"]))
    return rows


def growth_line(rows: list[dict], label: str) -> None:
    multi = [r for r in rows if r["n"] > 1]
    for first, last in zip(multi, multi[1:], strict=False):
        growth = last["proto"] / max(first["proto"], 1e-9)
        typical = last["proto_median"] / max(first["proto_median"], 1e-9)
        allowed = last["n"] / first["n"]
        print(
            f"{harness.verdict(growth <= allowed)} protocol time ({label}) grows "
            f"{growth:.2f}x from {first['n']} to {last['n']} processes (target: at most "
            f"linear, {allowed:.1f}x; with medians instead of best: {typical:.2f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib-per-process", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument(
        "--protocol-procs",
        default="2,4,8",
        help="process counts for the second table (a 64 KiB state: the protocol alone)",
    )
    ap.add_argument(
        "--data-parallel",
        type=float,
        default=0.0,
        metavar="GIB",
        help="also run the data-parallel table (bench/data_parallel.py) with a state of GIB",
    )
    a = ap.parse_args()
    procs = [int(x) for x in a.procs.split(",")]
    print(f"== {a.mib_per_process} MiB per process")
    rows = run_table(a.mib_per_process << 10, procs, a.repeats)
    print(
        "save/restore: best of repeats (process 0). wait: median time per save process 0 spent "
        "in coordination calls, including waiting for slower writers and for process 0's own "
        "merge/commit. protocol: the coordination's own latency per save (barrier release minus "
        "the last arrival, plus key-value calls), best of repeats, mean over processes "
        "(median ms: the same with each process's median). calls: coordination calls per save "
        "per process. This machine has 2 cores: from 4 processes on, every process shares a "
        "core with others busy writing, and each call's latency includes waiting for a core."
    )
    tiny = []
    if a.protocol_procs:
        print("\n== 64 KiB per process: the same saves with next to no I/O (the protocol alone)")
        tiny = run_table(64, [int(x) for x in a.protocol_procs.split(",")], max(a.repeats, 5))
    print("\ntargets")
    last = rows[-1]
    share = 100 * last["proto"] / min(last["save"])
    print(
        f"{harness.verdict(share < 5)} protocol time at {last['n']} processes: {share:.2f}% of the "
        f"{a.mib_per_process} MiB/process save (target < 5%)"
    )
    growth_line(rows, f"{a.mib_per_process} MiB/process, I/O-loaded cores")
    growth_line(tiny, "64 KiB/process")
    if a.data_parallel:
        import data_parallel

        print(f"\n== data-parallel state, {a.data_parallel} GiB, jaxckpt vs Orbax, medians")
        dp = data_parallel.table(a.data_parallel, procs, max(3, a.repeats))
        data_parallel.write_results(dp)
        data_parallel.verdicts(dp)


if __name__ == "__main__":
    harness.entry(main, worker)
