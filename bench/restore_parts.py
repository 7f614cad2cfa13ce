"""Where a restore's time goes: the restore, its reads alone, and a verified read of the
same checkpoint files, alternating in one process (docs/GPU.md's breakdown).

usage: python bench/restore_parts.py [--size-gb 2] [--repeats 5] [--devices N]

The state is bench/train_state.py's train state at ``--size-gb``, all of it on the first
device jax finds (a GPU where there is one; ``--devices 8`` puts it on a (4, 2) mesh of 8
virtual CPU devices instead), saved once under /tmp. Then, ``--repeats`` times in an order
that alternates, from the page cache:

* ``restore``: ``jaxckpt.restore`` onto the same sharding, ``block_until_ready``;
* ``reads only``: the same restore with ``Placement.put`` a no-op: every slice read and
  CRC-checked into host memory (onto CPU devices, its replicas' places filled as it is
  read), none put on a device;
* ``verified read, N threads``: every byte of the checkpoint's files read into fresh memory
  with a CRC32C over it (``harness.read_files``), on 8 and 16 threads and on as many as the
  host has cores.

The restored state is checked bit-exact once, before the clock; before each way the arrays
of the last restore are freed (jax hands their buffers back at its next transfer, which
would be inside the next restore). Prints the medians, GB/s of
the state's bytes, each row against the best verified read, and the CPU it cost per GB: the
process's (user + system, ``/proc/self/stat``, every thread) and the calling thread's alone
(``time.thread_time``: planning, handing reads out, putting slices on devices). Where the
process's CPU per GB over the host's cores is near the wall time per GB, the restore is
bound by the CPU, not by the reads.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import sys
import time

import harness

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--size-gb", type=float, default=2.0)
ap.add_argument("--repeats", type=int, default=5)
ap.add_argument("--devices", type=int, default=0, help="N virtual CPU devices (0: the default)")
args = ap.parse_args()
if args.devices:
    harness.cpu_devices(args.devices)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import train_state as st  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._src import placement  # noqa: E402


def main() -> None:
    if args.devices:
        mesh = st.make_mesh((4, 2) if args.devices == 8 else (args.devices, 1), args.devices)
    else:
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), st.AXES)
    state, crcs = st.build_state(args.size_gb, mesh)
    target = st.abstract_state(args.size_gb, mesh)
    nbytes = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(target))
    ckpt = f"/tmp/jaxckpt-restore-parts-{os.getpid()}"
    shutil.rmtree(ckpt, ignore_errors=True)
    jaxckpt.save(ckpt, state)
    del state
    try:
        restored = jax.block_until_ready(jaxckpt.restore(ckpt, target))
        if st.leaf_crcs(restored) != crcs:
            sys.exit(f"the state restored from {ckpt} differs from the one saved")
        del restored
        rows = _measure(ckpt, target)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    device = jax.devices()[0]
    print(f"device: {device.device_kind} ({device.platform}), {len(mesh.devices.flat)} device(s); "
          f"{os.cpu_count()} cores; state {nbytes / 1e9:.3f} GB; medians of {args.repeats}")  # fmt: skip
    best = min(
        statistics.median(w for w, _, _ in ts) for name, ts in rows.items() if "verified" in name
    )
    gb = nbytes / 1e9
    for name, ts in rows.items():
        m = statistics.median(w for w, _, _ in ts)
        cpu = statistics.median(c for _, c, _ in ts) / gb
        main_cpu = statistics.median(c for _, _, c in ts) / gb
        print(f"{name:28s} {m:7.3f} s  {gb / m:7.2f} GB/s  {best / m:5.2f}x the best verified "
              f"read  CPU {cpu:5.3f} s/GB (calling thread {main_cpu:5.3f})  "
              f"{[round(w, 3) for w, _, _ in ts]}")  # fmt: skip


def _measure(ckpt: str, target) -> dict[str, list[tuple[float, float, float]]]:
    put, array = placement.Placement.put, placement.Placement.array

    def restore(reads_only: bool):
        def run() -> tuple[float, float, float]:
            if reads_only:  # every slice read, checked and dropped; the leaves come back None
                placement.Placement.put = lambda self, *a, **kw: None
                placement.Placement.array = lambda self: None
            try:
                t, cpu, main = time.perf_counter(), harness.cpu_seconds(), time.thread_time()
                out = jaxckpt.restore(ckpt, target)
                if not reads_only:
                    jax.block_until_ready(out)
                t, main = time.perf_counter() - t, time.thread_time() - main
                cpu = harness.cpu_seconds() - cpu
            finally:
                placement.Placement.put, placement.Placement.array = put, array
            return t, cpu, main

        return run

    def verified(threads: int):
        def run() -> tuple[float, float, float]:
            kept: list = []
            t, cpu, main = time.perf_counter(), harness.cpu_seconds(), time.thread_time()
            harness.read_files(harness.files_under(ckpt), threads, harness.crc32c()[1], kept)
            t, main = time.perf_counter() - t, time.thread_time() - main
            return t, harness.cpu_seconds() - cpu, main

        return run

    ways = {"restore": restore(False), "reads only": restore(True)}
    for n in sorted({8, 16, os.cpu_count() or 1}):
        ways[f"verified read, {n} threads"] = verified(n)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in ways}
    for rep in range(args.repeats):
        for name in harness.alternate(list(ways), rep):
            # the last restore's arrays, dropped, hand their buffers back now, not inside
            # the next restore (jax does at its next transfer: the next restore's first
            # leaf unmapped the last one's 1.4 GB there, ~20 % of its calling thread)
            gc.collect()
            placement._release_dropped()
            times[name].append(ways[name]())
    return times


if __name__ == "__main__":
    main()
