"""A restore of many small leaves onto 8 devices, whose cost is per slice and per leaf, not
per byte: the ways a restore goes, against another source tree's in the same run.

usage: python bench/small_leaves.py [--leaves 2000] [--repeats 5] [--baseline-tree DIR]

The state: ``--leaves`` float32 arrays of 64 x 64 on a (4, 2) mesh of 8 CPU devices, in
turn split on both axes, on the columns (replicated over "data"), replicated everywhere and
split on the rows (replicated over "model"), saved once and restored onto the same
shardings: with mappings (the default on CPU devices), without (``JAXCKPT_MAP=0``), and as
onto an accelerator (``JAXCKPT_ADOPT=0``: each slice read into the host ring, put on its
first device, its replicas copied device to device). Each operation runs in a fresh
process after the same preamble (a warm-up restore of the state, its files in the page
cache), the order rotating from repeat to repeat; each restore is checked bit-exact after
the clock stops. Prints the median seconds and the microseconds per device slice.
"""

from __future__ import annotations

import argparse
import gc
import os
import zlib

import harness

harness.cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

SPECS = (P("data", "model"), P(None, "model"), P(), P("data"))
GPU_ENV = {"JAXCKPT_MAP": "0", "JAXCKPT_ADOPT": "0"}


def _target(leaves: int) -> dict:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    return {
        f"l{i:05d}": jax.ShapeDtypeStruct(
            (64, 64), np.float32, sharding=NamedSharding(mesh, SPECS[i % len(SPECS)])
        )
        for i in range(leaves)
    }


def _crc(tree: dict) -> int:
    return zlib.crc32(b"".join(np.asarray(tree[k]).tobytes() for k in sorted(tree)))


def worker(op: str, path: str, leaves: int) -> dict:
    import jaxckpt

    target = _target(leaves)
    if op == "save":
        rng = np.random.default_rng(0)
        state = {
            k: jax.device_put(rng.standard_normal((64, 64), np.float32), t.sharding)
            for k, t in target.items()
        }
        jaxckpt.save(path, state)
        return {
            "crc": _crc(state),
            "slices": sum(len(v.addressable_shards) for v in state.values()),
        }
    jax.block_until_ready(jaxckpt.restore(path, target))  # (one-time costs, off the clock)
    harness.warm_page_cache(path)
    gc.collect()
    with harness.Clock() as clock:
        out = jax.block_until_ready(jaxckpt.restore(path, target))
    return {**clock.record(), "crc": _crc(out)}


def run(args) -> None:
    ops: dict[str, dict[str, str]] = {
        "restore mapped": {},
        "restore MAP=0": {"JAXCKPT_MAP": "0"},
        "restore as on a GPU": GPU_ENV,
    }
    if args.baseline_tree:
        base = {"PYTHONPATH": os.path.abspath(args.baseline_tree)}
        ops.update({f"baseline: {k}": {**base, **env} for k, env in list(ops.items())})
    res: dict[str, list[float]] = {k: [] for k in ops}
    bad: list[str] = []
    with harness.scratch() as workdir:
        common = {"path": os.path.join(workdir, "ckpt"), "leaves": args.leaves}
        harness.log(f"save {args.leaves} leaves")
        saved = harness.run_worker(__file__, op="save", **common)
        for rep in range(args.repeats):
            for label in harness.rotated(list(ops), rep):
                harness.log(f"repeat {rep + 1}/{args.repeats}: {label}")
                got = harness.run_worker(__file__, env=ops[label], op="restore", **common)
                res[label].append(got["seconds"])
                if got["crc"] != saved["crc"]:
                    bad.append(f"{label} repeat {rep + 1}")
    slices = saved["slices"]
    print(
        f"\n{args.leaves} leaves of 64x64 float32 on a (4, 2) mesh ({slices} device slices); "
        f"{args.repeats} repeats, each a fresh process, medians; {os.cpu_count()} cores\n"
    )
    table = harness.Table((("operation", "<32"), ("seconds", ">9.3f"), ("us a slice", ">11.1f")))
    med = {k: harness.median(v) for k, v in res.items()}
    table.print([(k, med[k], med[k] / slices * 1e6) for k in res], rule=True)
    if args.baseline_tree:
        print()
        for k in [k for k in res if f"baseline: {k}" in res]:
            print(f"  {k} / baseline: this tree {med[f'baseline: {k}'] / med[k]:5.2f}x as fast")
    print("every restore bit-exact" if not bad else f"NOT BIT-EXACT: {bad}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--leaves", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-tree", help="another jaxckpt source tree, first on PYTHONPATH")
    run(p.parse_args())


if __name__ == "__main__":
    harness.entry(main, worker)
