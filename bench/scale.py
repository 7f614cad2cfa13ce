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

os.environ["JAXCKPT_PROTOCOL_TIMING"] = "1"  # inherited by the workers


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
    saves, coords, restores, protocols = [], [], [], []
    for r in range(repeats):
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
    if True:  # every process reports; the parent compares them
        print(
            "RESULT",
            json.dumps(
                {
                    "n": n,
                    "save": saves,
                    "coord": coords,
                    "protocol": protocols,
                    "restore": restores,
                    "calls": calls,
                }
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
        row["proto"] = max(_median(p["protocol"]) for p in per)
        rows.append(row)
    print(
        f"{'procs':>5} {'MiB/proc':>8} {'save s':>8} {'restore s':>9} {'wait ms':>8} "
        f"{'wait %':>6} {'protocol ms':>11} {'protocol %':>10} {'calls':>5}"
    )
    for r in rows:
        save, wait, rest = min(r["save"]), _median(r["coord"]), min(r["restore"])
        print(
            f"{r['n']:>5} {a.mib_per_process:>8} {save:>8.3f} {rest:>9.3f} {wait * 1e3:>8.2f} "
            f"{100 * wait / save:>6.2f} {r['proto'] * 1e3:>11.2f} "
            f"{100 * r['proto'] / save:>10.2f} {r['calls']:>5}"
        )
    print(
        "save/restore: best of repeats (process 0). wait: median time per save process 0 spent "
        "in coordination calls, including waiting for slower writers and for process 0's own "
        "merge/commit. protocol: the coordination's own latency per save (barrier release minus "
        "the last arrival, plus key-value calls), median over "
        "repeats, worst process. calls: coordination calls per save per process"
    )
    last = rows[-1]
    share = 100 * last["proto"] / min(last["save"])
    verdict = "PASS" if share < 5 else "FAIL"
    print(f"{verdict} protocol time at {last['n']} processes: {share:.2f}% of save (target < 5%)")
    multi = [r for r in rows if r["n"] > 1]
    if len(multi) > 1:
        first, last = multi[0], multi[-1]
        growth = last["proto"] / max(first["proto"], 1e-9)
        allowed = last["n"] / first["n"]
        print(
            f"{'PASS' if growth <= allowed else 'FAIL'} protocol time grows {growth:.2f}x from "
            f"{first['n']} to {last['n']} processes (target: at most linear, {allowed:.1f}x)"
        )


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


if __name__ == "__main__":
    main()
