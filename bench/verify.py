"""``jaxckpt verify`` vs a restore of the same checkpoint: read throughput, same run.

    python bench/verify.py [--size-gb 1] [--repeats 3]

bench/compare.py's train state (~170 arrays on a (4, 2) mesh of 8 CPU devices) is saved
once; then, alternating, the restore onto the same mesh and ``verify`` (every chunk read and
CRC-checked, every chunk's existence checked) run with the checkpoint's page cache dropped
first. Target: verify >= 0.8x the restore's GB/s.
"""

from __future__ import annotations

import argparse
import os
import time

import compare  # (8 CPU devices, set before jax is imported)
import harness
import jax

import jaxckpt
from jaxckpt._src.cli.verify import verify


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    mesh = compare.make_mesh((4, 2), 8)
    with harness.scratch("jaxckpt-verify-bench-") as root:
        path = os.path.join(root, "c")
        state, _ = compare.build_state(a.size_gb, mesh)
        jaxckpt.save(path, state)
        del state
        target = compare.abstract_state(a.size_gb, mesh)
        nbytes = compare.state_bytes(a.size_gb)
        times: dict[str, list[float]] = {"restore": [], "verify": []}
        for rep in range(a.repeats):
            for op in harness.alternate(("restore", "verify"), rep):
                harness.drop_page_cache(path)
                t = time.perf_counter()
                if op == "restore":
                    jax.block_until_ready(jaxckpt.restore(path, target=target))
                else:
                    report = verify(path)
                    assert report.ok, report.problems
                times[op].append(time.perf_counter() - t)
    gbs = {op: harness.gbps(nbytes, t) for op, t in times.items()}
    print(f"state {nbytes / 1e9:.3f} GB, {a.repeats} repeats, medians, page cache dropped")
    for op, v in gbs.items():
        print(f"  {op:<8} {v:.3f} GB/s  (runs: {', '.join(f'{t:.2f}s' for t in times[op])})")
    ratio = gbs["verify"] / gbs["restore"]
    print(
        f"{harness.verdict(ratio >= 0.8)} verify >= 0.8x the restore's read throughput: {ratio:.2f}x"
    )


if __name__ == "__main__":
    main()
