"""A restore onto another mesh of chunks whose rows are wider than a read piece: stacked
weights (a layer, an expert a chunk) read in parts, against the raw and verified reads of
the same files and, with ``--baseline-tree``, another source tree's restore, in the same run.

usage: python bench/wide_rows.py [--size-gb 1] [--repeats 5] [--baseline-tree DIR]
                                [--page-reporting off]

The state: four float32 leaves of shape (8, 2048, W) (W sized to ``--size-gb``), saved from
8 CPU devices on their first axis, so that each chunk is one row of 8 W KiB; restored onto a
(2, 4) mesh that splits the last axis in four, so that every chunk is read in part
(``io/scatter.py``): without mappings (``JAXCKPT_MAP=0``), with them (the default on CPU
devices: parts are read the same way), and as onto an accelerator (``JAXCKPT_ADOPT=0``:
each slice read into the host ring, then copied onto its device). Each operation runs in a
fresh process after the same preamble, the order rotating from repeat to repeat. For each
restore, after the clock stops: bit-exact (CRC32 per leaf); its peak host memory, the
kernel's high-water mark (``VmHWM``) over the process's RSS before it, less the restored
state's bytes (the memory the restore needs beyond its result; the host ring, made by the
warm-up restore and kept by the process, is not in it); the bytes it read
(``rchar``, ``/proc/self/io``) over the checkpoint files' (``files read``: above 1, chunks
read more than once).
"""

from __future__ import annotations

import argparse
import gc
import os
import zlib

import harness
from harness import GB

harness.cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from compare import Jaxckpt, warm_up  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

LEAVES, EXPERTS, ROWS = 4, 8, 2048
GPU_ENV = {"JAXCKPT_MAP": "0", "JAXCKPT_ADOPT": "0"}  # each slice copied onto its device


def _shape(size_gb: float) -> tuple[int, int, int]:
    width = max(256, round(size_gb * GB / (LEAVES * EXPERTS * ROWS * 4) / 256) * 256)
    return (EXPERTS, ROWS, width)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":"))


