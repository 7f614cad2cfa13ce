"""How fast a fresh process touches fresh memory, in transparent huge pages and in 4 KiB
pages: the cost every restore pays before its bytes land (docs/GPU.md, issue 21's notes).

usage: python bench/fresh_memory.py [--gib 1] [--repeats 3]

Each repeat runs two fresh subprocesses, alternating which goes first: one maps ``--gib``
GiB advised ``MADV_HUGEPAGE``, the other ``MADV_NOHUGEPAGE``, and each times its first
touch of every page (the kernel zeroes and maps it), then a full write of the same memory
(already mapped: the memory's own speed). On a VM that hands memory freed in huge pages
back to its host, a fresh process's huge pages can be many times slower to touch than
4 KiB pages (here: 0.16-2.3 s against 0.47-0.54 s per GiB); on a machine without that,
huge pages are the faster.
"""

from __future__ import annotations

import argparse
import json
import mmap
import subprocess
import sys
import time


def touch(gib: float, huge: bool) -> dict[str, float]:
    n = int(gib * (1 << 30))
    region = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE if huge else mmap.MADV_NOHUGEPAGE)
    import numpy as np

    a = np.frombuffer(region, np.uint8)
    t = time.perf_counter()
    a[:: mmap.PAGESIZE] = 1
    first = time.perf_counter() - t
    t = time.perf_counter()
    a[:] = 2
    return {"first touch s": first, "full write s": time.perf_counter() - t}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", choices=["huge", "small"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(touch(args.gib, args.worker == "huge")))
        return
    rows: dict[str, list[dict[str, float]]] = {"huge": [], "small": []}
    for rep in range(args.repeats):
        for kind in ("huge", "small") if rep % 2 == 0 else ("small", "huge"):
            out = subprocess.run(
                [sys.executable, __file__, "--worker", kind, "--gib", str(args.gib)],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            rows[kind].append(json.loads(out.stdout))
    print(f"{args.gib} GiB per fresh process, {args.repeats} repeats (seconds, each repeat)")
    for kind, name in (("huge", "huge pages"), ("small", "4 KiB pages")):
        for what in ("first touch s", "full write s"):
            print(f"  {name:12s} {what:14s} " + " ".join(f"{r[what]:.3f}" for r in rows[kind]))


if __name__ == "__main__":
    main()
