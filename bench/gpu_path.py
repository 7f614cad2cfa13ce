"""The path a GPU restore takes, measured on CPU devices: no file mappings (``JAXCKPT_MAP=0``),
every byte read into host memory and checked, against the raw and verified reads of the same
files into fresh memory, in the same run.

usage: python bench/gpu_path.py [--size-gb 1] [--repeats 3] [--baseline-tree DIR]
                               [--page-reporting off]

The state is bench/compare.py's (a train state of ~170 float32 arrays saved from a (4, 2)
mesh of 8 CPU devices). Every timed operation runs in a fresh process with the same preamble
(devices, a tiny save + restore, the target, the checkpoint's files read into the page
cache, a garbage collection), the order rotating from repeat to repeat:

* ``restore MAP=0`` onto the saved (4, 2) mesh and onto (2, 4): CPU devices adopt the host
  buffers the slices are read into (no copy after the read);
* ``restore as on a GPU`` (``JAXCKPT_MAP=0 JAXCKPT_ADOPT=0``): each slice read into the host
  ring (``jaxckpt/_src/ring.py``) and copied onto its device from there, as onto an
  accelerator (here the copy is a memcpy into fresh memory the CPU device adopts);
* ``engine reads``: the restore's reads alone (``io.slices.read`` of every slice the (4, 2)
  restore reads, through the ring, each slot given back as it arrives: no placement), and the
  same into fresh memory (``JAXCKPT_RING=0``);
* ``restore MAP=0 (4,2), reads alone``: that restore's reads and nothing else (its requests
  made before the clock starts, no leaf adopted after: ``restore_reads``), what a restore
  with no Python of its own before or after its reads would take;
* the references: every byte of the checkpoint's data files read into fresh memory, plainly
  (``raw``) and with a CRC32C (``verified``), on the reader threads' count
  (``direct.reader_threads``), and the raw read plus as many bytes again copied into fresh
  memory as the restored replicas hold on each mesh (``raw + replicas``: onto CPU devices
  every replica is host memory a restore must fill, so it is the least a restore does), and
  the same with each block's CRC32C (``verified + replicas``: the least a restore that
  checks every chunk does; ``ceiling``: its ratio to the raw read + replicas, above which
  no restore that checks every chunk's CRC32C gets on this host);
* ``--baseline-tree DIR``: the default restore (mappings on) with another source tree of
  jaxckpt first on ``PYTHONPATH`` too, against this tree's: a slowdown shows as a ratio.

On this VM the kernel reports free memory to the hypervisor, which takes it back: fresh
memory a process fills then costs a host fault per page, seen as the kernel zeroing pages
(``clear_page_rep``: two thirds of a 1 GB restore's CPU time under ``perf``), and what a
process pays for it depends on what ran before it. ``--page-reporting off`` (root) gives
the figures of a host whose memory stays backed.

GB/s are of the state's logical bytes, medians over repeats; every restore is checked
bit-exact (CRC32 per leaf) against the saved state after the clock stops.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import os

import harness
from harness import GB

harness.cpu_devices(8)

import jax  # noqa: E402
from compare import Jaxckpt, warm_up  # noqa: E402
from train_state import (  # noqa: E402
    abstract_state,
    build_state,
    device_bytes,
    leaf_crcs,
    make_mesh,
    state_bytes,
)

SAME, OTHER = (4, 2), (2, 4)
GPU_ENV = {"JAXCKPT_MAP": "0", "JAXCKPT_ADOPT": "0"}


def _preamble(path: str, workdir: str, size_gb: float, mesh_shape: list[int]) -> dict:
    """The restore worker's conditions: devices, a tiny save + restore, the target, the
    checkpoint's files in the page cache, a garbage collection."""
    mesh = make_mesh((mesh_shape[0], mesh_shape[1]), 8)
    warm_up(Jaxckpt(), mesh, workdir)
    target = abstract_state(size_gb, mesh)
    harness.warm_page_cache(path)
    gc.collect()
    return target


def worker(
    op: str,
    path: str,
    workdir: str,
    size_gb: float,
    mesh: list[int] = list(SAME),  # noqa: B006 (read only)
    verified: bool = False,
    share: float = 0.0,
) -> dict:
    import jaxckpt
    from jaxckpt._src.io.direct import reader_threads

    if op == "save":
        state, crcs = build_state(size_gb, make_mesh(SAME, 8))
        jaxckpt.save(path, state)
        return {"crcs": crcs}
    target = _preamble(path, workdir, size_gb, mesh)
    if op == "restore":
        with harness.Clock() as clock:
            out = jax.block_until_ready(jaxckpt.restore(path, target))
        return {**clock.record(), "crcs": leaf_crcs(out), "device_bytes": device_bytes(target)}
    if op == "engine":
        return engine_reads(path, target)
    if op == "restore reads":
        return restore_reads(path, target)
    if op == "read":
        paths = harness.files_under(path)
        crc = harness.crc32c()[1] if verified else None
        kept: list = []
        with harness.Clock() as clock:
            copies = [share] * len(paths) if share else ()
            harness.read_files(paths, reader_threads(), crc, kept, copies)
        del kept
        return clock.record()
    raise ValueError(op)


