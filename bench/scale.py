"""Multi-process scaling: fixed bytes per process, 1, 2 and 4 processes on 127.0.0.1.

usage: python bench/scale.py [--mib-per-process 64] [--repeats 3] [--procs 1,2,4]

Prints save and restore time and the time spent in coordination (barriers and key-value
traffic, timed in ``jaxckpt.multihost``) with its share of the save time. Each process has
2 CPU devices; the state is one float32 array sharded over all devices plus a small one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import multiproc  # noqa: E402


def worker(directory: str, mib: int, repeats: int) -> None:
    """One process of the job: saves ``repeats`` times, restores, prints timings as JSON."""
    multiproc.init()
    import time

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxckpt
    from jaxckpt import multihost

    n = jax.process_count()
    cols = 1024
    rows = (mib << 20) // (4 * cols) // 2 * 2 * n  # mib per process, divisible by devices
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    sh = NamedSharding(mesh, P("data"))
    tree = {
        "w": jax.make_array_from_callback(
            (rows, cols), sh, lambda i: np.full((i[0].stop - i[0].start, cols), 1.0, np.float32)
        ),
        "b": jax.device_put(np.arange(1024, dtype=np.float32), NamedSharding(mesh, P())),
    }
    saves, coords, restores = [], [], []
    for r in range(repeats):
        multihost.coordination_stats(reset=True)
        t = time.perf_counter()
        jaxckpt.save(os.path.join(directory, f"s{r}"), tree)
        saves.append(time.perf_counter() - t)
        st = multihost.coordination_stats()
        coords.append(st["barrier_s"] + st["kv_s"])
        t = time.perf_counter()
        out = jaxckpt.restore(os.path.join(directory, f"s{r}"), target=tree)
        jax.block_until_ready(out)
        restores.append(time.perf_counter() - t)
    calls = int(st["barriers"] + st["kv_calls"])
    if True:  # every process reports; the parent compares them
        print(
            "RESULT",
            json.dumps(
                {"n": n, "save": saves, "coord": coords, "restore": restores, "calls": calls}
            ),
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib-per-process", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", default="1,2,4")
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.worker[0], int(a.worker[1]), int(a.worker[2]))
        return
    rows = []
    for n in (int(x) for x in a.procs.split(",")):
        with tempfile.TemporaryDirectory() as d:
            res = multiproc.run(
                os.path.abspath(__file__),
                n,
                devices_per_process=2,
                args=["--worker", d, str(a.mib_per_process), str(a.repeats)],
                timeout_s=600,
            ).check()
        per = [
            json.loads(ln.split(" ", 1)[1])
            for out in res.outputs
            for ln in out.splitlines()
            if ln.startswith("RESULT")
        ]
        row = per[0]  # rank 0 is process 0
        row["coord_min"] = min(sorted(p["coord"])[len(p["coord"]) // 2] for p in per)
        rows.append(row)
    print(
        f"{'procs':>5} {'MiB/proc':>8} {'save s':>8} {'restore s':>9} {'coord ms':>9} "
        f"{'coord %':>7} {'min coord ms':>12} {'min %':>6} {'calls':>5}"
    )
    for r in rows:
        save, coord, rest = (
            min(r["save"]),
            sorted(r["coord"])[len(r["coord"]) // 2],
            min(r["restore"]),
        )
        print(
            f"{r['n']:>5} {a.mib_per_process:>8} {save:>8.3f} {rest:>9.3f} {coord * 1e3:>9.2f} "
            f"{100 * coord / save:>7.2f} {r['coord_min'] * 1e3:>12.2f} "
            f"{100 * r['coord_min'] / save:>6.2f} {r['calls']:>5}"
        )
    print(
        "save/restore: best of repeats (process 0). coord: median time per save in barriers "
        "and key-value calls on process 0 (includes waiting for slower writers); min coord: "
        "the same on the process that waited least (the protocol's own cost). calls: "
        "coordination calls per save per process"
    )


if __name__ == "__main__":
    main()
