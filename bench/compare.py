"""jaxckpt vs Orbax: save / restore throughput, peak host memory and files per step.

Run from the repository root::

    python bench/compare.py --size-gb 1            # the full comparison (a few minutes)
    python bench/compare.py --size-gb 0.1          # quick smoke run
    python bench/compare.py --size-gb 0.1 --only jaxckpt   # skip Orbax
    python bench/compare.py --chunk-bytes 16777216        # and chunk_bytes=16 MiB vs default

What it does: builds a train-state-like pytree (params + Adam mu + nu, ~170 float32 arrays,
total about ``--size-gb`` GB) on a (4, 2) ('data', 'model') mesh of 8 virtual CPU devices
with mixed PartitionSpecs, then, ``--repeats`` times, alternating the libraries:

* sync save: ``jaxckpt.save`` vs ``ocp.StandardCheckpointer().save`` + ``wait_until_finished``
  (default options);
* restore with an explicit target of ShapeDtypeStructs onto the same (4, 2) mesh, onto a
  (2, 4) mesh and onto 4 devices as a (2, 2) mesh (``block_until_ready`` on the result;
  the page cache of the checkpoint's files is dropped first, and the result is checked
  bit-exact against the saved data after the clock stops);
* raw limits: the same bytes written with NumPy + fsync as one file and as per-array files
  on 2/4/8 threads, then read back into fresh memory; the best of these is the limit.

Every timed operation runs in a fresh subprocess (``--worker``), which measures its own
time and peak RSS over its baseline (save: with the state built; restore: state-free), so
memory freed by an earlier operation cannot hide a peak; a tiny warm-up save + restore runs
before the clock starts. On CPU devices every replica is host memory, so a restore is judged
against what the restored arrays occupy on the devices (replicas included) + 0.3 GB. The
first read after a write is often slow on a shared disk, so the order of the three restores
(and of the raw ways) rotates from repeat to repeat. Checkpoints go to a temporary directory
under /tmp, deleted as it goes. GB means 1e9 bytes.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import harness
from harness import GB

harness.cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

AXES = ("data", "model")
LAYERS = 6
RAW_THREADS = (2, 4, 8)
RESTORES = {  # operation -> (mesh shape, device count)
    "restore same mesh (4,2)": ((4, 2), 8),
    "restore mesh (2,4)": ((2, 4), 8),
    "restore 4 dev (2,2)": ((2, 2), 4),
}
SAME_MESH = "restore same mesh (4,2)"

# --- the state -----------------------------------------------------------------------------


def _width(size_gb: float) -> int:
    """Model width d (a multiple of 64) so params + mu + nu come to about size_gb."""
    per_d2 = 3 * 4 * (12 * LAYERS + 4)  # 3 trees, float32, 12 d^2 per layer + 4 d^2 embedding
    d = round((size_gb * GB / per_d2) ** 0.5 / 64) * 64
    return max(64, d)


def layout(size_gb: float) -> list[tuple[tuple[str, ...], tuple[int, ...], str, P]]:
    """(path, shape, dtype, spec) of every leaf of the train state."""
    d = _width(size_gb)
    params: list[tuple[tuple[str, ...], tuple[int, ...], P]] = [
        (("embed",), (4 * d, d), P(None, "model")),
        (("final_norm",), (d,), P()),
    ]
    for i in range(LAYERS):
        layer = f"layer_{i}"
        params += [
            ((layer, "attn", "q"), (d, d), P("data", "model")),
            ((layer, "attn", "k"), (d, d), P(None, "model")),
            ((layer, "attn", "v"), (d, d), P("data", None)),
            ((layer, "attn", "o"), (d, d), P("model", "data")),
            ((layer, "mlp", "up"), (d, 4 * d), P("data", "model")),
            ((layer, "mlp", "up_bias"), (4 * d,), P("model")),
            ((layer, "mlp", "down"), (4 * d, d), P("model", "data")),
            ((layer, "ln1", "scale"), (d,), P()),
            ((layer, "ln2", "scale"), (d,), P()),
        ]
    out = [(("step",), (), "int32", P())]
    for tree in (("params",), ("opt_state", "mu"), ("opt_state", "nu")):
        out += [(tree + path, shape, "float32", spec) for path, shape, spec in params]
    out.append((("opt_state", "count"), (), "int32", P()))
    return out


def _nest(items):
    """Nested dicts from (path, value) pairs."""
    root: dict = {}
    for path, value in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return root


def _leaf_name(path: tuple[str, ...]) -> str:
    return "/".join(path)


def state_bytes(size_gb: float) -> int:
    return sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t, _ in layout(size_gb))


def make_mesh(shape: tuple[int, int], devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]).reshape(shape), AXES)


def build_state(size_gb: float, mesh: Mesh) -> tuple[dict, dict[str, int]]:
    """The sharded state and the CRC32 of each leaf's bytes."""
    leaves, crcs = [], {}
    for i, (path, shape, dtype, spec) in enumerate(layout(size_gb)):
        rng = np.random.default_rng(i)
        if dtype == "int32":
            host = np.asarray(rng.integers(0, 1 << 20), dtype=np.int32).reshape(shape)
        else:
            host = rng.standard_normal(shape, dtype=np.float32)
        crcs[_leaf_name(path)] = zlib.crc32(host)
        sharding = NamedSharding(mesh, spec)
        arr = jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx].copy())
        leaves.append((path, arr))
    return _nest(leaves), crcs


