"""What the leaf fingerprints (format 1.10) cost a save.

usage: python bench/fingerprint.py [--size-gb 0.25] [--repeats 4] [--mib 64]

1. One thread's fingerprint throughput (``jaxckpt._src.io.fingerprint.of_array``) for
   bfloat16, float32, float64 and int8 against the CRC32C of the same bytes, which the writer
   computes anyway (both GB/s of the array's bytes, and the ratio).
2. ``jaxckpt.save`` of the bench train state (bench/train_state.py, 8 CPU devices, (4, 2)
   mesh) with fingerprints and with the fingerprint sums replaced by a no-op, alternating,
   each save into a fresh directory: GB/s and CPU seconds per GB of each, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import harness

harness.cpu_devices(8)

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import train_state  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._src.io import fingerprint  # noqa: E402


def throughput(mib: int, repeats: int) -> list[tuple[str, float, float]]:
    """(dtype, fingerprint GB/s, CRC32C GB/s) of ``mib`` MiB arrays, best of ``repeats``."""
    name, crc = harness.crc32c()
    rng = np.random.default_rng(0)
    out = []
    for dtype in [ml_dtypes.bfloat16, np.float32, np.float64, np.int8]:
        raw = rng.integers(0, 256, mib << 20, dtype=np.uint8)
        a = raw.view(dtype).reshape(1024, -1)
        fp_s, crc_s = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            fingerprint.of_array(a)
            fp_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            crc(raw)
            crc_s.append(time.perf_counter() - t)
        out.append((np.dtype(dtype).name, a.nbytes / 1e9 / min(fp_s), a.nbytes / 1e9 / min(crc_s)))
    return out


def saves(size_gb: float, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(seconds, CPU seconds) of each save, with and without fingerprints."""
    mesh = train_state.make_mesh((4, 2), 8)
    state, _ = train_state.build_state(size_gb, mesh)
    jax.block_until_ready(state)
    real_add = fingerprint.Sums.add
    times: dict[str, list[tuple[float, float]]] = {"with": [], "without": []}
    with harness.scratch() as root:
        for rep in range(repeats):
            for mode in harness.alternate(["with", "without"], rep):
                fingerprint.Sums.add = real_add if mode == "with" else (lambda *a, **k: None)  # type: ignore[method-assign]
                path = os.path.join(root, f"{mode}-{rep}")
                with harness.Clock() as c:
                    jaxckpt.save(path, state)
                times[mode].append((c.seconds, c.cpu))
    fingerprint.Sums.add = real_add  # type: ignore[method-assign]
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-gb", type=float, default=0.25)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--mib", type=int, default=64)
    args = p.parse_args()
    print(f"1. one thread, {args.mib} MiB arrays, best of {args.repeats} (GB/s of the bytes)")
    print(f"{'dtype':<10} {'fingerprint':>12} {harness.crc32c()[0]:>16} {'ratio':>7}")
    for dtype, f, c in throughput(args.mib, args.repeats):
        print(f"{dtype:<10} {f:>12.2f} {c:>16.2f} {f / c:>7.2f}")
    nbytes = train_state.state_bytes(args.size_gb)
    times = saves(args.size_gb, args.repeats)
    print(
        f"\n2. jaxckpt.save of the bench state, {nbytes / 1e9:.2f} GB, {args.repeats} each, medians"
    )
    print(f"{'':<22} {'GB/s':>7} {'CPU s/GB':>9}")
    rows = {}
    for mode, runs in times.items():
        gbps = harness.gbps(nbytes, [s for s, _ in runs])
        cpu = statistics.median(c for _, c in runs) / (nbytes / 1e9)
        rows[mode] = (gbps, cpu)
        print(f"{mode + ' fingerprints':<22} {gbps:>7.3f} {cpu:>9.3f}")
    ratio = rows["with"][0] / rows["without"][0]
    print(f"save with / without fingerprints: {ratio:.2f}x the speed, "
          f"{rows['with'][1] / rows['without'][1]:.2f}x the CPU")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
