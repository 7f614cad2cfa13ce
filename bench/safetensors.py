"""jaxckpt.safetensors vs the obvious alternative: load/save GB/s and peak host memory.

    python bench/safetensors.py [--size-gb 1] [--repeats 3]

The state is bench/compare.py's train state (~170 float32/int32 arrays, mixed
PartitionSpecs on a (4, 2) mesh of 8 CPU devices). In the same run, alternating:

* load: ``jaxckpt.safetensors.load`` onto the sharded target vs
  ``safetensors.numpy.load_file`` + ``jax.device_put`` of each tensor onto its sharding
  (page cache of the files dropped first);
* save: ``jaxckpt.safetensors.save`` vs gathering every leaf to the host
  (``jax.device_get``) + ``safetensors.numpy.save_file`` (5 GB files, as HF does).

Every timed operation runs in a fresh subprocess that reports its time and its peak RSS over
its baseline; for loads, over the result too (on CPU devices the result is host memory,
every replica counted). GB means 1e9 bytes of logical state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import compare  # (8 CPU devices, set before jax is imported)
import harness
import jax
import numpy as np

# This file's name would shadow the safetensors package: bench/ leaves the path now that
# compare and harness are imported.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != harness.HERE]


def _flat(tree) -> dict:
    """Leaves by the tensor names ``jaxckpt.safetensors`` gives them (keys joined by ".")."""
    return {
        ".".join(str(k.key) for k in path): x
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def worker(op: str, path: str, size_gb: float) -> dict:
    """One timed save or load (``op``: save-jaxckpt, load-reference, ...) at ``path``."""
    import jaxckpt

    mesh = compare.make_mesh((4, 2), 8)
    if op.startswith("save"):
        state, _ = compare.build_state(size_gb, mesh)
        jax.block_until_ready(state)
        with harness.PeakRss() as rss:
            t = time.perf_counter()
            if op == "save-jaxckpt":
                jaxckpt.safetensors.save(path, state)
            else:
                from safetensors.numpy import save_file

                host = {k: np.asarray(jax.device_get(v)) for k, v in _flat(state).items()}
                os.makedirs(path)
                save_file(host, os.path.join(path, "model.safetensors"))
                fd = os.open(os.path.join(path, "model.safetensors"), os.O_RDONLY)
                os.fsync(fd)  # jaxckpt's save is durable too
                os.close(fd)
            seconds = time.perf_counter() - t
        return {"seconds": seconds, "rss_over": rss.over, "result": 0}
    target = compare.abstract_state(size_gb, mesh)
    harness.drop_page_cache(path)
    with harness.PeakRss() as rss:
        t = time.perf_counter()
        if op == "load-jaxckpt":
            out = jaxckpt.safetensors.load(path, target)
        else:
            from safetensors.numpy import load_file

            host = load_file(os.path.join(path, "model.safetensors"))
            out = {k: jax.device_put(host[k], s.sharding) for k, s in _flat(target).items()}
            del host
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t
    result = compare.device_bytes(out)
    want = {k: v for k, v in _flat(out).items()}
    assert set(want) == set(_flat(target))
    return {"seconds": seconds, "rss_over": rss.over, "result": result}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    nbytes = compare.state_bytes(a.size_gb)
    res: dict[str, list] = {}
    with harness.scratch("jaxckpt-st-bench-") as root:
        for rep in range(a.repeats):
            libs = harness.alternate(("jaxckpt", "reference"), rep)
            for op in ("save", "load"):
                for lib in libs:  # loads both read the file jaxckpt wrote (the same bytes)
                    path = os.path.join(root, f"{'jaxckpt' if op == 'load' else lib}-{rep}")
                    got = harness.run_worker(
                        __file__, op=f"{op}-{lib}", path=path, size_gb=a.size_gb
                    )
                    res.setdefault(f"{op}-{lib}", []).append(got)
            for lib in libs:
                shutil.rmtree(os.path.join(root, f"{lib}-{rep}"), ignore_errors=True)
            harness.log(f"repeat {rep + 1}/{a.repeats} done")
    print(f"\nstate {nbytes / 1e9:.3f} GB logical, {a.repeats} repeats, medians; peak RSS: worst")
    table = harness.Table(
        (("operation", "<10"), ("library", "<11"), ("GB/s", ">8.3f"))
        + (("peak RSS+ GB", ">14.3f"), ("over result GB", ">16.3f"))
    )
    print(table.head())
    rows = {}
    for key, runs_ in res.items():
        gbs = harness.gbps(nbytes, (r["seconds"] for r in runs_))
        peak = max(r["rss_over"] for r in runs_) / 1e9
        over = max(r["rss_over"] - r["result"] for r in runs_) / 1e9
        rows[key] = (gbs, peak, over)
        print(table.row(*key.split("-", 1), *rows[key]))
    print("\ntargets")
    for op in ("load", "save"):
        ratio = rows[f"{op}-jaxckpt"][0] / rows[f"{op}-reference"][0]
        print(f"  {harness.verdict(ratio >= 1.5)} {op} >= 1.5x the reference: {ratio:.2f}x")
        over = rows[f"{op}-jaxckpt"][2]
        print(
            f"  {harness.verdict(over <= 0.3)} {op} peak RSS over the result <= 0.3 GB: {over:.3f} GB"
        )


if __name__ == "__main__":
    harness.entry(main, worker)
