"""jaxckpt on one GPU: the bytes between the device, the host and the disk, against plain JAX
and the raw disk (issue 21's "bytes at the machine's limit", on an accelerator).

usage: python bench/gpu.py [--size-gb 2] [--repeats 3] [--dir /tmp] [--json out.json]
                           [--small-leaves 2000]

One process, the first device jax finds (on a CPU-only machine it says so and runs anyway:
the figures are then not GPU figures, since a CPU "device" buffer is host memory and most
copies below become views). The state is bench/train_state.py's train state at ``--size-gb``,
all of it on that one device. ``--repeats`` times, in an order that alternates, it times:

* device -> host: ``jax.device_get`` of the state into fresh NumPy arrays, and a batched
  ``jax.device_put`` into the device's pinned host memory (the link's speed), against
  jaxckpt's staging (``staging.describe`` + ``staging.snapshot``: the first, which
  allocates, and later ones), a ``CheckpointManager`` async save's blocking time, and an
  ``EmergencyCheckpointManager`` save's blocking time (replication=0, local directory under
  /dev/shm where it has room, else under ``--dir``);
* host -> device: ``jaxckpt.restore`` onto the device (the files in the page cache) against
  ``jax.device_put`` of NumPy arrays of the same bytes, against a verified read (CRC32C) of
  its own files into fresh memory on the reader threads' count, and against Orbax's restore
  of the same state (where orbax-checkpoint is installed); the same restore without the host
  ring (``JAXCKPT_RING=0``: fresh pageable memory a slice, the path before it), and cold
  (the files dropped from the page cache) against the cold verified read, and both against
  the same cold read with ``O_DIRECT`` (no page cache, where the file system allows it: what
  a restore that read cold files so would be measured against); the restores' peak host
  memory;
* the disk: ``jaxckpt.save`` and the async save's total against a raw NumPy write + fsync,
  and the restore against raw and verified (CRC32C) reads of the same bytes
  (``harness.raw_io``, bench/compare.py's limits).

Then ``--small-leaves`` leaves of 64x64 float32 (default 2000; 0 skips it), a state of
many small leaves, whose costs are per call, not per byte: ``jaxckpt.save`` against the
same save with a ``device_put`` into pinned memory per piece (how it read them before it
batched runs of small pieces), a ``CheckpointManager`` save's blocking time against
``jax.device_get``, and ``jaxckpt.restore`` against ``jax.device_put`` of the same NumPy
arrays; in seconds, medians of ``--repeats``, alternating.

Every operation that reads the state gets a fresh copy of it, made off the clock: jax keeps
an array's host copy once it has made one, so timing the same arrays again would time a
cache (a training loop saves new arrays each time). A warm-up of every operation runs
before the clock (a first manager save is reported apart:
it allocates the host buffers); the restored state is checked bit-exact once. GB/s of the
state's logical bytes from the median time; the ratio is to the row's reference.
Finishes within 10 minutes at 2 GB on one GPU; develop with ``--size-gb 0.05 --repeats 1``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
from collections.abc import Callable
from typing import Any
from unittest import mock

import harness
import jax
import numpy as np
import train_state as st
from harness import GB

import jaxckpt
from jaxckpt._src import ring, staging
from jaxckpt._src.io import ocdbt_write
from jaxckpt._src.io.direct import reader_threads

NO_GPU = "no GPU: running on CPU, figures are not GPU figures"
NO_RING = "restore, JAXCKPT_RING=0"  # fresh pageable memory a slice (before the ring)
COLD = "restore, cold"  # the checkpoint's files dropped from the page cache first
VERIFIED_FILES = "verified (its files)"  # the restore's own files, reader threads
COLD_VERIFIED = "cold verified (files)"
COLD_DIRECT = "cold O_DIRECT (files)"  # the same read with no page cache (where allowed)
ORBAX = "orbax restore"


def _orbax() -> Any:
    """Orbax's ``StandardCheckpointer`` where orbax-checkpoint is installed, else None."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        return None
    return ocp.StandardCheckpointer()


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: an operation's median seconds, held against ``reference``
    (another row's name, or a raw kind of ``harness.raw_io``), if any."""

    name: str
    seconds: list[float]
    reference: str | None = None


def device_summary() -> str:
    """The device measured, in words (or ``NO_GPU``)."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return NO_GPU
    limit = (dev.memory_stats() or {}).get("bytes_limit", 0)
    return (
        f"{dev.device_kind} ({dev.platform}, {limit / 2**30:.0f} GiB usable), jax {jax.__version__}"
    )


def fresh(tree: Any) -> Any:
    """A copy of ``tree``'s arrays on their devices, made now: new arrays, no host copy yet."""
    return jax.block_until_ready(jax.tree.map(lambda x: x.copy(), tree))


def local_root(parent: str, nbytes: int) -> str:
    """Where the emergency manager keeps its local steps: /dev/shm if it has room for three
    copies of the state, else ``parent``."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > 3 * nbytes:
        return shm
    return parent


def measure(args: argparse.Namespace, root: str) -> tuple[list[Row], dict, dict]:
    """Every operation, ``args.repeats`` times: the rows, the raw ways, and facts to print."""
    dev = jax.devices()[0]
    mesh = jax.sharding.Mesh(np.array([dev]).reshape(1, 1), st.AXES)
    state, crcs = st.build_state(args.size_gb, mesh)
    target = st.abstract_state(args.size_gb, mesh)
    shardings = jax.tree.map(lambda t: t.sharding, target)
    jax.block_until_ready(state)
    host = jax.device_get(state)  # fresh NumPy arrays of the same bytes, for device_put
    sizes = [int(np.prod(s)) * np.dtype(t).itemsize for _, s, t, _ in st.layout(args.size_gb)]
    nbytes = sum(sizes)
    buffers = staging.HostCopies()
    has_pinned = staging.has_pinned(
        dev
    )  # (without it the pinned rows would time a no-op: left out)
    pinned = jax.tree.map(
        lambda x: x.sharding.with_memory_kind("pinned_host") if has_pinned else x.sharding,
        state,
    )
    mgr = jaxckpt.CheckpointManager(
        os.path.join(root, "managed"), jaxckpt.Options(max_to_keep=None, run_log=False)
    )
    shm = local_root(root, nbytes)
    with harness.scratch("jaxckpt-gpu-local-", shm) as local:
        em = jaxckpt.EmergencyCheckpointManager(
            local,
            os.path.join(root, "em-remote"),
            jaxckpt.EmergencyOptions(
                local_interval_steps=1, local_max_to_keep=1, replication=0, run_log=False,
                remote=jaxckpt.Options(save_interval_steps=10**9),
            ),
        )  # fmt: skip
        times: dict[str, list[float]] = {}
        refused: dict[str, str] = {}  # ways the machine refused, with why

        def clock(name: str, fn: Callable[[], Any]) -> None:
            """``fn()``, and the device work it started, timed into ``times[name]``."""
            with harness.Clock() as c:
                jax.block_until_ready(fn())
            times.setdefault(name, []).append(c.seconds)

        def managed(m: Any, name: str, step: int) -> None:
            """A manager's save of a fresh state: until it returns, and until it is written.
            The manager keeps every step: the last one is deleted off the clock (retention's
            work, not the save's; ``jaxckpt.save``'s row deletes nothing on its clock)."""
            new = fresh(state)
            with harness.Clock() as total:
                with harness.Clock() as blocking:
                    m.save(step, new)
                m.wait_until_finished()
            if m is mgr and step - 1 in mgr.all_steps():
                mgr.delete(step - 1)
            times.setdefault(f"{name}, blocking", []).append(blocking.seconds)
            times.setdefault(f"{name}, total", []).append(total.seconds)

        ckpt = os.path.join(root, "ckpt")
        peaks: dict[str, int] = {}
        orbax, orbax_path = _orbax(), os.path.join(root, "orbax")
        if orbax is not None:  # saved once: only its restore is timed
            orbax.save(orbax_path, state)
            orbax.wait_until_finished()
        first = {}
        # warm-ups: one-time costs (imports, pools, compiles, first allocations) off the clock
        for m, name in ((mgr, "async save"), (em, "emergency save")):
            with harness.Clock() as c:
                m.save(1, state)
            first[name] = c.seconds
            m.wait_until_finished()
        new = fresh(state)
        with harness.Clock() as c:
            staging.snapshot(staging.describe(new), buffers)
        first["staging"] = c.seconds
        jax.block_until_ready(jax.device_put(fresh(state), pinned))
        jax.block_until_ready(jax.device_put(host, shardings))
        jaxckpt.save(ckpt, state)
        restored = jax.block_until_ready(jaxckpt.restore(ckpt, target))
        if st.leaf_crcs(restored) != crcs:
            raise RuntimeError(f"the state restored from {ckpt} differs from the one saved")
        del restored
        shutil.rmtree(ckpt)

        raw: dict[str, dict[str, list[dict]]] = {"write": {}, "read": {}, "verified": {}}

        def timed_fresh(name: str, fn: Callable[[Any], Any]) -> None:
            """``fn`` of a fresh copy of the state, timed (the copy is not)."""
            new = fresh(state)
            clock(name, lambda: fn(new))

        step = iter(range(2, 10**6))

        def save_restore(rep: int) -> None:
            """The save, then its files read back every way, alternating: restored (warm,
            through the ring and without it; cold), and read into fresh memory with a
            CRC32C on the reader threads' count (warm and cold)."""
            new = fresh(state)
            clock("jaxckpt.save", lambda: jaxckpt.save(ckpt, new))
            files = harness.files_under(ckpt)
            crc = harness.crc32c()[1]

            def restore(name: str, env: dict[str, str], cold: bool) -> None:
                harness.drop_cold(ckpt) if cold else harness.warm_page_cache(ckpt)
                with mock.patch.dict(os.environ, env), harness.PeakRss(cache=False) as rss:
                    clock(name, lambda: jaxckpt.restore(ckpt, target))
                peaks[name] = max(peaks.get(name, 0), rss.over)

            def verified(name: str, cold: bool, direct_io: bool = False) -> None:
                harness.drop_cold(ckpt) if cold else harness.warm_page_cache(ckpt)
                threads = reader_threads()
                try:
                    clock(
                        name, lambda: harness.read_files(files, threads, crc, None, (), direct_io)
                    )
                except OSError as e:  # a file system without O_DIRECT: that row is left out
                    refused.setdefault(name, str(e))

            ways = {
                "restore": lambda: restore("jaxckpt.restore", {}, False),
                "no ring": lambda: restore(NO_RING, {"JAXCKPT_RING": "0"}, False),
                "cold": lambda: restore(COLD, {}, True),
                "verified": lambda: verified(VERIFIED_FILES, False),
                "cold verified": lambda: verified(COLD_VERIFIED, True),
                "cold O_DIRECT": lambda: verified(COLD_DIRECT, True, direct_io=True),
            }
            for way in harness.rotated(list(ways), rep):
                ways[way]()
            shutil.rmtree(ckpt)

        def orbax_restore() -> None:
            if orbax is None:
                return
            harness.warm_page_cache(orbax_path)
            clock(ORBAX, lambda: orbax.restore(orbax_path, target))

        def raw_io(rep: int) -> None:
            got = harness.raw_io(os.path.join(root, "raw"), sizes, rep)
            for kind, ways in got.items():
                for way, rec in ways.items():
                    raw[kind].setdefault(way, []).append(rec)

        ops = {
            "device_get": lambda rep: timed_fresh("jax.device_get", jax.device_get),
            "pinned": lambda rep: (
                has_pinned and timed_fresh("pinned", lambda new: jax.device_put(new, pinned))
            ),
            "staging": lambda rep: timed_fresh(
                "staging", lambda new: staging.snapshot(staging.describe(new), buffers)
            ),
            "device_put": lambda rep: clock(
                "jax.device_put", lambda: jax.device_put(host, shardings)
            ),
            "save_restore": save_restore,
            "orbax": lambda rep: orbax_restore(),
            "async": lambda rep: managed(mgr, "async save", next(step)),
            "emergency": lambda rep: managed(em, "emergency save", next(step)),
            "raw": raw_io,
        }
        for rep in range(args.repeats):
            for name in harness.alternate(list(ops), rep):
                harness.log(f"repeat {rep + 1}/{args.repeats}: {name}")
                ops[name](rep)
        em.close()
    mgr.close()
    rows = [
        Row("d2h: jax.device_get", times["jax.device_get"]),
        *[Row("d2h: device_put to pinned_host", times["pinned"])] * has_pinned,
        Row("d2h: staging, first (allocates)", [first["staging"]], "d2h: jax.device_get"),
        Row("d2h: staging", times["staging"], "d2h: jax.device_get"),
        *[Row("d2h: staging", times["staging"], "d2h: device_put to pinned_host")] * has_pinned,
        Row("async save blocking, first", [first["async save"]], "d2h: jax.device_get"),
        Row("async save blocking", times["async save, blocking"], "d2h: jax.device_get"),
        Row("emergency save blocking, first", [first["emergency save"]], "d2h: jax.device_get"),
        Row("emergency save blocking", times["emergency save, blocking"], "d2h: jax.device_get"),
        Row("emergency save total", times["emergency save, total"]),
        Row("jaxckpt.save", times["jaxckpt.save"], "write"),
        Row("async save total", times["async save, total"], "write"),
        Row("h2d: jax.device_put", times["jax.device_put"]),
        Row("jaxckpt.restore", times["jaxckpt.restore"], "h2d: jax.device_put"),
        Row("jaxckpt.restore", times["jaxckpt.restore"], "read"),
        Row("jaxckpt.restore", times["jaxckpt.restore"], "verified"),
        Row(VERIFIED_FILES, times[VERIFIED_FILES]),
        Row("jaxckpt.restore", times["jaxckpt.restore"], VERIFIED_FILES),
        Row(NO_RING, times[NO_RING], VERIFIED_FILES),
        Row(COLD_VERIFIED, times[COLD_VERIFIED]),
        Row(COLD, times[COLD], COLD_VERIFIED),
        *[Row(COLD_DIRECT, times[COLD_DIRECT], COLD_VERIFIED), Row(COLD, times[COLD], COLD_DIRECT)]
        * (COLD_DIRECT in times),
        *[Row(ORBAX, times[ORBAX]), Row("jaxckpt.restore", times["jaxckpt.restore"], ORBAX)]
        * (ORBAX in times),
    ]
    facts = {"nbytes": nbytes, "leaves": len(sizes), "local": shm, "restore_peak_rss": peaks}
    facts["refused"] = refused
    facts["ring_bytes"] = ring._ring.capacity if ring._ring is not None else 0
    facts["ring_pinned"] = ring._ring is not None and ring._ring.pinned
    return rows, raw, facts


def measure_small(args: argparse.Namespace, root: str) -> list[Row]:
    """The many-small-leaves rows (see the module's docstring)."""
    dev = jax.devices()[0]
    rng = np.random.default_rng(0)
    host = {
        f"l{i:05d}": rng.standard_normal((64, 64), np.float32) for i in range(args.small_leaves)
    }
    state = jax.block_until_ready(jax.device_put(host, dev))
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    mgr = jaxckpt.CheckpointManager(
        os.path.join(root, "small-managed"), jaxckpt.Options(max_to_keep=1, run_log=False)
    )
    ckpt = os.path.join(root, "small")
    times: dict[str, list[float]] = {}
    step = iter(range(10**6))

    def clock(name: str, fn: Callable[[], Any]) -> None:
        with harness.Clock() as c:
            jax.block_until_ready(fn())
        times.setdefault(name, []).append(c.seconds)

    def save(name: str, piece_bytes: int) -> None:
        new, kept = fresh(state), ocdbt_write.SMALL_PIECE_BYTES
        ocdbt_write.SMALL_PIECE_BYTES = piece_bytes  # 0: a device_put per piece
        try:
            clock(name, lambda: jaxckpt.save(ckpt, new))
        finally:
            ocdbt_write.SMALL_PIECE_BYTES = kept
        harness.warm_page_cache(ckpt)
        clock("small: jaxckpt.restore", lambda: jaxckpt.restore(ckpt, target))
        shutil.rmtree(ckpt)

    def blocking() -> None:
        new = fresh(state)
        clock("small: async save blocking", lambda: mgr.save(next(step), new))
        mgr.wait_until_finished()

    def device_get() -> None:
        new = fresh(state)
        clock("small: jax.device_get", lambda: jax.device_get(new))

    ops = {
        "save": lambda: save("small: jaxckpt.save", ocdbt_write.SMALL_PIECE_BYTES),
        "save per piece": lambda: save("small: save, a copy per piece", 0),
        "blocking": blocking,
        "device_get": device_get,
        "device_put": lambda: clock("small: jax.device_put", lambda: jax.device_put(host, dev)),
    }
    jaxckpt.save(ckpt, state)
    out = jaxckpt.restore(ckpt, target)
    if any(np.asarray(out[k]).tobytes() != v.tobytes() for k, v in host.items()):
        raise RuntimeError(f"the small leaves restored from {ckpt} differ from those saved")
    shutil.rmtree(ckpt)
    for rep in range(args.repeats + 1):  # the first round warms up, off the record
        for name in harness.alternate(list(ops), rep):
            harness.log(f"small leaves, repeat {rep}/{args.repeats}: {name}")
            ops[name]()
        if rep == 0:
            times.clear()
    mgr.close()
    return [
        Row("small: jaxckpt.save", times["small: jaxckpt.save"], "small: save, a copy per piece"),
        Row("small: save, a copy per piece", times["small: save, a copy per piece"]),
        Row(
            "small: async save blocking",
            times["small: async save blocking"],
            "small: jax.device_get",
        ),
        Row("small: jax.device_get", times["small: jax.device_get"]),
        Row("small: jaxckpt.restore", times["small: jaxckpt.restore"], "small: jax.device_put"),
        Row("small: jax.device_put", times["small: jax.device_put"]),
    ]


def report_small(args: argparse.Namespace, rows: list[Row]) -> None:
    """The many-small-leaves table: median seconds, and the ratio of its reference's to the
    row's (above 1: faster than the reference)."""
    print(f"\n{args.small_leaves} leaves of 64x64 float32 on one device; medians of {args.repeats}")
    secs = {r.name: harness.median(r.seconds) for r in rows}
    table = harness.Table(
        (("operation", "<34"), ("seconds", ">9.3f"), ("against", ">30"), ("its s", ">9.3f"))
        + (("speed-up", ">9.2f"),)
    )
    table.print(
        [
            (
                r.name,
                secs[r.name],
                r.reference,
                secs.get(r.reference),
                secs[r.reference] / secs[r.name],
            )
            if r.reference
            else (r.name, secs[r.name], None, None, None)
            for r in rows
        ],
        rule=True,
    )


REFERENCE_NAMES = {  # the raw kinds, and the rows others are held against
    "write": "raw write + fsync",
    "read": "raw read",
    "verified": "verified read",
    "d2h: jax.device_get": "jax.device_get",
    "d2h: device_put to pinned_host": "to pinned_host",
    "h2d: jax.device_put": "jax.device_put",
}


def report(args: argparse.Namespace, rows: list[Row], raw: dict, facts: dict) -> None:
    nbytes = facts["nbytes"]
    best = harness.best_ways(raw, nbytes)
    rate = {r.name: harness.gbps(nbytes, r.seconds) for r in rows}
    print(f"\ndevice: {device_summary()}")
    print(
        f"state: {nbytes / GB:.3f} GB in {facts['leaves']} arrays on one device; "
        f"{args.repeats} repeats, GB/s of the state's bytes from median times (a first save: "
        f"one run); emergency local steps under {facts['local']}; CRC32C: "
        f"{harness.crc32c()[0]}; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}\n"
    )
    table = harness.Table(
        (("operation", "<34"), ("GB/s", ">9.3f"), ("seconds", ">9.3f"))
        + (("against", ">22"), ("its GB/s", ">9.3f"), ("ratio", ">7.2f"))
    )
    out_rows = []
    for r in rows:
        ref = r.reference
        if ref is None:
            ref_rate = None
        elif ref in rate:
            ref_rate = rate[ref]
        else:
            ref_rate = best[ref].gbps if ref in best else None
        label = REFERENCE_NAMES.get(ref, ref) if ref else None
        ratio = rate[r.name] / ref_rate if ref_rate else None
        out_rows.append((r.name, rate[r.name], harness.median(r.seconds), label, ref_rate, ratio))
    table.print(out_rows, rule=True)
    print()
    harness.print_ways(raw, nbytes, {kind: REFERENCE_NAMES[kind] for kind in raw})
    kept = facts["ring_bytes"] / GB
    how = "registered with the device's client (page-locked)" if facts["ring_pinned"] else (
        "pageable: not registered")  # fmt: skip
    print(f"\npinned host memory of the restores: the host ring, {kept:.3f} GB, {how}")
    for name, over in sorted(facts["restore_peak_rss"].items()):
        print(f"peak host memory of {name}: {over / GB:.3f} GB over its start (the ring, kept "
              f"since the warm-up's restore, not in it)")  # fmt: skip
    for name, why in facts["refused"].items():
        print(f"{name}: not measured, the file system refused it ({why})")
    print("\ntargets (issue 45):")
    for name, a, b, floor in (
        ("restore >= 0.8x the verified read of its files", "jaxckpt.restore", VERIFIED_FILES, 0.8),
        ("cold restore >= 0.8x the cold verified read", COLD, COLD_VERIFIED, 0.8),
        ("restore >= 3x Orbax's restore", "jaxckpt.restore", ORBAX, 3.0),
        ("restore with the ring / without it", "jaxckpt.restore", NO_RING, None),
    ):
        if a in rate and b in rate:
            r = rate[a] / rate[b]
            verdict = "     " if floor is None else ("PASS " if r >= floor else "FAIL ")
            print(f"  {verdict}{name:<52}{r:>6.2f}x")
    if jax.devices()[0].platform != "gpu":
        print(f"\n{NO_GPU}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="state size in GB (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="repeats (default 3)")
    ap.add_argument("--dir", default="/tmp", help="where checkpoints and raw files go (a disk)")
    ap.add_argument("--json", help="also write the measurements to this JSON file")
    ap.add_argument(
        "--small-leaves", type=int, default=2000, help="leaves of the small-leaves state (0: none)"
    )
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if jax.devices()[0].platform != "gpu":
        print(NO_GPU, flush=True)
    with harness.scratch("jaxckpt-gpu-bench-", args.dir) as root:
        rows, raw, facts = measure(args, root)
        small = measure_small(args, root) if args.small_leaves > 0 else []
    if args.json:
        data = {"device": device_summary(), "size_gb": args.size_gb, **facts, "raw": raw}
        data["rows"] = [dataclasses.asdict(r) for r in rows]
        data["small_leaves"] = args.small_leaves
        data["small_rows"] = [dataclasses.asdict(r) for r in small]
        harness.write_json(args.json, data)
    report(args, rows, raw, facts)
    if small:
        report_small(args, small)


if __name__ == "__main__":
    main()
