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
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# This file's name would shadow the safetensors package: take bench/ off the path and load
# bench/compare.py (which sets 8 CPU devices before jax is imported) by its file name.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.getcwd()) != HERE]
_spec = importlib.util.spec_from_file_location("compare", os.path.join(HERE, "compare.py"))
compare = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare)

import jax  # noqa: E402
import numpy as np  # noqa: E402

TAG = "RESULT "


def _flat(tree) -> dict:
    """Leaves by the tensor names ``jaxckpt.safetensors`` gives them (keys joined by ".")."""
    return {
        ".".join(str(k.key) for k in path): x
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def worker(op: str, path: str, size_gb: float) -> dict:
    import jaxckpt

    mesh = compare.make_mesh((4, 2), 8)
    if op.startswith("save"):
        state, _ = compare.build_state(size_gb, mesh)
        jax.block_until_ready(state)
        with compare.PeakRss() as rss:
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
    compare.drop_page_cache(path)
    with compare.PeakRss() as rss:
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


def run(op: str, path: str, size_gb: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", op, path, str(size_gb)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(TAG)]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise RuntimeError(f"{op} failed")
    return json.loads(lines[-1][len(TAG) :])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(TAG + json.dumps(worker(a.worker[0], a.worker[1], float(a.worker[2]))), flush=True)
        return
    nbytes = compare.state_bytes(a.size_gb)
    res: dict[str, list] = {}
    root = tempfile.mkdtemp(prefix="jaxckpt-st-bench-", dir="/tmp")
    try:
        for rep in range(a.repeats):
            libs = ("jaxckpt", "reference") if rep % 2 == 0 else ("reference", "jaxckpt")
            for lib in libs:
                path = os.path.join(root, f"{lib}-{rep}")
                res.setdefault(f"save-{lib}", []).append(run(f"save-{lib}", path, a.size_gb))
            for lib in libs:  # both load the file jaxckpt wrote (the same bytes either way)
                path = os.path.join(root, f"jaxckpt-{rep}")
                res.setdefault(f"load-{lib}", []).append(run(f"load-{lib}", path, a.size_gb))
            for lib in libs:
                shutil.rmtree(os.path.join(root, f"{lib}-{rep}"), ignore_errors=True)
            print(f"repeat {rep + 1}/{a.repeats} done", file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nstate {nbytes / 1e9:.3f} GB logical, {a.repeats} repeats, medians; peak RSS: worst")
    print(f"{'operation':<10}{'library':<11}{'GB/s':>8}{'peak RSS+ GB':>14}{'over result GB':>16}")
    rows = {}
    for key, runs_ in res.items():
        op, lib = key.split("-", 1)
        gbs = nbytes / 1e9 / statistics.median(r["seconds"] for r in runs_)
        peak = max(r["rss_over"] for r in runs_) / 1e9
        over = max(r["rss_over"] - r["result"] for r in runs_) / 1e9
        rows[key] = (gbs, peak, over)
        print(f"{op:<10}{lib:<11}{gbs:>8.3f}{peak:>14.3f}{over:>16.3f}")
    print("\ntargets")
    for op in ("load", "save"):
        ratio = rows[f"{op}-jaxckpt"][0] / rows[f"{op}-reference"][0]
        print(f"  {'PASS' if ratio >= 1.5 else 'FAIL'} {op} >= 1.5x the reference: {ratio:.2f}x")
        over = rows[f"{op}-jaxckpt"][2]
        print(
            f"  {'PASS' if over <= 0.3 else 'FAIL'} {op} peak RSS over the result <= 0.3 GB: {over:.3f} GB"
        )


if __name__ == "__main__":
    main()