def worker(op: str, path: str, workdir: str, size_gb: float, verified: bool = False) -> dict:
    import jaxckpt
    from jaxckpt._src.io.direct import reader_threads

    shape, devices = _shape(size_gb), np.array(jax.devices())
    if op == "save":
        on = NamedSharding(Mesh(devices, ("e",)), P("e", None, None))
        rng = np.random.default_rng(0)
        state = {
            f"w{i}": jax.device_put(rng.standard_normal(shape, np.float32), on)
            for i in range(LEAVES)
        }
        jaxckpt.save(path, state)
        return {"crcs": {k: zlib.crc32(np.asarray(v).tobytes()) for k, v in state.items()}}
    mesh = Mesh(devices.reshape(2, 4), ("e", "m"))
    warm_up(Jaxckpt(), Mesh(devices.reshape(4, 2), ("data", "model")), workdir)
    harness.warm_page_cache(path)
    gc.collect()
    if op == "read":
        kept: list = []
        crc = harness.crc32c()[1] if verified else None
        with harness.Clock() as clock:
            harness.read_files(harness.files_under(path), reader_threads(), crc, kept)
        del kept
        return clock.record()
    on = NamedSharding(mesh, P("e", None, "m"))
    target = {f"w{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=on) for i in range(LEAVES)}
    with open("/proc/self/clear_refs", "w") as f:  # the high-water mark from here
        f.write("5")
    before, read = _rss_kib("VmRSS"), harness.io()["rchar"]
    with harness.Clock() as clock:
        out = jax.block_until_ready(jaxckpt.restore(path, target))
    read = harness.io()["rchar"] - read
    beyond = (_rss_kib("VmHWM") - before) * 1024 - LEAVES * int(np.prod(shape)) * 4
    crcs = {k: zlib.crc32(np.asarray(v).tobytes()) for k, v in out.items()}
    files = sum(os.path.getsize(p) for p in harness.files_under(path))
    return {**clock.record(), "crcs": crcs, "beyond": beyond, "read": read / files}


def run(args) -> None:
    shape = _shape(args.size_gb)
    nbytes = LEAVES * int(np.prod(shape)) * 4
    map0 = {"JAXCKPT_MAP": "0"}
    ops: dict[str, tuple[str, dict[str, str], dict]] = {  # label: (op, env, kwargs)
        "restore MAP=0 (2,4)": ("restore", map0, {}),
        "restore mapped (2,4)": ("restore", {}, {}),
        "restore as on a GPU (2,4)": ("restore", GPU_ENV, {}),
        "raw read": ("read", {}, {"verified": False}),
        "verified read": ("read", {}, {"verified": True}),
    }
    if args.baseline_tree:
        base = {"PYTHONPATH": os.path.abspath(args.baseline_tree)}
        ops["baseline: restore MAP=0 (2,4)"] = ("restore", {**base, **map0}, {})
        ops["baseline: restore mapped (2,4)"] = ("restore", base, {})
        ops["baseline: restore as on a GPU (2,4)"] = ("restore", {**base, **GPU_ENV}, {})
    res: dict[str, list[dict]] = {k: [] for k in ops}
    bad: list[str] = []
    with harness.scratch() as workdir:
        path = os.path.join(workdir, "ckpt")
        common = {"path": path, "workdir": workdir, "size_gb": args.size_gb}
        harness.log(f"save {LEAVES} x {shape} float32")
        saved = harness.run_worker(__file__, op="save", **common)
        for rep in range(args.repeats):
            for label in harness.rotated(list(ops), rep):
                op, env, kw = ops[label]
                harness.log(f"repeat {rep + 1}/{args.repeats}: {label}")
                got = harness.run_worker(__file__, env=env, op=op, **common, **kw)
                res[label].append(got)
                if op == "restore" and got["crcs"] != saved["crcs"]:
                    bad.append(f"{label} repeat {rep + 1}")
    report(args, res, nbytes, shape, bad)


def report(args, res: dict[str, list[dict]], nbytes: int, shape: tuple, bad: list[str]) -> None:
    speed = {k: harness.gbps(nbytes, [r["seconds"] for r in v]) for k, v in res.items()}
    cpu = {k: harness.median(r["cpu"] for r in v) / (nbytes / GB) for k, v in res.items()}
    print(
        f"\nstate: {LEAVES} leaves of {shape} float32 ({nbytes / GB:.3f} GB), a chunk one row "
        f"of {shape[2] * 4 * ROWS >> 20} MiB, restored onto (2, 4) in quarters of its columns; "
        f"{args.repeats} repeats, each operation a fresh process, medians; {os.cpu_count()} "
        f"cores; the VM's free page reporting {args.page_reporting}\n"
    )
    table = harness.Table((("operation", "<38"), ("GB/s", ">8.3f"), ("CPU s/GB", ">9.3f"),
                           ("MiB beyond result", ">18.0f"), ("files read", ">11.2f")))  # fmt: skip
    rows = []
    for k in res:
        beyond = [r["beyond"] / 2**20 for r in res[k] if "beyond" in r]
        read = [r["read"] for r in res[k] if "read" in r]
        rows.append(
            (k, speed[k], cpu[k], *(harness.median(v) if v else None for v in (beyond, read)))
        )
    table.print(rows, rule=True)
    print()
    pairs = [("restore MAP=0 (2,4)", "raw read"), ("restore MAP=0 (2,4)", "verified read"),
             ("restore mapped (2,4)", "verified read")]  # fmt: skip
    if args.baseline_tree:
        pairs += [(k, f"baseline: {k}") for k in res if f"baseline: {k}" in res]
    for a, b in pairs:
        print(f"  {a} / {b:<44} {speed[a] / speed[b]:5.2f}x")
    print("every restore bit-exact (CRC32 per leaf)" if not bad else f"NOT BIT-EXACT: {bad}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--baseline-tree", help="another jaxckpt source tree, first on PYTHONPATH")
    p.add_argument("--page-reporting", choices=("on", "off"), default="on")
    args = p.parse_args()
    with harness.page_reporting(args.page_reporting != "off"):
        run(args)


if __name__ == "__main__":
    harness.entry(main, worker)