def abstract_state(size_gb: float, mesh: Mesh) -> dict:
    return _nest(
        (path, jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, spec)))
        for path, shape, dtype, spec in layout(size_gb)
    )


def device_bytes(tree: dict) -> int:
    """Bytes the tree takes on its devices, every replica counted (host memory on CPU)."""
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape)))
        * x.dtype.itemsize
        * len(x.sharding.device_set)
        for x in jax.tree.leaves(tree)
    )


def leaf_crcs(tree: dict) -> dict[str, int]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(k.key for k in path): zlib.crc32(np.ascontiguousarray(np.asarray(x)))
        for path, x in flat
    }


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))


# --- the libraries -------------------------------------------------------------------------


class Jaxckpt:
    def __init__(self, chunk_bytes: int | None = None):
        import jaxckpt

        self.lib, self.chunk_bytes = jaxckpt, chunk_bytes

    def save(self, path: str, tree) -> None:
        self.lib.save(path, tree, chunk_bytes=self.chunk_bytes)

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


def make_lib(args):
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
    with harness.PeakRss() as rss:
        t0 = time.perf_counter()
        lib.save(args.path, state)
        seconds = time.perf_counter() - t0
    lib.close()
    return {
        "seconds": seconds,
        "rss_over": rss.over,
        "baseline": rss.baseline,
        "device_bytes": device_bytes(state),
        "crcs": crcs,
    }


def worker_async(args) -> dict:
    """Blocking time of a manager's async save, first save and later saves (same buffers)."""
    mesh = make_mesh((4, 2), 8)
    state, _ = build_state(args.size_gb, mesh)
    jax.block_until_ready(state)
    if args.lib == "jaxckpt":
        import jaxckpt

        opts = jaxckpt.Options(max_to_keep=1, run_log=not args.no_run_log)
        mgr = jaxckpt.CheckpointManager(args.path, opts)

        def save(step):
            mgr.save(step, state)

    else:
        import orbax.checkpoint as ocp

        opts = ocp.CheckpointManagerOptions(max_to_keep=1, enable_async_checkpointing=True)
        mgr = ocp.CheckpointManager(args.path, options=opts)

        def save(step):
            mgr.save(step, args=ocp.args.StandardSave(state))

    blocking, total = [], []
    for step in range(4):
        t0 = time.perf_counter()
        save(step)
        blocking.append(time.perf_counter() - t0)
        mgr.wait_until_finished()
        total.append(time.perf_counter() - t0)
    mgr.close()
    return {"blocking": blocking, "total": total}


def worker_restore(args) -> dict:
    mesh = make_mesh(tuple(args.mesh), args.devices)
    lib = make_lib(args)
    warm_up(lib, mesh, args.workdir)
    target = abstract_state(args.size_gb, mesh)
    harness.drop_page_cache(args.path)
    with harness.PeakRss() as rss:
        t0 = time.perf_counter()
        restored = jax.block_until_ready(lib.restore(args.path, target))
        seconds = time.perf_counter() - t0
    lib.close()
    shardings_ok = all(
        r.sharding == t.sharding and r.shape == t.shape and r.dtype == t.dtype
        for r, t in zip(jax.tree.leaves(restored), jax.tree.leaves(target), strict=True)
    )
    return {
        "seconds": seconds,
        "rss_over": rss.over,
        "baseline": rss.baseline,
        "device_bytes": device_bytes(target),
        "crcs": leaf_crcs(restored),
        "shardings_ok": shardings_ok,
    }


