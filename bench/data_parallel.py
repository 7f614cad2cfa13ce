"""A data-parallel state saved and restored by 1, 2 and 4 processes: jaxckpt vs Orbax.

Imported by ``bench/scale.py`` (its data-parallel table); also runs alone:

    python bench/data_parallel.py [--gib 1.0] [--repeats 3] [--procs 1,2,4]

The state: parameters replicated over a 'data' axis that spans the processes and sharded
over 'model' (2 devices a process), as in data-parallel training; a fully sharded leaf
(optimizer-state-like) over every device; 40 small replicated leaves. Each repeat saves
and restores with both libraries, alternating which goes first; medians are printed.
Measured from outside each library: bytes written per process (``/proc/self/io``
write_bytes) and bytes read from the files (TensorStore's file kvstore counter, which both
libraries read through; page cache of the checkpoint dropped before each restore).
Each process stands for one machine (``$JAXCKPT_HOST``), as in the multi-host jobs the
table is about; ``JAXCKPT_BENCH_HOSTS=same`` runs them as one machine instead (jaxckpt then
reads per process: see ``jaxckpt/_src/read_once.py``). Orbax runs with its defaults: replica-parallel saving on (``use_replica_parallel`` defaults
to True off GPU), load-and-broadcast off (it needs ``SingleReplicaArrayHandler``).
"""

from __future__ import annotations

import argparse
import os

import harness
from harness import drop_page_cache, io, ts_file_bytes_read

RESULTS = os.path.join(harness.RESULTS, "data_parallel.json")