def engine_reads(path: str, target: dict) -> dict:
    """Every slice a restore onto ``target``'s shardings reads, through the engine's one
    door (``slices.read``) and the ring, each given back as it arrives: the reads alone."""
    from jaxckpt._src import gc_pause, placement, ring
    from jaxckpt._src.io import arrays, direct, slices
    from jaxckpt._src.io.inflight import default_budget
    from jaxckpt._src.leaf_plan import wants
    from jaxckpt._src.readers import any_manifest
    from jaxckpt._src.storage import location

    loc = location(path)
    _, manifest = any_manifest(loc)
    planned = wants(manifest.leaves, manifest.meshes, target, None, loc)
    db = arrays.database_dir(loc, None)
    opener = functools.partial(arrays.open_leaf, db, ctx=arrays.new_context())
    budget = default_budget(direct.reader_threads())
    devices = [d for w in planned if w.sharding is not None for d in w.sharding.device_set]
    # (the collector paused as a restore pauses it: ``gc_pause``)
    with harness.Clock() as clock, gc_pause.paused(), ring.for_restore(budget, devices) as host:

        def done(data, copies) -> None:
            if host is not None:
                host.give_back(data, [])

        requests = [
            slices.Request(w.record, index, done, stage=host.take if host else None)
            for w in planned
            if w.sharding is not None and w.record.nbytes
            for index in placement._slices(w.sharding, tuple(w.record.shape))[0]
        ]
        n = slices.read(db, requests, opener, budget=budget)
    return {**clock.record(), "bytes": n, "ring": host is not None}


def restore_reads(path: str, target: dict) -> dict:
    """A ``JAXCKPT_MAP=0`` restore's reads alone: its requests as it makes them (each slice
    into its leaf's fresh buffer, its replicas filled as it is read), made before the clock
    starts; the clock runs for ``slices.read`` only (nothing before it, no leaf adopted
    after): what the restore would take with no Python of its own before or after."""
    from jaxckpt._src import gc_pause, restoring
    from jaxckpt._src.io import arrays, direct, slices
    from jaxckpt._src.io.inflight import default_budget
    from jaxckpt._src.leaf_plan import wants
    from jaxckpt._src.readers import any_manifest
    from jaxckpt._src.storage import location

    loc = location(path)
    _, manifest = any_manifest(loc)
    planned = wants(manifest.leaves, manifest.meshes, target, None, loc)
    db = arrays.database_dir(loc, None)
    opener = functools.partial(arrays.open_leaf, db, ctx=arrays.new_context())
    requests: list[slices.Request] = []
    leaves = [restoring._plan_leaf(w, requests, None) for w in planned]
    budget = default_budget(direct.reader_threads())
    with gc_pause.paused(), harness.Clock() as clock:
        n = slices.read(db, requests, opener, budget=budget)
    del leaves
    return {**clock.record(), "bytes": n}


def run(args) -> None:
    nbytes = state_bytes(args.size_gb)
    ops: dict[str, tuple[str, dict[str, str], dict]] = {  # label: (op, env, kwargs)
        "restore MAP=0 (4,2)": ("restore", {"JAXCKPT_MAP": "0"}, {"mesh": SAME}),
        "restore MAP=0 (2,4)": ("restore", {"JAXCKPT_MAP": "0"}, {"mesh": OTHER}),
        "restore as on a GPU (4,2)": ("restore", GPU_ENV, {"mesh": SAME}),
        "restore as on a GPU (2,4)": ("restore", GPU_ENV, {"mesh": OTHER}),
        "engine reads, ring": ("engine", GPU_ENV, {"mesh": SAME}),
        "engine reads, fresh memory": ("engine", {**GPU_ENV, "JAXCKPT_RING": "0"}, {"mesh": SAME}),
        "restore MAP=0 (4,2), reads alone": ("restore reads", {"JAXCKPT_MAP": "0"}, {"mesh": SAME}),
        "raw read": ("read", {}, {"verified": False, "share": 0}),
        "verified read": ("read", {}, {"verified": True, "share": 0}),
        "restore mapped (4,2)": ("restore", {}, {"mesh": SAME}),
    }
    if args.baseline_tree:
        base = {"PYTHONPATH": os.path.abspath(args.baseline_tree)}
        ops["baseline: restore mapped (4,2)"] = ("restore", base, {"mesh": SAME})
        ops["baseline: restore MAP=0 (4,2)"] = ("restore", {**base, "JAXCKPT_MAP": "0"},
                                                {"mesh": SAME})  # fmt: skip
    res: dict[str, list[dict]] = {k: [] for k in ops}
    bad: list[str] = []
    with harness.scratch() as workdir:
        path = os.path.join(workdir, "ckpt")
        common = {"path": path, "workdir": workdir, "size_gb": args.size_gb}
        harness.log("save")
        saved = harness.run_worker(__file__, op="save", **common)
        files = sum(os.path.getsize(p) for p in harness.files_under(path))
        shares: dict[tuple[int, int], float] = {}
        for rep in range(args.repeats):
            for label in harness.rotated(list(ops), rep):
                op, env, kw = ops[label]
                harness.log(f"repeat {rep + 1}/{args.repeats}: {label}")
                got = harness.run_worker(__file__, env=env, op=op, **common, **kw)
                res[label].append(got)
                if op == "restore":
                    shares[kw["mesh"]] = (got["device_bytes"] - nbytes) / files
                    if got["crcs"] != saved["crcs"]:
                        bad.append(f"{label} repeat {rep + 1}")
            for ((a, b), share), verified in itertools.product(sorted(shares.items()), (0, 1)):
                label = f"{('raw', 'verified')[verified]} read + replicas ({a},{b})"
                harness.log(f"repeat {rep + 1}/{args.repeats}: {label}")
                got = harness.run_worker(
                    __file__, op="read", **common, share=share, verified=bool(verified)
                )
                res.setdefault(label, []).append(got)
    report(args, res, nbytes, bad)