def _write_file(path: str, arrays: list[np.ndarray]) -> None:
    with open(path, "wb") as f:
        for a in arrays:
            f.write(memoryview(a).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def _read_file(path: str, sizes: list[int]) -> list[np.ndarray]:
    out = []
    with open(path, "rb", buffering=0) as f:
        for n in sizes:
            buf = np.empty(n, np.uint8)
            if f.readinto(memoryview(buf)) != n:
                raise OSError(f"short read from {path}")
            out.append(buf)
    return out


def _filled(n: int, block: np.ndarray) -> np.ndarray:
    out = np.empty(n, np.uint8)
    for start in range(0, n, block.size):
        out[start : start + block.size] = block[: n - start]
    return out


def worker_raw(args) -> dict:
    """NumPy write + fsync and read into fresh memory of the state's bytes, several ways.

    One file written / read by one thread, or one file per array on 2, 4 or 8 threads; the
    order of the ways rotates with ``--rotate`` so none always comes first.
    """
    sizes = [int(np.prod(s)) * np.dtype(t).itemsize for _, s, t, _ in layout(args.size_gb)]
    block = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8)
    arrays = [_filled(n, block) for n in sizes]
    os.makedirs(args.path)
    one = os.path.join(args.path, "one.bin")
    per_array = [os.path.join(args.path, f"a{i}.bin") for i in range(len(sizes))]
    ways = harness.rotated([1, *RAW_THREADS], args.rotate)
    name = {n: "1 file" if n == 1 else f"{len(sizes)} files, {n} threads" for n in ways}
    write, read = {}, {}
    for n in ways:
        if n > 1:
            for p in per_array:
                if os.path.exists(p):
                    os.remove(p)
        t0 = time.perf_counter()
        if n == 1:
            _write_file(one, arrays)
        else:
            with ThreadPoolExecutor(n) as pool:
                list(pool.map(lambda p, a: _write_file(p, [a]), per_array, arrays))
        write[name[n]] = time.perf_counter() - t0
    del arrays
    for n in ways:
        gc.collect()
        harness.drop_page_cache(args.path)
        t0 = time.perf_counter()
        if n == 1:
            got = _read_file(one, sizes)
        else:
            with ThreadPoolExecutor(n) as pool:
                got = list(pool.map(lambda p, s: _read_file(p, [s]), per_array, sizes))
        read[name[n]] = time.perf_counter() - t0
        del got
    shutil.rmtree(args.path)
    return {"write": write, "read": read}


WORKERS = {"async": worker_async, "save": worker_save, "restore": worker_restore, "raw": worker_raw}


# --- the parent: orchestration and report --------------------------------------------------


def worker(op: str, **kw) -> dict:
    return WORKERS[op](argparse.Namespace(**kw))


def run_worker(args, op: str, **kw) -> dict:
    common = {"size_gb": args.size_gb, "workdir": args.workdir, "chunk_bytes": args.chunk_bytes,
              "no_run_log": args.no_run_log}  # fmt: skip
    return harness.run_worker(__file__, op=op, **common, **kw)


