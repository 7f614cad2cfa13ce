"""One process of ``bench/scale.py``'s jobs: a data-parallel state through every multi-process
path of jaxckpt, each timed by phase, and the same moves made without jaxckpt beside them.

The phases come from jaxckpt's own ``Figures`` (save: write, commit; restore: plan, read,
move; emergency restore: plan, read, move, place) and from ``multihost.coordination_stats``
(key-value calls and barriers). More are timed here by wrapping the library's own functions
for the length of the job (``timing_hooks``: no library code changed): the merge of the
per-process databases (``arrays.merge``), the manifest built and serialized
(``saving.manifest_of`` + ``Manifest.to_json``), the placement of read slices as one
``jax.Array`` (``Placement.array``), and the CPU seconds of the reads (``slices.read``) and
of the move (``read_once.move``). From jax's monitoring events: XLA compile time, and the
emergency tier's writer-thread figures (``/jaxckpt/emergency_write/...``).

The reference moves use the same processes, bytes and shardings with jax, the coordination
service's client and ``os.preadv`` directly.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import harness
import numpy as np

SMALL_LEAVES = 40
PARAMS = 8
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
HOOKED: dict[str, float] = {
    "merge": 0.0,
    "manifest": 0.0,
    "place": 0.0,
    "compile": 0.0,
    "read_cpu": 0.0,  # CPU seconds of this process (every thread) while it reads slices
    "move_cpu": 0.0,  # ... while it moves read-once leaves between processes
    "ew_write": 0.0,  # the emergency tier's local step written on its writer thread
    "ew_peer_wait": 0.0,  # ... and waiting there for the peer copies
}


def _added(name: str, fn: Callable, cpu: bool = False) -> Callable:
    """``fn`` with its wall seconds (or with ``cpu``, the process's CPU seconds while it
    ran) added to ``HOOKED[name]``."""
    clock = harness.cpu_seconds if cpu else time.perf_counter

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            HOOKED[name] += clock() - t

    return timed


def timing_hooks() -> None:
    """Times merge, manifest and place by wrapping the functions jaxckpt calls for them
    (module attributes looked up at call time), and compiles through jax.monitoring."""
    import jax

    from jaxckpt._src import manifest, placement, read_once, restoring, saving
    from jaxckpt._src.io import arrays

    arrays.merge = _added("merge", arrays.merge)
    saving.manifest_of = _added("manifest", saving.manifest_of)
    manifest.Manifest.to_json = _added("manifest", manifest.Manifest.to_json)
    placement.Placement.array = _added("place", placement.Placement.array)
    restoring.slices.read = _added("read_cpu", restoring.slices.read, cpu=True)
    read_once.move = _added("move_cpu", read_once.move, cpu=True)

    def on_event(event: str, secs: float, **kwargs: Any) -> None:
        if event in COMPILE_EVENTS:
            HOOKED["compile"] += secs
        elif event.startswith("/jaxckpt/emergency_write/"):  # (its writer thread's figures)
            phase = event.rsplit("/", 1)[-1].removesuffix("_secs")
            if "ew_" + phase in HOOKED:
                HOOKED["ew_" + phase] += secs

    jax.monitoring.register_event_duration_secs_listener(on_event)


@contextlib.contextmanager
def measured(out: dict[str, dict], op: str, figures: Callable[[], Any]) -> Iterator[None]:
    """Times the block as ``op``: wall and CPU seconds, coordination seconds, the hooked
    phases, and the phases of the ``Figures`` that ``figures()`` gives afterwards."""
    from jaxckpt._src import multihost

    multihost.coordination_stats(reset=True)
    HOOKED.update(dict.fromkeys(HOOKED, 0.0))
    with harness.Clock() as clock:
        yield
    st = multihost.coordination_stats()
    fig = figures()
    rec = {"total": clock.seconds, "cpu": clock.cpu, "kv": st["kv_s"], "barrier": st["barrier_s"]}
    rec["protocol"] = st["protocol_s"]
    rec.update(HOOKED)
    rec.update(dict(fig.phases) if fig is not None else {})
    out[op] = rec


# --- the state: values that depend on the global position only ------------------------------


def _bits(index: tuple[slice, ...], shape: tuple[int, ...], seed: int) -> np.ndarray:
    """float32 random-looking bit patterns (NaN payloads included) at ``index`` of a leaf
    of ``shape``: the same for any sharding and process count."""
    ranges = [np.arange(*s.indices(d), dtype=np.uint64) for s, d in zip(index, shape, strict=True)]
    flat = ranges[0] if len(shape) == 1 else ranges[0][:, None] * shape[1] + ranges[1][None, :]
    mixed = (flat * np.uint64(2654435761) + np.uint64(seed * 40503 + 1)) % np.uint64(1 << 32)
    return (mixed ^ (mixed >> np.uint64(13))).astype(np.uint32).view(np.float32)


def layout(mib: float) -> dict[str, tuple[tuple[int, ...], bool]]:
    """{leaf: (shape, replicated)}: 8 parameters replicated over every device (3/4 of the
    bytes), an optimizer-state-like leaf sharded over every device, 40 small replicated
    leaves; as a data-parallel job holds them."""
    total = int(mib * (1 << 20))
    cols = 1024
    rows = max(16, int(0.75 * total) // (PARAMS * 4 * cols) // 16 * 16)
    flat = max(1 << 14, int(0.25 * total) // 4 // (1 << 14) * (1 << 14))
    out = {f"w{i}": ((rows, cols), True) for i in range(PARAMS)}
    out["opt"] = ((flat,), False)
    out.update({f"b{i}": ((256,), True) for i in range(SMALL_LEAVES)})
    return out


def shardings(mesh: Any, mib: float) -> dict[str, Any]:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return {
        k: NamedSharding(mesh, P() if rep else P("data")) for k, (_, rep) in layout(mib).items()
    }


def state(mesh: Any, mib: float) -> dict[str, Any]:
    import jax

    shs = shardings(mesh, mib)
    return {
        k: jax.make_array_from_callback(
            shape, shs[k], lambda i, shape=shape, s=seed: _bits(i, shape, s)
        )
        for seed, (k, (shape, _)) in enumerate(layout(mib).items())
    }


def target(mesh: Any, mib: float) -> dict[str, Any]:
    import jax

    shs = shardings(mesh, mib)
    return {
        k: jax.ShapeDtypeStruct(shape, np.float32, sharding=shs[k])
        for k, (shape, _) in layout(mib).items()
    }


def mismatches(out: dict[str, Any], mib: float) -> list[str]:
    """The leaves whose shards on this process differ from the saved bytes."""
    bad = []
    for seed, (k, (shape, _)) in enumerate(layout(mib).items()):
        for shard in out[k].addressable_shards:
            got = np.asarray(shard.data).view(np.uint32)
            if not np.array_equal(got, _bits(shard.index, shape, seed).view(np.uint32)):
                bad.append(k)
                break
    return bad


# --- the reference moves, without jaxckpt --------------------------------------------------


def _median_s(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def reference_coordination(tag: str, repeats: int) -> dict[str, float]:
    """A key-value round as jaxckpt's ``all_gather`` makes it (set, barrier, directory
    listing) and a bare barrier, through the coordination service's client: median s."""
    from jaxckpt._src import multihost

    client, pid = multihost.client(), multihost.process_index()
    rounds = iter(range(10**6))

    def kv_round() -> None:
        r = next(rounds)
        client.key_value_set(f"ref/{tag}/kv{r}/{pid}", "x" * 64)
        client.wait_at_barrier(f"ref/{tag}/kvb{r}", 60_000)
        client.key_value_dir_get(f"ref/{tag}/kv{r}/")

    def bare() -> None:
        client.wait_at_barrier(f"ref/{tag}/b{next(rounds)}", 60_000)

    bare()  # the first call of each kind connects nothing new, but warms the paths
    return {"ref_kv_round": _median_s(kv_round, repeats), "ref_barrier": _median_s(bare, repeats)}