def _state(gib: float):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n = jax.process_count()
    mesh = jax.make_mesh((n, jax.device_count() // n), ("data", "model"))
    total = int(gib * (1 << 30))
    cols = 4096
    rows = max(64, int(0.75 * total) // (8 * 4 * cols) // 64 * 64)  # 8 params, 75% of bytes
    flat = max(1 << 16, int(0.25 * total) // 4 // (1 << 16) * (1 << 16))

    def put(shape, spec, seed):
        sh = NamedSharding(mesh, spec)

        def cb(index):
            shp = [s.indices(d)[1] - s.indices(d)[0] for s, d in zip(index, shape, strict=False)]
            # incompressible values: Orbax compresses with zstd by default, jaxckpt does not
            rng = np.random.default_rng(
                [int(seed), *(s.indices(d)[0] for s, d in zip(index, shape, strict=False))]
            )
            return rng.random(shp, dtype=np.float32)

        return jax.make_array_from_callback(shape, sh, cb)

    tree = {
        "params": {f"w{i}": put((rows, cols), P(None, "model"), i) for i in range(8)},
        "opt": put((flat,), P(("data", "model")), 9.0),
        "small": {f"b{i}": put((256,), P(), i) for i in range(40)},
    }
    logical = sum(x.nbytes for x in jax.tree.leaves(tree))
    return tree, logical


def worker(phase: str, directory: str, gib: float, repeats: int) -> dict:
    """One process of a job that saves (``phase`` "save") or restores every checkpoint: its
    per-repeat figures. Restores run in a new job so that neither library reads from a cache
    its save filled (Orbax's TensorStore context keeps the chunks it wrote)."""
    import time

    import jax

    if os.environ.get("JAXCKPT_BENCH_HOSTS", "separate") == "separate":
        os.environ["JAXCKPT_HOST"] = f"bench-machine{jax.process_index()}"

    import orbax.checkpoint as ocp

    import jaxckpt
    from jaxckpt._src import multihost

    tree, logical = _state(gib)
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    orbax = ocp.Checkpointer(ocp.StandardCheckpointHandler())

    def save(lib, path):
        if lib == "jaxckpt":
            jaxckpt.save(path, tree)
        else:
            orbax.save(path, args=ocp.args.StandardSave(tree))

    def restore(lib, path):
        if lib == "jaxckpt":
            return jaxckpt.restore(path, target=abstract)
        return orbax.restore(path, args=ocp.args.StandardRestore(abstract))

    out: dict = {
        lib: {"save": [], "restore": [], "written": [], "read": []} for lib in ("jaxckpt", "orbax")
    }
    for r in range(repeats):
        for lib in harness.alternate(("jaxckpt", "orbax"), r):
            path = os.path.join(directory, f"{lib}-{r}")
            multihost.barrier(f"dp/{phase}/{lib}/{r}", 600)
            if phase == "save":
                io0, t = io(), time.perf_counter()
                save(lib, path)
                out[lib]["save"].append(time.perf_counter() - t)
                out[lib]["written"].append(io()["write_bytes"] - io0["write_bytes"])
                continue
            drop_page_cache(path)
            multihost.barrier(f"dp/dropped/{lib}/{r}", 600)
            ts0, t = ts_file_bytes_read(), time.perf_counter()
            jax.block_until_ready(restore(lib, path))
            out[lib]["restore"].append(time.perf_counter() - t)
            out[lib]["read"].append(ts_file_bytes_read() - ts0)
    return {"logical": logical, **out}


def table(gib: float, procs: list[int], repeats: int) -> dict[int, dict]:
    """Runs the jobs and prints the table; returns per process count the figures."""
    rows: dict[int, dict] = {}
    for n in procs:
        with harness.scratch(parent=os.environ.get("JAXCKPT_BENCH_DIR")) as d:
            phases = [
                harness.run_job(
                    __file__, n, timeout_s=1800, phase=phase, directory=d, gib=gib, repeats=repeats
                )
                for phase in ("save", "restore")
            ]
        per = []
        for saved, restored in zip(*phases, strict=True):
            for lib in ("jaxckpt", "orbax"):
                saved[lib].update(restore=restored[lib]["restore"], read=restored[lib]["read"])
            per.append(saved)
        logical = per[0]["logical"]
        row = {"logical": logical}
        for lib in ("jaxckpt", "orbax"):
            # a save or restore ends when the slowest process is done: max over processes
            save = harness.median(max(p[lib]["save"][r] for p in per) for r in range(repeats))
            rest = harness.median(max(p[lib]["restore"][r] for p in per) for r in range(repeats))
            written = [harness.median(p[lib]["written"]) for p in per]
            read = [harness.median(p[lib]["read"]) for p in per]
            row[lib] = {
                "save_gbs": logical / save / 1e9,
                "restore_gbs": logical / rest / 1e9,
                "write_balance": max(written) / (sum(written) / n),
                "read_amplification": sum(read) / logical,
            }
        rows[n] = row
    harness.Table(
        (("procs", ">5"), ("library", ">8"), ("save GB/s", ">9.3f"), ("restore GB/s", ">12.3f"))
        + (("write max/mean", ">14.2f"), ("read/logical", ">12.2f")),
        sep=" ",
    ).print((n, lib, *row[lib].values()) for n, row in rows.items() for lib in ("jaxckpt", "orbax"))
    return rows


def write_results(rows: dict[int, dict]) -> None:
    """The table as JSON, for bench/scaling_model.py's figure."""
    harness.write_json(RESULTS, {str(n): row for n, row in rows.items()})


def verdicts(rows: dict[int, dict]) -> None:
    n = max(rows)
    j, o = rows[n]["jaxckpt"], rows[n]["orbax"]
    checks = [
        (f"save at {n} processes vs Orbax", j["save_gbs"] / o["save_gbs"], ">=", 1.5),
        (f"restore at {n} processes vs Orbax", j["restore_gbs"] / o["restore_gbs"], ">=", 1.5),
        (f"write balance (max/mean) at {n} processes", j["write_balance"], "<=", 1.25),
        (f"read amplification at {n} processes", j["read_amplification"], "<=", 1.2),
    ]
    for what, value, op, target in checks:
        ok = value >= target if op == ">=" else value <= target
        print(f"{harness.verdict(ok)} {what}: {value:.2f} (target {op} {target})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--procs", default="1,2,4")
    a = ap.parse_args()
    print(f"== data-parallel state, {a.gib} GiB logical, medians of {a.repeats}")
    rows = table(a.gib, [int(x) for x in a.procs.split(",")], a.repeats)
    write_results(rows)
    verdicts(rows)


if __name__ == "__main__":
    harness.entry(main, worker)