def orchestrate(args) -> dict:
    libs = ["jaxckpt"] if args.only == "jaxckpt" else ["jaxckpt", "orbax"]
    libs += [CHUNKED] if args.chunk_bytes else []
    res: dict = {lib: {op: [] for op in ["save", *RESTORES]} for lib in libs}
    files = {lib: [] for lib in libs}
    raw: dict = {"write": {}, "read": {}}
    bad: list[str] = []
    asyncs: dict = {}
    load = [os.getloadavg()[0]]
    for rep in range(args.repeats):
        harness.log(f"repeat {rep + 1}/{args.repeats}: raw")
        r = run_worker(args, "raw", path=os.path.join(args.workdir, "raw"), rotate=rep)
        for kind in ("write", "read"):
            for cfg, s in r[kind].items():
                raw[kind].setdefault(cfg, []).append(s)
        for lib in harness.alternate(libs, rep):
            path = os.path.join(args.workdir, f"{lib}-{rep}")
            harness.log(f"repeat {rep + 1}/{args.repeats}: {lib} save")
            saved = run_worker(args, "save", lib=lib, path=path)
            res[lib]["save"].append(saved)
            files[lib].append(count_files(path))
            # The first read after a write is often slow on a shared disk: rotate which goes first.
            for op in harness.rotated(list(RESTORES), rep):
                shape, devices = RESTORES[op]
                harness.log(f"repeat {rep + 1}/{args.repeats}: {lib} {op}")
                got = run_worker(args, "restore", lib=lib, path=path, mesh=shape, devices=devices)
                res[lib][op].append(got)
                if got["crcs"] != saved["crcs"] or not got["shardings_ok"]:
                    bad.append(f"{lib} {op} repeat {rep + 1}")
            shutil.rmtree(path)
            if lib == CHUNKED:
                continue
            harness.log(f"repeat {rep + 1}/{args.repeats}: {lib} async manager save")
            got = run_worker(args, "async", lib=lib, path=path)
            asyncs.setdefault(lib, []).append(got)
            shutil.rmtree(path, ignore_errors=True)
        load.append(os.getloadavg()[0])
    return {
        "libs": libs,
        "results": res,
        "files": files,
        "raw": raw,
        "bad": bad,
        "load": load,
        "async": asyncs,
    }


def _target(ok: bool | None, name: str, figure: str) -> None:
    print(f"  {harness.verdict(ok):<5}{name:<52}{figure}")


def report(args, out: dict) -> None:
    nbytes = state_bytes(args.size_gb)
    libs, res = out["libs"], out["results"]
    ops = ["save", *RESTORES]
    orbax = "orbax" in libs

    def gbps(seconds: list[float]) -> float:
        return harness.gbps(nbytes, seconds)

    raw = {
        kind: {cfg: gbps(s) for cfg, s in out["raw"][kind].items()} for kind in ("write", "read")
    }
    best = {kind: max(raw[kind].items(), key=lambda kv: kv[1]) for kind in raw}
    speed = {lib: {op: gbps([r["seconds"] for r in res[lib][op]]) for op in ops} for lib in libs}
    peak = {lib: {op: max(r["rss_over"] for r in res[lib][op]) / GB for op in ops} for lib in libs}
    # On CPU devices every replica lives in host memory, so a restored state takes more RSS
    # than its logical size: the restore budget is what the result itself occupies + 0.3 GB.
    on_devices = {op: res["jaxckpt"][op][0]["device_bytes"] / GB for op in ops}
    nfiles = {lib: max(out["files"][lib]) for lib in libs}

    print(
        f"\nstate: {nbytes / GB:.3f} GB logical ({on_devices['save']:.3f} GB with the replicas "
        f"on the 8 CPU devices), {len(layout(args.size_gb))} float32/int32 arrays, d="
        f"{_width(args.size_gb)}, saved from a (4,2) mesh; {args.repeats} repeats: GB/s of "
        f"logical bytes from median times, peak RSS over baseline from the worst repeat; "
        f"load average {' -> '.join(f'{x:.1f}' for x in out['load'])} on {os.cpu_count()} cores\n"
    )
    table = harness.Table(
        (("operation", "<24"), ("jaxckpt GB/s", ">13.3f"), ("orbax GB/s", ">11.3f"))
        + (("jx/orbax", ">9.2f"), ("jx/raw", ">8.2f"), ("jx RSS+ GB", ">11.3f"))
        + (("orbax RSS+ GB", ">14.3f"), ("result GB", ">10.3f"))
    )
    print(table.head(rule=True))
    for op in ops:
        jx, ob = speed["jaxckpt"][op], speed["orbax"][op] if orbax else None
        limit = best["write" if op == "save" else "read"][1]
        ob_peak, result = peak["orbax"][op] if orbax else None, on_devices[op]
        cells = (op, jx, ob, ob and jx / ob, jx / limit, peak["jaxckpt"][op], ob_peak)
        print(table.row(*cells, None if op == "save" else result))
    files = [str(nfiles[lib]) if lib in nfiles else None for lib in ("jaxckpt", "orbax")]
    print(table.row("files per step", *files))
    if CHUNKED in libs:
        print(f"\nchunk_bytes={args.chunk_bytes} vs the default (chunks follow the shards):")
        for op in ops:
            ch, jx = speed[CHUNKED][op], speed["jaxckpt"][op]
            print(f"  {op:<22}{ch:>8.3f} GB/s vs {jx:.3f}: {ch / jx:.2f}x")
    print("\nspread (GB/s, min..max over repeats):")
    for lib in libs:
        spread = []
        for op in ops:
            rates = [nbytes / GB / r["seconds"] for r in res[lib][op]]
            spread.append(f"{op.removeprefix('restore ')} {min(rates):.2f}..{max(rates):.2f}")
        print(f"  {lib}: " + "; ".join(spread))
    for kind in ("write", "read"):
        print(
            f"raw {kind} (median GB/s): " + ", ".join(f"{c} {v:.3f}" for c, v in raw[kind].items())
        )
        print(f"  limit = best: {best[kind][1]:.3f} GB/s ({best[kind][0]})")
    if out["bad"]:
        print("RESTORED DATA MISMATCH: " + "; ".join(out["bad"]))
    else:
        print(
            "every restore verified bit-exact against the saved data, with the target's shardings"
        )

    print("\ntargets (jaxckpt)")
    jx = speed["jaxckpt"]

    def vs_orbax(op: str) -> float | None:
        return jx[op] / speed["orbax"][op] if orbax else None

    rows: list[tuple[str, float | None, float]] = [
        ("save >= 3x orbax", vs_orbax("save"), 3.0),
        ("save >= 0.6x raw write", jx["save"] / best["write"][1], 0.6),
        ("restore same mesh >= 0.9x raw read", jx[SAME_MESH] / best["read"][1], 0.9),
        ("restore same mesh >= 1.2x orbax", vs_orbax(SAME_MESH), 1.2),
    ]
    for op in RESTORES:
        if op != SAME_MESH:
            rows.append((f"{op} >= 0.8x our same mesh", jx[op] / jx[SAME_MESH], 0.8))
            rows.append((f"{op} >= 1.2x orbax", vs_orbax(op), 1.2))
    for name, ratio, need in rows:
        ok = None if ratio is None else ratio >= need
        _target(ok, name, f"{'-' if ratio is None else f'{ratio:.2f}x':>9}")
    limits = [("save peak RSS <= 0.3 GB over the state", peak["jaxckpt"]["save"], 0.3)]
    limits += [
        (f"{op} peak RSS <= result + 0.3 GB", peak["jaxckpt"][op], on_devices[op] + 0.3)
        for op in RESTORES
    ]
    for name, value, cap in limits:
        _target(value <= cap, name, f"{value:>8.3f} GB (limit {cap:.3f})")
    _report_async(out, speed["jaxckpt"]["save"], state_bytes(args.size_gb) / GB)
    n, cap = nfiles["jaxckpt"], 8 + 4 * 1
    _target(n <= cap, "files per step <= 8 + 4 x processes", f"{n:>8} (limit {cap})")