def reference_move(mesh: Any, mib: float) -> dict[str, float]:
    """The read-once move without jaxckpt: the parameters' bytes (uint32), each process
    holding 1/N of each, put onto every device with ``jax.device_put`` (first call, with
    its compile, then warm), and broadcast from process 0 by ``multihost_utils``."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    params = {k: shape for k, (shape, rep) in layout(mib).items() if rep and len(shape) == 2}
    split, whole = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    out: dict[str, float] = {}

    def parts() -> list[jax.Array]:
        # int32, not the uint32 jaxckpt moves float32 as: a program of jaxckpt's restore
        # must not make the first call here a warm one
        return [
            jax.make_array_from_callback(s, split, lambda i, s=s: np.zeros(s, np.int32)[i])
            for s in params.values()
        ]

    for label in ("ref_move_first", "ref_move_warm"):
        xs = parts()
        jax.block_until_ready(xs)
        multihost_utils.sync_global_devices(label)
        HOOKED["compile"] = 0.0
        with harness.Clock() as clock:
            for x in xs:  # one at a time, finished before the next, as bits.transfer moves
                jax.block_until_ready(jax.device_put(x, whole))
        out[label], out[label + "_cpu"] = clock.seconds, clock.cpu
        out[label + "_compile"] = HOOKED["compile"]
    if jax.process_count() > 1:
        host = np.zeros(next(iter(params.values())), np.uint32)
        multihost_utils.broadcast_one_to_all(host)  # compiled once
        multihost_utils.sync_global_devices("broadcast")
        t = time.perf_counter()
        for _ in params:
            multihost_utils.broadcast_one_to_all(host)
        out["ref_broadcast"] = time.perf_counter() - t
    return out


def reference_read(path: str) -> dict[str, float]:
    """This process's 1/N of the bytes of the checkpoint's files, read cold with
    ``os.preadv`` into fresh memory (the share a read-once restore reads)."""
    import jax
    from jax.experimental import multihost_utils

    pid, n = jax.process_index(), jax.process_count()
    files = [(f, os.path.getsize(f)) for f in harness.files_under(path)]
    total = sum(size for _, size in files)
    lo, hi = total * pid // n, total * (pid + 1) // n
    harness.drop_page_cache(path)
    multihost_utils.sync_global_devices("ref_read")
    t, at = time.perf_counter(), 0
    for name, size in files:
        start, stop = max(lo, at), min(hi, at + size)
        if start < stop:
            buf = np.empty(stop - start, np.uint8)
            fd = os.open(name, os.O_RDONLY)
            try:
                done = 0
                while done < buf.size:
                    done += os.preadv(fd, [memoryview(buf)[done:]], start - at + done)
            finally:
                os.close(fd)
        at += size
    return {"ref_read": time.perf_counter() - t, "ref_read_bytes": float(hi - lo)}


# --- the job -------------------------------------------------------------------------------


def worker(root: str, mib: float, previous: str, repeats: int) -> dict:
    """One process: save, restore (same count, and ``previous``: a checkpoint another
    process count saved), CheckpointManager, EmergencyCheckpointManager with the last
    process's local directory wiped, then the reference moves. Returns {op: figures}."""
    import jax
    from jax.experimental import multihost_utils

    import jaxckpt
    from jaxckpt._src import monitoring

    pid, n = jax.process_index(), jax.process_count()
    os.environ["JAXCKPT_HOST"] = f"scale-host{pid}"  # every process its own machine
    timing_hooks()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    s = state(mesh, mib)
    jax.block_until_ready(s)
    out: dict[str, dict] = {}
    bad: dict[str, list[str]] = {}

    def sync(name: str) -> None:
        multihost_utils.sync_global_devices(name)

    ckpt = os.path.join(root, "ckpt")
    HOOKED["compile"] = 0.0
    t = time.perf_counter()
    sync("start")  # the job's first collective: gloo connects the processes, psum compiles
    first_sync, first_compile = time.perf_counter() - t, HOOKED["compile"]
    with measured(out, "save", lambda: monitoring.last("save")):
        jaxckpt.save(ckpt, s)
    restores = [("restore", ckpt)] + ([("restore_other", previous)] if previous else [])
    for op, path in restores:
        harness.drop_page_cache(path)
        sync(op)
        with measured(out, op, lambda: monitoring.last("restore")):
            got = jaxckpt.restore(path, target=target(mesh, mib))
            jax.block_until_ready(got)
        bad[op] = mismatches(got, mib)
        del got
    # the same restore again in this job: its programs compiled, the host names known
    harness.drop_page_cache(ckpt)
    sync("restore_again")
    with measured(out, "restore_again", lambda: monitoring.last("restore")):
        jax.block_until_ready(jaxckpt.restore(ckpt, target=target(mesh, mib)))

    with jaxckpt.CheckpointManager(os.path.join(root, "managed")) as mgr:
        sync("manager")
        with measured(out, "manager_save", lambda: mgr.last_save_figures):
            mgr.save(1, s)
            mgr.wait_until_finished()
        sync("manager_restore")
        with measured(out, "manager_restore", lambda: monitoring.last("restore")):
            got = mgr.restore(1, target=target(mesh, mib))
            jax.block_until_ready(got)
        bad["manager_restore"] = mismatches(got, mib)
        del got

    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1,
        replication=1 if n > 1 else 0,
        timeout_s=120,
        remote=jaxckpt.Options(save_interval_steps=1000, max_to_keep=2, timeout_s=120),
    )
    local, remote = os.path.join(root, f"local{pid}"), os.path.join(root, "remote")
    with jaxckpt.EmergencyCheckpointManager(local, remote, opts) as em:
        sync("emergency")
        with measured(out, "emergency_save", lambda: em.last_save_figures):
            em.save(1, s)
            em.wait_until_finished()
    sync("emergency_saved")
    if pid == n - 1 and n > 1:
        shutil.rmtree(local)  # this host lost its disk: its slices come from peer copies
    sync("wiped")
    with jaxckpt.EmergencyCheckpointManager(local, remote, opts) as em:
        with measured(out, "emergency_restore", lambda: em.last_restore_figures):
            got = em.restore(target=target(mesh, mib))
            jax.block_until_ready(got)
        report = em.last_report
        assert report is not None and report.tier == "local" and report.step == 1, report
        out["emergency_restore"]["from_peers"] = float(len(report.from_peers))
    bad["emergency_restore"] = mismatches(got, mib)
    del got

    ref: dict[str, float] = {"ref_first_sync": first_sync, "ref_first_sync_compile": first_compile}
    if n > 1:
        ref.update(reference_coordination("c", max(5, repeats)))
        ref.update(reference_move(mesh, mib))
    ref.update(reference_read(ckpt))
    out["reference"] = ref
    return {"n": n, "ops": out, "bad": bad}
