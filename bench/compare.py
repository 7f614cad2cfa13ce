"""jaxckpt vs Orbax, and vs the machine: save / restore throughput, CPU seconds, peak host
memory and files per step, against the raw disk and page-cache limits of the same bytes.

Run from the repository root (the full run of record is ``--size-gb 1``, a few minutes)::

    python bench/compare.py --size-gb 1            # the full comparison
    python bench/compare.py --size-gb 0.1 --repeats 1          # quick smoke run
    python bench/compare.py --size-gb 0.1 --only jaxckpt       # skip Orbax
    python bench/compare.py --direct-read both     # jaxckpt's direct reads vs TensorStore's
    python bench/compare.py --chunk-bytes 16777216 # and chunk_bytes=16 MiB vs default
    python bench/compare.py --drop-page-cache-gb 2 # and a 2 GB save, 4 ways (page cache, O_DIRECT)
    python bench/compare.py --direct-write both    # jaxckpt's own writer vs TensorStore's
    python bench/compare.py --page-reporting off   # (root) the VM keeps the memory it backs
    python bench/compare.py --gpu-path             # and the path a GPU restore takes (gpu_path.py)

Needs a CRC32C package for the verified-read limit: ``crc32c`` (jaxckpt's own dependency,
hardware-accelerated; ``google-crc32c`` also works); uses ``fio`` as a second raw reference
where it is installed (``apt-get install fio``; ``--no-fio`` skips it). bench/gpu.py is the
same comparison on one GPU (device <-> host copies against plain JAX).

What it does: builds a train-state-like pytree (params + Adam mu + nu, ~170 float32 arrays,
total about ``--size-gb`` GB) on a (4, 2) ('data', 'model') mesh of 8 virtual CPU devices
with mixed PartitionSpecs, then, ``--repeats`` times, alternating the libraries:

* sync save: ``jaxckpt.save`` vs ``ocp.StandardCheckpointer().save`` + ``wait_until_finished``
  (default options), and a manager's async save (blocking time, total throughput);
* restore with an explicit target of ShapeDtypeStructs onto the same (4, 2) mesh, onto a
  (2, 4) mesh and onto 4 devices as a (2, 2) mesh, the checkpoint's files in the page cache
  (read once first), and a cold restore onto the same mesh (the files fsynced and dropped
  from the page cache with ``posix_fadvise(DONTNEED)``); ``block_until_ready`` on the result,
  which is checked bit-exact against the saved data after the clock stops;
* the limits (``harness.raw_io``): the same bytes written with NumPy + fsync as one file and
  as per-array files on 2/4/8 threads, then read back from the page cache into fresh memory
  that is kept until the clock stops (a buffer per file, every page touched for the first
  time, as a restore that reads fills the arrays it returns; reading blocks into memory that
  is freed and reused would skip those page faults; a restore onto CPU devices that maps
  whole chunks of the files, ``jaxckpt/_src/io/mapped.py``, skips them too), plainly and *verified* (a hardware CRC32C over every byte: the least a reader that checks
  every byte must do); the best way is the limit. Beside them, the verified read with each
  array's replicas on the (4, 2) mesh then copied into fresh memory: onto CPU devices every
  replica is host memory a restore that reads must fill (1.41 GB for the 1 GB state's 0.96
  GB read; mapped, the replicas share the page cache's pages),
  printed as a ratio beside the targets, which stay against the verified read. The save is held against the raw
  *first* write: each way in a fresh process that builds the arrays, warms up with a tiny
  write and then writes every byte once, as the save worker does (on this VM memory left
  idle is slow to touch again, so the later writes of one process run faster than any
  first one; that figure is printed beside it). For the same reason a restore is also held,
  beside the targets, against a *first* verified read (``worker_first_read``): a fresh
  process with the restore worker's own preamble reads jaxckpt's files once, with a CRC32C,
  into fresh memory and fills as many bytes again as the replicas hold (on this VM a restore
  spends most of its time in the kernel zeroing fresh pages the hypervisor took back while
  the process started: ``perf`` shows ``clear_page_erms``). Cold: jaxckpt's own checkpoint files read
  plainly and verified from the disk on 1/2/4/8 threads (``harness.cold_reads``). fio, where
  installed: sequential write and read of a file of the state's size, O_DIRECT and not,
  psync and io_uring.

Every timed operation runs in a fresh subprocess (``--worker``), which runs a garbage
collection before its clock starts (building a state in Python leaves a full collection
due: 50-60 ms that fell inside whichever operation came next) and measures its own wall
time, CPU seconds (user + sys of all its threads, from /proc/self/stat; the RSS sampler's
own share taken out) and peak RSS over its baseline (save: with the state built; restore:
state-free), so memory freed by an earlier operation cannot hide a peak; a tiny warm-up save
+ restore runs before the clock starts. On CPU devices every replica is host memory, so a
restore is judged against what the restored arrays occupy on the devices (replicas
included) + 0.3 GB. The first read after a write is often slow on a shared disk, so the
order of the restores (and of the raw ways, and of plain vs verified reads) rotates from
repeat to repeat. ``--direct-read on|off|both`` sets ``JAXCKPT_DIRECT_READ`` (1/0) in the
restore workers; "both" restores each jaxckpt checkpoint both ways, alternating, and prints
the gain. Checkpoints go to a temporary directory under /tmp, deleted as it goes. GB means
1e9 bytes.

This VM's kernel reports free memory to its hypervisor (virtio-balloon free page reporting),
which takes the pages back: the memory a fresh process fills first then costs a host fault
per page (touching 17 GiB of it once took 42 s here: 2.5 s/GiB), and a worker's figures
depend on what ran seconds before it. The header says how much was reported during the run;
``--page-reporting off`` (root) stops the reporting for the run, touches the free memory once
so that all of it is backed (~40 s), and puts the reporting back after: the figures a host
whose memory stays backed (bare metal) would give.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import math
import os
import shutil
import time

import harness
from harness import GB

harness.cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402
from train_state import (  # noqa: E402, F401  (bench/verify.py and emergency.py use them from here)
    abstract_state,
    build_state,
    count_files,
    device_bytes,
    layout,
    leaf_crcs,
    make_mesh,
    state_bytes,
    width,
)

from jaxckpt._src.io import linux, page_cache  # noqa: E402
from jaxckpt._src.io.direct import reader_threads  # noqa: E402
from jaxckpt._src.io.inflight import READ_BUDGET_BYTES, default_budget  # noqa: E402

SAME_MESH = "restore same mesh (4,2)"
COLD = "cold restore same mesh"
RESTORES = {  # operation -> (mesh shape, device count)
    SAME_MESH: ((4, 2), 8),
    "restore mesh (2,4)": ((2, 4), 8),
    "restore 4 dev (2,2)": ((2, 2), 4),
    COLD: ((4, 2), 8),
}
WARM = [op for op in RESTORES if op != COLD]
FILES = "raw reads of its files"  # not a restore: cold reads of jaxckpt's checkpoint files
FIRST = "first write"  # raw write + fsync as a fresh process's first big write, like a save
REPLICAS = "verified + replicas"  # a verified read, then each array's replicas copied
FIRST_READ = "first verified read"  # of jaxckpt's files + replicas, in a restore's conditions
RAW_KINDS = ("write", FIRST, "read", "verified", REPLICAS, FIRST_READ, "cold read", "cold verified")
FIRST_READ_THREADS = sorted({1, reader_threads()})  # its ways: a fresh process each
DIRECT_ENV = "JAXCKPT_DIRECT_READ"
TS_READS = "jaxckpt (tensorstore reads)"  # --direct-read both: JAXCKPT_DIRECT_READ=0
WRITE_ENV = "JAXCKPT_DIRECT_WRITE"  # --direct-write both: =0 saves through TensorStore too

# --- the libraries -------------------------------------------------------------------------


class Jaxckpt:
    def __init__(self, chunk_bytes: int | None = None, cache: str = "default"):
        import jaxckpt

        self.lib, self.chunk_bytes, self.cache = jaxckpt, chunk_bytes, cache

    def save(self, path: str, tree) -> None:
        """``jaxckpt.save``, with the page-cache choice a manager's ``Options`` would make."""
        from jaxckpt._src import gc_pause, saving

        writes = saving.Writes(
            direct_io={KEEP: False, DROP: False, DIRECT_IO: True}.get(self.cache),
            drop_page_cache=self.cache == DROP,
        )
        with gc_pause.paused():  # as jaxckpt.save does
            saving.commit(saving.prepare(path, tree, chunk_bytes=self.chunk_bytes, writes=writes))

    def restore(self, path: str, target):
        return self.lib.restore(path, target)

    def close(self) -> None:
        pass


