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
  with a CRC32C over it (``harness.read_files``), on 8 and 16 threads.

The restored state is checked bit-exact once, before the clock. Prints the medians, GB/s of
the state's bytes, and each row against the best verified read.
"""

from __future__ import annotations

import argparse
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
    best = min(statistics.median(ts) for name, ts in rows.items() if name.startswith("verified"))
    for name, ts in rows.items():
        m = statistics.median(ts)
        print(f"{name:28s} {m:7.3f} s  {nbytes / m / 1e9:7.2f} GB/s  {best / m:5.2f}x the best "
              f"verified read   {[round(t, 3) for t in ts]}")  # fmt: skip


def _measure(ckpt: str, target) -> dict[str, list[float]]:
    put, array = placement.Placement.put, placement.Placement.array

    def restore(reads_only: bool):
        def run() -> float:
            if reads_only:  # every slice read, checked and dropped; the leaves come back None
                placement.Placement.put = lambda self, index, data, **kw: None
                placement.Placement.array = lambda self: None
            try:
                t = time.perf_counter()
                out = jaxckpt.restore(ckpt, target)
                if not reads_only:
                    jax.block_until_ready(out)
                t = time.perf_counter() - t
            finally:
                placement.Placement.put, placement.Placement.array = put, array
            return t

        return run

    def verified(threads: int):
        def run() -> float:
            kept: list = []
            t = time.perf_counter()
            harness.read_files(harness.files_under(ckpt), threads, harness.crc32c()[1], kept)
            return time.perf_counter() - t

        return run

    ways = {
        "restore": restore(False),
        "reads only": restore(True),
        "verified read, 8 threads": verified(8),
        "verified read, 16 threads": verified(16),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.repeats):
        for name in harness.alternate(list(ways), rep):
            times[name].append(ways[name]())
    return times


if __name__ == "__main__":
    main()