def report(args, res: dict[str, list[dict]], nbytes: int, bad: list[str]) -> None:
    from jaxckpt._src.io.direct import reader_threads

    speed = {k: harness.gbps(nbytes, [r["seconds"] for r in v]) for k, v in res.items() if v}
    cpu = {k: harness.median(r["cpu"] for r in v) / (nbytes / GB) for k, v in res.items() if v}
    print(
        f"\nstate: {nbytes / GB:.3f} GB logical, saved from a (4,2) mesh of 8 CPU devices; "
        f"{args.repeats} repeats, each operation a fresh process, GB/s of the logical bytes "
        f"from median times; reads on {reader_threads()} threads (the reader threads); "
        f"{os.cpu_count()} cores; the VM's free page reporting {args.page_reporting}\n"
    )
    table = harness.Table((("operation", "<32"), ("GB/s", ">8.3f"), ("CPU s/GB", ">9.3f")))
    table.print([(k, speed[k], cpu[k]) for k in speed], rule=True)
    print()

    def ratio(name: str, a: str, b: str, floor: float | None = None) -> None:
        r = speed[a] / speed[b]
        verdict = "" if floor is None else ("PASS " if r >= floor else "FAIL ")
        bound = "" if floor is None else f" >= {floor}x"
        print(f"  {verdict:5}{name + bound:<62}{r:>6.2f}x")

    print("the path a GPU takes (no mappings), against the same run's references:")
    for mesh in ("(4,2)", "(2,4)"):
        with_replicas = f"raw read + replicas {mesh}"
        ratio(f"restore MAP=0 {mesh} / raw read + replicas", f"restore MAP=0 {mesh}",
              with_replicas, 0.9)  # fmt: skip
        ratio(f"restore MAP=0 {mesh} / verified read + replicas", f"restore MAP=0 {mesh}",
              f"verified read + replicas {mesh}")  # fmt: skip
        ratio(f"restore MAP=0 {mesh} / raw read of the files", f"restore MAP=0 {mesh}",
              "raw read")  # fmt: skip
        if mesh == "(4,2)":
            ratio(f"restore MAP=0 {mesh}, its reads alone / raw read + replicas",
                  f"restore MAP=0 {mesh}, reads alone", with_replicas)  # fmt: skip
        ratio(f"restore as on a GPU {mesh} / raw read + replicas",
              f"restore as on a GPU {mesh}", with_replicas)  # fmt: skip
        ratio(f"  ceiling: verified read + replicas {mesh} / raw read + replicas",
              f"verified read + replicas {mesh}", with_replicas)  # fmt: skip
    ratio("engine reads (ring) / verified read, same threads", "engine reads, ring",
          "verified read", 0.9)  # fmt: skip
    ratio("engine reads (fresh memory) / verified read", "engine reads, fresh memory",
          "verified read")  # fmt: skip
    ratio("restore mapped (4,2) / restore MAP=0 (4,2)", "restore mapped (4,2)",
          "restore MAP=0 (4,2)")  # fmt: skip
    if "baseline: restore mapped (4,2)" in speed:
        ratio("restore mapped: this tree / the baseline tree", "restore mapped (4,2)",
              "baseline: restore mapped (4,2)", 0.95)  # fmt: skip
        ratio("restore MAP=0: this tree / the baseline tree", "restore MAP=0 (4,2)",
              "baseline: restore MAP=0 (4,2)")  # fmt: skip
    if bad:
        print("RESTORED DATA MISMATCH: " + "; ".join(bad))
    else:
        print("every restore checked bit-exact against the saved state (CRC32 per leaf)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-tree", help="another jaxckpt source tree, first on PYTHONPATH")
    p.add_argument(
        "--page-reporting",
        choices=["on", "off"],
        default="on",
        help="off (root): the VM's free page reporting stopped for the run and its free memory "
        "backed first, as on a host whose memory stays backed (bench/compare.py's option)",
    )
    args = p.parse_args()
    with harness.page_reporting(args.page_reporting != "off"):
        run(args)


if __name__ == "__main__":
    harness.entry(main, worker)