class Orbax:
    def __init__(self):
        import orbax.checkpoint as ocp

        self.ckptr = ocp.StandardCheckpointer()

    def save(self, path: str, tree) -> None:
        self.ckptr.save(path, tree)
        self.ckptr.wait_until_finished()
        # Finished means finalized: the temporary directory renamed into place.
        parent, name = os.path.split(path)
        leftovers = [n for n in os.listdir(parent) if n.startswith(name) and n != name]
        if not os.path.isdir(path) or leftovers:
            raise RuntimeError(f"orbax save of {path} not finalized: {leftovers}")

    def restore(self, path: str, target):
        return self.ckptr.restore(path, target)

    def close(self) -> None:
        self.ckptr.close()


LIBS = {"jaxckpt": Jaxckpt, "orbax": Orbax, "jaxckpt-chunks": Jaxckpt}
CHUNKED = "jaxckpt-chunks"  # jaxckpt with --chunk-bytes
KEEP = "page_cache"  # --drop-page-cache-gb: jaxckpt saves with direct_io=False,
DROP = "drop_page_cache"  # with drop_page_cache=True (and direct_io=False: its own way)
DIRECT_IO = "direct_io"  # and with direct_io=True (the default: O_DIRECT on a disk filesystem)


def make_lib(args):
    if args.lib in (KEEP, DROP, DIRECT_IO):
        return Jaxckpt(cache=args.lib)
    return Jaxckpt(args.chunk_bytes) if args.lib == CHUNKED else LIBS[args.lib]()


def warm_up(lib, mesh: Mesh, workdir: str) -> None:
    """A tiny save + restore, so one-time costs (imports, thread pools) are not timed."""
    path = os.path.join(workdir, f"warm-{os.getpid()}")
    spec = NamedSharding(mesh, P("data", "model"))
    tree = {"a": jax.device_put(np.ones((64, 64), np.float32), spec), "b": jax.numpy.int32(1)}
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree
    )
    lib.save(path, tree)
    jax.block_until_ready(lib.restore(path, target))
    shutil.rmtree(path)


# --- workers (each in its own process) -----------------------------------------------------


def worker_save(args) -> dict:
    mesh = make_mesh((4, 2), 8)
    lib = make_lib(args)
    warm_up(lib, mesh, args.workdir)
    state, crcs = build_state(args.size_gb, mesh)
    jax.block_until_ready(state)
    gc.collect()  # the garbage of building the state is not the save's (raw_io does the same)
    with harness.PeakRss() as rss, harness.Clock() as clock:
        lib.save(args.path, state)
    lib.close()
    return {
        "seconds": clock.seconds,
        "cpu": clock.cpu - rss.sampler_cpu,
        "rss_over": rss.over,
        "cache_over": rss.cache_over,
        "baseline": rss.baseline,
        "device_bytes": device_bytes(state),
        "crcs": crcs,
    }