def _report_async(out: dict, sync_gbps: float, state_gb: float) -> None:
    """Manager async saves: blocking time (first save, and later ones) and total throughput."""
    rows = {}
    for lib, runs in out["async"].items():
        first = harness.median(r["blocking"][0] for r in runs)
        later = harness.median(b for r in runs for b in r["blocking"][1:])
        total = harness.median(t for r in runs for t in r["total"][1:])
        rows[lib] = (first, later, state_gb / total)
    print()
    harness.Table(
        (("async manager save", "<24"), ("first block s", ">13.3f"))
        + (("later block s", ">15.3f"), ("total GB/s", ">12.3f"))
    ).print(("  " + lib, *row) for lib, row in rows.items())
    jx = rows["jaxckpt"]
    for i, save in [(1, "later saves"), (0, "first save")] if "orbax" in rows else []:
        ratio = jx[i] / rows["orbax"][i]
        _target(ratio <= 0.5, f"async blocking <= 0.5x orbax ({save})", f"{ratio:>8.2f}x")
    ratio = jx[2] / sync_gbps
    _target(ratio >= 1.0, "async total throughput >= sync save", f"{ratio:>8.2f}x")


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
    ap.add_argument("--json", help="also write the raw measurements to this JSON file")
    ap.add_argument(
        "--no-run-log", action="store_true", help="managers keep no run log (its cost: on vs off)"
    )
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    with harness.scratch() as args.workdir:
        out = orchestrate(args)
    if args.json:
        harness.write_json(
            args.json, {"size_gb": args.size_gb, "state_bytes": state_bytes(args.size_gb), **out}
        )
    report(args, out)


if __name__ == "__main__":
    harness.entry(main, worker)