def worker_async(args) -> dict:
    """Blocking time of a manager's async save, first save and later saves (same buffers),
    and its total. Every step is kept (``max_to_keep=None``, both libraries): deleting the
    last step is retention's work, not the save's. jaxckpt's async manager is held against
    a manager with ``async_save=False`` saving the same steps into a second directory, the
    two alternating step by step: a run of 1 GB saves slows as the disk falls behind (here
    a 3rd and 4th save in a row took 2x the 1st), so only saves made side by side compare."""
    mesh = make_mesh((4, 2), 8)
    state, _ = build_state(args.size_gb, mesh)
    jax.block_until_ready(state)
    if args.lib == "jaxckpt":
        import jaxckpt

        def manager(path: str, async_save: bool):
            opts = jaxckpt.Options(
                max_to_keep=None, async_save=async_save, run_log=not args.no_run_log
            )
            return jaxckpt.CheckpointManager(path, opts)

        mgr = manager(args.path, True)
        sync_mgr = manager(args.path + "-sync", False)

        def save(step):
            mgr.save(step, state)

    else:
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=None, enable_async_checkpointing=True)
        mgr, sync_mgr = ocp.CheckpointManager(args.path, options=opts), None

        def save(step):
            mgr.save(step, args=ocp.args.StandardSave(state))

    blocking, total, sync_total = [], [], []
    gc.collect()
    for step in range(4):
        for which in harness.rotated(["async", "sync"], step):
            if which == "sync" and sync_mgr is not None:
                t0 = time.perf_counter()
                sync_mgr.save(step, state)
                sync_total.append(time.perf_counter() - t0)
            elif which == "async":
                t0 = time.perf_counter()
                save(step)
                blocking.append(time.perf_counter() - t0)
                mgr.wait_until_finished()
                total.append(time.perf_counter() - t0)
    mgr.close()
    if sync_mgr is not None:
        sync_mgr.close()
        shutil.rmtree(args.path + "-sync")
    return {"blocking": blocking, "total": total, "sync_total": sync_total}


def worker_restore(args) -> dict:
    """One restore, from the page cache (the files read once first) or, ``cold``, from the
    disk (the files fsynced and dropped from the page cache first)."""
    mesh = make_mesh(tuple(args.mesh), args.devices)
    lib = make_lib(args)
    warm_up(lib, mesh, args.workdir)
    target = abstract_state(args.size_gb, mesh)
    if args.cold:
        harness.drop_cold(args.path)
    else:
        harness.warm_page_cache(args.path)
    gc.collect()  # as before every timed operation: no garbage of the warm-up in its clock
    with harness.PeakRss(cache=False) as rss, harness.Clock() as clock:
        restored = jax.block_until_ready(lib.restore(args.path, target))
    lib.close()
    shardings_ok = all(
        r.sharding == t.sharding and r.shape == t.shape and r.dtype == t.dtype
        for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True)
    )
    return {
        "seconds": clock.seconds,
        "cpu": clock.cpu - rss.sampler_cpu,
        "rss_over": rss.over,
        "baseline": rss.baseline,
        "device_bytes": device_bytes(target),
        "crcs": leaf_crcs(restored),
        "shardings_ok": shardings_ok,
    }


def worker_raw(args) -> dict:
    """The limits for the state's bytes: ``harness.raw_io`` (write + fsync, read, verified
    read, several ways)."""
    sizes = [int(np.prod(s)) * np.dtype(t).itemsize for _, s, t, _ in layout(args.size_gb)]
    return harness.raw_io(
        args.path, sizes, args.rotate, replica_copies(args.size_gb, RESTORES[SAME_MESH])
    )


def replica_copies(size_gb: float, mesh_devices: tuple[tuple[int, int], int]) -> list[int]:
    """For each array of the state at ``size_gb``, the copies of its bytes beyond one that a restore onto
    that mesh holds (CPU devices: each replica is host memory of its own)."""
    mesh = make_mesh(*mesh_devices)
    out = []
    for _, shape, _, spec in layout(size_gb):
        sharding = NamedSharding(mesh, spec)
        shards = math.prod(shape) // math.prod(sharding.shard_shape(shape))
        out.append(len(sharding.device_set) // shards - 1)
    return out


def worker_first_write(args) -> dict:
    """``harness.first_write``: the raw write in the save worker's conditions."""
    sizes = [int(np.prod(s)) * np.dtype(t).itemsize for _, s, t, _ in layout(args.size_gb)]
    return {FIRST: {harness.way_name(args.threads, len(sizes)): harness.first_write(
        args.path, sizes, args.threads)}}  # fmt: skip


def worker_first_read(args) -> dict:
    """The verified read in the restore worker's own conditions: a fresh process with the
    same preamble (devices, a tiny jaxckpt save + restore, the target, the checkpoint's
    files read into the page cache), then one timed read of every byte of the checkpoint's
    files into fresh memory with a CRC32C over them, and as many bytes again copied into
    fresh memory as the restore's replicas on the (4, 2) mesh hold (the files' bytes in
    proportion). On this VM, memory a process touches for the first time after seconds of
    other work costs far more than memory just freed (the hypervisor takes back idle guest
    memory), so a read later in a busy process is not a restore's like."""
    mesh = make_mesh((4, 2), 8)
    warm_up(Jaxckpt(), mesh, args.workdir)
    target = abstract_state(args.size_gb, mesh)
    paths, crc = harness.files_under(args.path), harness.crc32c()[1]
    harness.warm_page_cache(args.path)
    harness.read_files([min(paths, key=os.path.getsize)], 1, crc)
    share = (device_bytes(target) - state_bytes(args.size_gb)) / sum(map(os.path.getsize, paths))
    kept: list = []
    gc.collect()
    with harness.Clock() as clock:
        harness.read_files(paths, args.threads, crc, kept, [share] * len(paths))
    del kept
    way = f"{len(paths)} files, {args.threads} thread{'s' * (args.threads > 1)}"
    return {FIRST_READ: {way: clock.record()}}


def worker_files(args) -> dict:
    """Cold plain and verified reads of a checkpoint's own files (``harness.cold_reads``)."""
    nbytes = sum(os.path.getsize(p) for p in harness.files_under(args.path))
    return {"bytes": nbytes, **harness.cold_reads(args.path, args.rotate)}


WORKERS = {
    "async": worker_async,
    "save": worker_save,
    "restore": worker_restore,
    "raw": worker_raw,
    "first_write": worker_first_write,
    "first_read": worker_first_read,
    "files": worker_files,
}


# --- the parent: orchestration -------------------------------------------------------------


def worker(op: str, **kw) -> dict:
    return WORKERS[op](argparse.Namespace(**kw))


def run_worker(args, op: str, env: dict[str, str] | None = None, **kw) -> dict:
    common = {"size_gb": args.size_gb, "workdir": args.workdir, "chunk_bytes": args.chunk_bytes,
              "no_run_log": args.no_run_log}  # fmt: skip
    return harness.run_worker(__file__, env=env, op=op, **{**common, **kw})


def readers(args, lib: str) -> list[tuple[str, dict[str, str] | None]]:
    """Who restores ``lib``'s checkpoints: (label of the results, the workers' environment);
    ``--direct-read both`` has jaxckpt's checkpoints restored both ways, alternating."""
    if lib == "orbax" or args.direct_read is None:
        return [(lib, None)]
    if args.direct_read == "both" and lib == "jaxckpt":
        return [(lib, {DIRECT_ENV: "1"}), (TS_READS, {DIRECT_ENV: "0"})]
    return [(lib, {DIRECT_ENV: "0" if args.direct_read == "off" else "1"})]


def orchestrate(args) -> dict:
    libs = ["jaxckpt"] if args.only == "jaxckpt" else ["jaxckpt", "orbax"]
    libs += [CHUNKED] if args.chunk_bytes else []
    labels = [label for lib in libs for label, _ in readers(args, lib)]
    res: dict = {label: {op: [] for op in ["save", *RESTORES]} for label in labels}
    files: dict = {lib: [] for lib in libs}
    raw: dict = {kind: {} for kind in RAW_KINDS}
    bad: list[str] = []
    asyncs: dict = {}
    load = [os.getloadavg()[0]]
    fio, files_bytes = None, 0
    drops: list[dict] = []
    ts_writes: list[dict] = []
    for rep in range(args.repeats):
        harness.log(f"repeat {rep + 1}/{args.repeats}: raw")
        r = run_worker(args, "raw", path=os.path.join(args.workdir, "raw"), rotate=rep)
        _collect(raw, r, {"write": "write", "read": "read", "verified": "verified",
                          "replicas": REPLICAS})  # fmt: skip
        for n in harness.rotated([1, *harness.RAW_THREADS], rep):
            path = os.path.join(args.workdir, "raw")
            _collect(raw, run_worker(args, "first_write", path=path, threads=n), {FIRST: FIRST})
        if rep == 0 and not args.no_fio:
            harness.log("fio")
            fio = harness.fio(os.path.join(args.workdir, "fio.bin"), state_bytes(args.size_gb))
        for lib in harness.alternate(libs, rep):
            path = os.path.join(args.workdir, f"{lib}-{rep}")
            harness.log(f"repeat {rep + 1}/{args.repeats}: {lib} save")
            saved = run_worker(args, "save", lib=lib, path=path)
            res[lib]["save"].append(saved)
            files[lib].append(count_files(path))
            if lib == "jaxckpt" and args.direct_write == "both":
                harness.log(f"repeat {rep + 1}/{args.repeats}: jaxckpt save, {WRITE_ENV}=0")
                ts_path = path + "-ts"
                ts_writes.append(run_worker(args, "save", {WRITE_ENV: "0"}, lib=lib, path=ts_path))
                shutil.rmtree(ts_path)
            # The first read after a write is often slow on a shared disk: rotate which goes
            # first, the raw reads of jaxckpt's files among them.
            ops = [*RESTORES, *([FILES, FIRST_READ] if lib == "jaxckpt" else [])]
            for op in harness.rotated(ops, rep):
                harness.log(f"repeat {rep + 1}/{args.repeats}: {lib} {op}")
                if op == FIRST_READ:
                    for n in harness.alternate(FIRST_READ_THREADS, rep):
                        r = run_worker(args, "first_read", path=path, threads=n)
                        _collect(raw, r, {FIRST_READ: FIRST_READ})
                    continue
                if op == FILES:
                    r = run_worker(args, "files", path=path, rotate=rep)
                    _collect(raw, r, {"read": "cold read", "verified": "cold verified"})
                    files_bytes = r["bytes"]
                    continue
                shape, devices = RESTORES[op]
                for label, env in harness.alternate(readers(args, lib), rep):
                    got = run_worker(
                        args, "restore", env, lib=lib, path=path, mesh=shape, devices=devices,
                        cold=op == COLD,
                    )  # fmt: skip
                    res[label][op].append(got)
                    if got["crcs"] != saved["crcs"] or not got["shardings_ok"]:
                        bad.append(f"{label} {op} repeat {rep + 1}")
            shutil.rmtree(path)
            if lib == CHUNKED:
                continue
            harness.log(f"repeat {rep + 1}/{args.repeats}: {lib} async manager save")
            got = run_worker(args, "async", lib=lib, path=path)
            asyncs.setdefault(lib, []).append(got)
            shutil.rmtree(path, ignore_errors=True)
        if args.drop_page_cache_gb:
            drops.append(drop_page_cache_round(args, rep))
        load.append(os.getloadavg()[0])
    return {
        "drops": drops,
        "ts_writes": ts_writes,
        "libs": libs,
        "labels": labels,
        "results": res,
        "files": files,
        "raw": raw,
        "files_bytes": files_bytes,
        "fio": None if fio is None else [dataclasses.asdict(f) for f in fio],
        "crc32c": harness.crc32c()[0],
        "bad": bad,
        "load": load,
        "async": asyncs,
    }


def drop_page_cache_round(args, rep: int) -> dict:
    """--drop-page-cache-gb: a state of that size saved with the defaults, through the page
    cache (direct_io=False), with drop_page_cache and with direct_io, and written raw (first
    writes, every way), alternating; each save's page cache growth."""
    size, out = args.drop_page_cache_gb, {"raw": {FIRST: {}}}
    for lib in harness.alternate(["jaxckpt", KEEP, DROP, DIRECT_IO], rep):
        path = os.path.join(args.workdir, f"{lib}-big")
        harness.log(f"repeat {rep + 1}/{args.repeats}: {size:g} GB save, {lib}")
        out[lib] = run_worker(args, "save", lib=lib, path=path, size_gb=size)
        shutil.rmtree(path)
    for n in harness.rotated([1, *harness.RAW_THREADS], rep):
        got = run_worker(args, "first_write", path=os.path.join(args.workdir, "raw"),
                         threads=n, size_gb=size)  # fmt: skip
        _collect(out["raw"], got, {FIRST: FIRST})
    return out


def _report_drops(args, drops: list[dict]) -> None:
    """The --drop-page-cache-gb figures and their targets."""
    nbytes = state_bytes(args.drop_page_cache_gb)
    raw: dict = {FIRST: {}}
    for d in drops:
        for way, recs in d["raw"][FIRST].items():
            raw[FIRST].setdefault(way, []).extend(recs)
    limit = harness.best_ways(raw, nbytes)[FIRST]
    print(f"\nsave of a {nbytes / GB:.3f} GB state: defaults, direct_io=False, "
          f"drop_page_cache, direct_io "
          f"(page cache = Cached + Dirty of /proc/meminfo, machine-wide; raw first write "
          f"{limit.gbps:.3f} GB/s, {limit.way})")  # fmt: skip
    table = harness.Table(
        (("save", "<24"), ("GB/s", ">8.3f"), ("x raw", ">7.2f"))
        + (("cache growth MiB (max)", ">23.0f"), ("(each repeat)", "<30"))
    )
    rows, figures = [], {}
    named = (
        ("jaxckpt", "defaults"),
        (KEEP, "direct_io=False"),
        (DROP, "drop_page_cache=True"),
        (DIRECT_IO, "direct_io=True"),
    )
    for lib, name in named:
        runs = [d[lib] for d in drops]
        rate = harness.gbps(nbytes, [r["seconds"] for r in runs])
        growth = [r["cache_over"] / 2**20 for r in runs]
        figures[lib] = (rate / limit.gbps, max(growth))
        each = "  " + ", ".join(f"{g:.0f}" for g in growth)
        rows.append((name, rate, rate / limit.gbps, max(growth), each))
    table.print(rows, rule=True)
    for lib in (DROP, DIRECT_IO):
        ratio, growth = figures[lib]
        _target(growth <= 256, f"{lib}: page cache grows <= 256 MiB", f"{growth:>8.0f} MiB")
        _target(ratio >= 0.8, f"{lib}: save >= 0.8x raw first write", f"{ratio:>8.2f}x")


def _collect(raw: dict, got: dict, kinds: dict[str, str]) -> None:
    """A worker's raw measurements appended to ``raw``, its kinds renamed by ``kinds``."""
    for kind, into in kinds.items():
        for way, rec in got[kind].items():
            raw[into].setdefault(way, []).append(rec)


# --- the report --------------------------------------------------------------------------


def _target(ok: bool | None, name: str, figure: str) -> None:
    print(f"  {harness.verdict(ok):<5}{name:<60}{figure}")


# the raw kind each operation is held against: plainly, and verified (restores)
PLAIN_REF = {"save": FIRST, COLD: "cold read", **{op: "read" for op in WARM}}
VERIFIED_REF = {COLD: "cold verified", **{op: "verified" for op in WARM}}


def report(args, out: dict) -> None:
    nbytes = state_bytes(args.size_gb)
    libs, labels, res = out["libs"], out["labels"], out["results"]
    ops = ["save", *RESTORES]
    orbax = "orbax" in libs
    lim = harness.best_ways({k: out["raw"][k] for k in RAW_KINDS}, nbytes)

    def per_op(fn) -> dict[str, dict[str, float]]:
        return {lb: {op: fn(runs) for op, runs in res[lb].items() if runs} for lb in labels}

    speed = per_op(lambda runs: harness.gbps(nbytes, [r["seconds"] for r in runs]))
    cpu = per_op(lambda runs: harness.median(r["cpu"] for r in runs) / (nbytes / GB))
    peak = per_op(lambda runs: max(r["rss_over"] for r in runs) / GB)
    # On CPU devices every replica lives in host memory, so a restored state takes more RSS
    # than its logical size: the restore budget is what the result itself occupies + 0.3 GB.
    on_devices = {op: res["jaxckpt"][op][0]["device_bytes"] / GB for op in ops}
    nfiles = {lib: max(out["files"][lib]) for lib in libs}

    direct = {None: "the default reads", "both": "direct and tensorstore reads, alternating"}.get(
        args.direct_read, f"{DIRECT_ENV}={int(args.direct_read == 'on')}"
    )
    print(
        f"\nstate: {nbytes / GB:.3f} GB logical ({on_devices['save']:.3f} GB with the replicas "
        f"on the 8 CPU devices), {len(layout(args.size_gb))} float32/int32 arrays, d="
        f"{width(args.size_gb)}, saved from a (4,2) mesh; {args.repeats} repeats: GB/s of "
        f"logical bytes from median times, peak RSS over baseline from the worst repeat; "
        f"restores from the page cache except the cold one; jaxckpt restores: {direct}; "
        f"CRC32C: {out['crc32c']}; load average "
        f"{' -> '.join(f'{x:.1f}' for x in out['load'])} on {os.cpu_count()} cores"
    )
    print(_page_reporting_line(out.get("page_reporting", {})) + "\n")
    table = harness.Table(
        (("operation", "<24"), ("jaxckpt GB/s", ">13.3f"), ("orbax GB/s", ">11.3f"))
        + (("jx/orbax", ">9.2f"), ("jx/raw", ">8.2f"), ("jx/verified", ">12.2f"))
        + (("jx RSS+ GB", ">11.3f"), ("orbax RSS+ GB", ">14.3f"), ("result GB", ">10.3f"))
    )
    print(table.head(rule=True))
    for op in ops:
        jx, ob = speed["jaxckpt"][op], speed["orbax"][op] if orbax else None
        plain, checked = lim.get(PLAIN_REF[op]), lim.get(VERIFIED_REF.get(op, ""))
        ob_peak, result = peak["orbax"][op] if orbax else None, on_devices[op]
        cells = (op, jx, ob, ob and jx / ob, plain and jx / plain.gbps)
        cells += (checked and jx / checked.gbps, peak["jaxckpt"][op], ob_peak)
        print(table.row(*cells, None if op == "save" else result))
    files = [str(nfiles[lib]) if lib in nfiles else None for lib in ("jaxckpt", "orbax")]
    print(table.row("files per step", *files))
    print("(jx/raw: to raw write + fsync, raw read, or cold raw read of jaxckpt's files; "
          "jx/verified: to the verified-read limit, warm or cold)")  # fmt: skip
    if TS_READS in labels:
        _report_direct(speed, cpu)
    if out.get("ts_writes"):
        _report_writes(out["ts_writes"], res["jaxckpt"]["save"], lim.get(FIRST), nbytes)
    _report_cpu(cpu, lim, orbax)
    if CHUNKED in libs:
        print(f"\nchunk_bytes={args.chunk_bytes} vs the default (chunks follow the shards):")
        for op in ops:
            ch, jx = speed[CHUNKED][op], speed["jaxckpt"][op]
            print(f"  {op:<22}{ch:>8.3f} GB/s vs {jx:.3f}: {ch / jx:.2f}x")
    print("\nspread (GB/s, min..max over repeats):")
    for label in labels:
        spread = []
        for op, runs in res[label].items():
            rates = [nbytes / GB / r["seconds"] for r in runs]
            if rates:
                spread.append(f"{op.removeprefix('restore ')} {min(rates):.2f}..{max(rates):.2f}")
        print(f"  {label}: " + "; ".join(spread))
    _report_limits(out, nbytes)
    if out["bad"]:
        print("RESTORED DATA MISMATCH: " + "; ".join(out["bad"]))
    else:
        print(
            "every restore verified bit-exact against the saved data, with the target's shardings"
        )
    _report_targets(speed, cpu, lim, orbax)
    _report_vs_fio(args, out, speed)
    limits_rss = [("save peak RSS <= 0.3 GB over the state", peak["jaxckpt"]["save"], 0.3)]
    # the read budget grows with the reader threads (128 MiB up to 5 cores): so does the limit
    slack = 0.3 + (default_budget(reader_threads()) - READ_BUDGET_BYTES) / GB
    limits_rss += [
        (f"{op} peak RSS <= result + {slack:.1f} GB", peak["jaxckpt"][op], on_devices[op] + slack)
        for op in RESTORES
    ]
    for name, value, cap in limits_rss:
        _target(value <= cap, name, f"{value:>8.3f} GB (limit {cap:.3f})")
    _report_async(out, state_bytes(args.size_gb) / GB)
    if out.get("drops"):
        _report_drops(args, out["drops"])
    n, cap = nfiles["jaxckpt"], 8 + 4 * 1
    _target(n <= cap, "files per step <= 8 + 4 x processes", f"{n:>8} (limit {cap})")


def _page_reporting_line(rep: dict) -> str:
    """What the VM's free page reporting did during the run (``harness.reported_kib``)."""
    order, kib = rep.get("order"), rep.get("reported_kib")
    if order is None:
        return "free page reporting to a hypervisor: none (the kernel has none)"
    if order >= harness.NO_REPORTING_ORDER:
        return "free page reporting to the hypervisor: stopped for this run (--page-reporting off)"
    done = "" if kib is None else f", {kib / 2**20:.1f} GiB reported during the run"
    return (
        f"free page reporting to the hypervisor: on (blocks of 2^{order} pages){done}: memory "
        "a fresh process touches first may cost a host fault (--page-reporting off stops it)"
    )


def _report_direct(speed: dict, cpu: dict) -> None:
    """--direct-read both: the same checkpoints restored by the direct path and TensorStore."""
    print(f"\njaxckpt restores, {DIRECT_ENV}=1 (direct) vs =0 (tensorstore reads):")
    table = harness.Table(
        (("operation", "<24"), ("direct GB/s", ">12.3f"), ("ts GB/s", ">9.3f"))
        + (("direct/ts", ">10.2f"), ("direct CPU s/GB", ">16.3f"), ("ts CPU s/GB", ">12.3f"))
    )
    rows = []
    for op in RESTORES:
        jx, ts = speed["jaxckpt"][op], speed[TS_READS][op]
        rows.append((op, jx, ts, jx / ts, cpu["jaxckpt"][op], cpu[TS_READS][op]))
    table.print(rows, rule=True)


def _report_writes(ts: list[dict], ours: list[dict], first: harness.Limit | None, n: int) -> None:
    """--direct-write both: the same state saved by jaxckpt's own writer and TensorStore's."""
    print(f"\njaxckpt saves, {WRITE_ENV}=1 (own writer) vs =0 (tensorstore writes):")
    table = harness.Table(
        (("writer", "<24"), ("GB/s", ">8.3f"), ("x raw first", ">12.2f"), ("CPU s/GB", ">9.3f"))
    )
    rows = []
    for name, runs in (("own", ours), ("tensorstore", ts)):
        rate = harness.gbps(n, [r["seconds"] for r in runs])
        cpu = harness.median(r["cpu"] for r in runs) / (n / GB)
        rows.append((name, rate, first and rate / first.gbps, cpu))
    table.print(rows, rule=True)
    print(f"  own / tensorstore: {rows[0][1] / rows[1][1]:.2f}x")


def _report_cpu(cpu: dict, lim: dict[str, harness.Limit], orbax: bool) -> None:
    """CPU seconds (user + sys, every thread) per GB, beside the raw ways' that set the limits."""
    print("\nCPU seconds per GB (user + sys, all threads; raw: the limit's way)")
    table = harness.Table(
        (("operation", "<24"), ("jaxckpt", ">9.3f"), ("orbax", ">9.3f"), ("raw", ">9.3f"))
        + (("raw verified", ">13.3f"), ("jx/raw", ">8.2f"), ("raw is", ">16"))
    )
    rows = []
    for op in ["save", *RESTORES]:
        plain, checked = lim.get(PLAIN_REF[op]), lim.get(VERIFIED_REF.get(op, ""))
        jx, raw = cpu["jaxckpt"][op], plain and plain.cpu_per_gb
        cells = (op, jx, cpu["orbax"][op] if orbax else None, raw)
        rows.append((*cells, checked and checked.cpu_per_gb, raw and jx / raw, PLAIN_REF[op]))
    table.print(rows, rule=True)


def _report_limits(out: dict, nbytes: int) -> None:
    """Every raw way measured, the best of each kind, and fio's figures."""
    print()
    harness.print_ways(out["raw"], nbytes, {
        "write": "raw write (several ways in one process, the later ones on warm memory)",
        FIRST: "raw first write (each way a fresh process's first big write, as a save)",
        "read": "raw read",
        "verified": f"verified read (read + CRC32C by {out['crc32c']})",
        REPLICAS: "verified read + each array's replicas on the (4,2) mesh copied into "
        "fresh memory, as a restore onto 8 CPU devices holds them",
        FIRST_READ: "first verified read + replicas of jaxckpt's files (each way a fresh "
        "process with the restore worker's preamble, as a restore)",
        "cold read": "cold raw read of jaxckpt's files",
        "cold verified": "cold verified read of jaxckpt's files",
    })  # fmt: skip
    if out["files_bytes"]:
        print(f"  (jaxckpt's files: {out['files_bytes'] / GB:.3f} GB on disk; GB/s above "
              f"are of the state's {nbytes / GB:.3f} GB logical, like the restores')")  # fmt: skip
    fio = None if out["fio"] is None else [harness.FioRun(**r) for r in out["fio"]]
    harness.print_fio(fio, skipped=out.get("no_fio", False))


def _report_targets(speed: dict, cpu: dict, lim: dict[str, harness.Limit], orbax: bool) -> None:
    """jaxckpt's throughput and CPU targets, against Orbax and against the machine."""
    print("\ntargets (jaxckpt)")
    jx = speed["jaxckpt"]

    def vs_orbax(op: str) -> float | None:
        return jx[op] / speed["orbax"][op] if orbax else None

    def vs(op: str, kind: str) -> float | None:
        return jx[op] / lim[kind].gbps if kind in lim else None

    rows: list[tuple[str, float | None, float]] = [
        ("save >= 3x orbax", vs_orbax("save"), 3.0),
        ("save >= 0.9x raw write + fsync (first write)", vs("save", FIRST), 0.9),
        ("restore same mesh >= 0.9x the verified-read limit", vs(SAME_MESH, "verified"), 0.9),
        ("restore same mesh >= 0.75x raw read", vs(SAME_MESH, "read"), 0.75),
        ("restore same mesh >= 1.2x orbax", vs_orbax(SAME_MESH), 1.2),
    ]
    for op in WARM:
        if op != SAME_MESH:
            rows.append((f"{op} >= 0.7x raw read", vs(op, "read"), 0.7))
            rows.append((f"{op} >= 0.8x our same mesh", jx[op] / jx[SAME_MESH], 0.8))
            rows.append((f"{op} >= 1.2x orbax", vs_orbax(op), 1.2))
    rows.append(
        ("cold restore >= 0.85x the cold verified-read limit", vs(COLD, "cold verified"), 0.85)
    )
    for name, ratio, need in rows:
        ok = None if ratio is None else ratio >= need
        _target(ok, name, f"{'-' if ratio is None else f'{ratio:.2f}x':>9}")
    replicas = vs(SAME_MESH, REPLICAS)
    if replicas is not None:
        print(f"  (restore same mesh / the verified read + its replica copies, the least a "
              f"restore onto 8 CPU devices must do: {replicas:.2f}x)")  # fmt: skip
    first = vs(SAME_MESH, FIRST_READ)
    if first is not None:
        fcpu = lim[FIRST_READ].cpu_per_gb
        cpu_ratio = f"{cpu['jaxckpt'][SAME_MESH] / fcpu:.2f}x" if fcpu > 0 else "-"
        print(f"  (restore same mesh / the first verified read + replicas in a fresh process, "
              f"the restore's own conditions: {first:.2f}x; CPU/GB {cpu_ratio})")  # fmt: skip
    warmer = vs("save", "write")
    if warmer is not None:
        print(f"  (save / the raw write on warmer memory, later in one process: {warmer:.2f}x)")
    for op in ["save", *RESTORES]:
        raw = lim[PLAIN_REF[op]].cpu_per_gb if PLAIN_REF[op] in lim else 0.0
        ratio = cpu["jaxckpt"][op] / raw if raw > 0 else None  # 0: under one clock tick
        name = f"{op} CPU/GB <= 1.3x raw {PLAIN_REF[op]}'s"
        _target(
            None if ratio is None else ratio <= 1.3,
            name,
            f"{'-' if ratio is None else f'{ratio:.2f}x':>9}",
        )


def _report_vs_fio(args, out: dict, speed: dict) -> None:
    """The save against fio's O_DIRECT write: the kind of I/O a save does by default on a
    disk filesystem (``direct_io=None``)."""
    direct = [f for f in out["fio"] or [] if f["rw"] == "write" and f["direct"] and f["gbps"]]
    if direct and "save" in speed["jaxckpt"]:  # what a save with O_DIRECT (the default) does
        best = max(direct, key=lambda f: f["gbps"])
        print(f"  (save / fio's O_DIRECT sequential write, {best['engine']}: "
              f"{speed['jaxckpt']['save'] / best['gbps']:.2f}x; the save writes with O_DIRECT "
              f"on {linux.filesystem(args.workdir)} by default: "
              f"{page_cache.direct_io(args.workdir, None)})")  # fmt: skip


def _report_async(out: dict, state_gb: float) -> None:
    """Manager async saves: blocking time (first save, and later ones) and total throughput,
    against the same manager's synchronous saves made beside them (``worker_async``)."""
    rows = {}
    for lib, runs in out["async"].items():
        first = harness.median(r["blocking"][0] for r in runs)
        later = harness.median(b for r in runs for b in r["blocking"][1:])
        total = harness.median(t for r in runs for t in r["total"])
        sync = [t for r in runs for t in r.get("sync_total", [])]
        pairs = [  # (orbax has no sync run: no pairs)
            s / a
            for r in runs
            if r.get("sync_total")
            for a, s in zip(r["total"], r["sync_total"], strict=True)
        ]
        rows[lib] = (
            first,
            later,
            state_gb / total,
            state_gb / harness.median(sync) if sync else None,
            harness.median(pairs) if pairs else None,
        )
    print()
    harness.Table(
        (("async manager save", "<24"), ("first block s", ">13.3f"))
        + (("later block s", ">15.3f"), ("total GB/s", ">12.3f"), ("sync GB/s", ">11.3f"))
        + (("async/sync", ">11.2f"),)
    ).print(("  " + lib, *row) for lib, row in rows.items())
    print("  (sync: a manager with async_save=False saving the same steps, alternating with "
          "the async one, each first in turn; GB/s from median times of all steps; async/sync: "
          "the median over steps of the sync save's time / the async save's total)")  # fmt: skip
    jx = rows["jaxckpt"]
    for i, save in [(1, "later saves"), (0, "first save")] if "orbax" in rows else []:
        ratio = jx[i] / rows["orbax"][i]
        _target(ratio <= 0.5, f"async blocking <= 0.5x orbax ({save})", f"{ratio:>8.2f}x")
    ratio = jx[4]
    _target(ratio >= 0.95, "async total throughput >= 0.95x sync save", f"{ratio:>8.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="state size in GB (default 1)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats per library (default 3)")
    ap.add_argument("--only", choices=["jaxckpt"], help="skip orbax")
    ap.add_argument(
        "--chunk-bytes",
        type=int,
        default=0,
        help="also run jaxckpt with save(chunk_bytes=N) and print its effect on each restore",
    )
    ap.add_argument(
        "--direct-read",
        choices=["on", "off", "both"],
        help=f"set {DIRECT_ENV}=1/0 in jaxckpt's restore workers; both: each restore both "
        "ways, alternating (default: the library's own choice)",
    )
    ap.add_argument(
        "--direct-write",
        choices=["both"],
        help=f"also save each repeat with {WRITE_ENV}=0 (TensorStore writes), beside the own "
        "writer's save",
    )
    ap.add_argument("--no-fio", action="store_true", help="skip fio even where it is installed")
    ap.add_argument(
        "--drop-page-cache-gb",
        type=float,
        default=0.0,
        help="also save a state of this size with and without drop_page_cache, alternating, "
        "and print the page cache's growth (the run of record: 2)",
    )
    ap.add_argument(
        "--page-reporting",
        choices=["off"],
        help="stop the kernel's free page reporting to the hypervisor for the run (root; put "
        "back after): fresh memory then costs what it costs on bare metal",
    )
    ap.add_argument("--json", help="also write the raw measurements to this JSON file")
    ap.add_argument(
        "--gpu-path",
        action="store_true",
        help="then bench/gpu_path.py at the same size and repeats: the path a GPU restore takes "
        "(no mappings, the host ring), its reads against the verified read on as many threads",
    )
    ap.add_argument(
        "--no-run-log", action="store_true", help="managers keep no run log (its cost: on vs off)"
    )
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    with (
        harness.page_reporting(args.page_reporting != "off"),
        harness.scratch() as args.workdir,
    ):
        order, kib = harness.reporting_order(), harness.reported_kib()
        out = orchestrate(args)
        after = harness.reported_kib()
        gpu = io.StringIO()  # (printed after this run's report, measured under its settings)
        if args.gpu_path:
            import gpu_path

            with contextlib.redirect_stdout(gpu):
                gpu_path.run(argparse.Namespace(
                    size_gb=args.size_gb, repeats=args.repeats, baseline_tree=None,
                    page_reporting=args.page_reporting or "on",
                ))  # fmt: skip
    out["page_reporting"] = {
        "order": order,
        "reported_kib": None if kib is None or after is None else after - kib,
    }
    out["no_fio"] = args.no_fio
    if args.json:
        harness.write_json(
            args.json, {"size_gb": args.size_gb, "state_bytes": state_bytes(args.size_gb), **out}
        )
    report(args, out)
    print(gpu.getvalue(), end="")


if __name__ == "__main__":
    harness.entry(main, worker)
