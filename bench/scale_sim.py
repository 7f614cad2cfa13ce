"""Everything a save and a restore do that is not bulk bytes, at N = 64 ... 4,096 processes,
with the library's own code in one process on one core (docs/SCALING.md).

    taskset -c 1 python bench/scale_sim.py [--n 64,128,...,4096] [--leaves 8] [--json out]

Per N:

* **merge**: N per-process OCDBT databases written by jaxckpt's writer (``ocdbt_write.write``,
  host arrays, one 64-byte chunk of each of ``--leaves`` leaves a process, as a state
  sharded over every process stores it), then process 0's merge (``arrays.merge``) timed,
  and one leaf read back through the merged root and compared.
* **manifest**: the ``Manifest`` of that save (a mesh of N devices, one per process)
  written (``to_json`` + ``write_bytes``) and parsed (``read_manifest``): bytes and seconds.
* **planner**: the emergency restore's plan on process 0 for N processes holding their own
  slices and a peer's (replication 1), one process wiped: every process's ``Holdings``
  parsed, ``candidates``, ``StepPlan.start``, the final ``replan``, ``shift_rounds``.
* **key-value**: the coordination of a save (``multihost.agree`` and its two barriers) and of
  an emergency restore (``restore.share_holdings``, the step's rounds through process 0,
  ``restore._Step.round``), run by N threads, each one process, through a stand-in
  coordination client that implements the calls ``multihost`` makes and counts the keys
  and bytes it serves. The restore's rounds as they were before (every process gathering
  every process's holdings, needs and failures: ``multihost.all_gather``) run beside them,
  with the same values, as the baseline. ``peers.send_rows`` agrees on a row width per move
  round through process 0 (``multihost.decided``); its keys are counted on their own line.

Seconds are CPU seconds of this process (``time.process_time``: every thread's, so one
core's worth, and steadier than the wall clock on a shared machine); the key-value columns
are counts, not times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import harness
import numpy as np

sys.path.insert(0, harness.ROOT)

from jaxckpt._src import gc_pause, multihost, saving  # noqa: E402
from jaxckpt._src import manifest as mf  # noqa: E402
from jaxckpt._src.emergency import restore  # noqa: E402
from jaxckpt._src.emergency.planner import (  # noqa: E402
    Holdings,
    SliceKey,
    StepHolding,
    StepPlan,
    by_sender,
    candidates,
    keys_to_json,
    shift_rounds,
)
from jaxckpt._src.io import arrays, ocdbt_write  # noqa: E402
from jaxckpt._src.storage import location  # noqa: E402

CHUNK = 16  # float32 elements a chunk: 64 bytes
STEP = 7

# --- the stand-in coordination client ------------------------------------------------------


class Counting:
    """An in-memory key-value store and barriers with the calls of jax's coordination
    client that ``multihost`` makes, counting the keys and bytes it takes and serves."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.kv: dict[str, str] = {}
        self.events: dict[str, threading.Event] = defaultdict(threading.Event)
        self.arrived: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.keys = 0  # keys set, and entries returned by gets and listings
        self.bytes = 0  # their keys' and values' bytes
        self.calls = 0

    def _took(self, key: str, value: str) -> None:
        self.keys += 1
        self.bytes += len(key) + len(value)

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.lock:
            self.calls += 1
            self._took(key, value)
            self.kv[key] = value
            event = self.events[key]
        event.set()

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        with self.lock:
            event = self.events[key]
        if not event.wait(timeout_ms / 1000):
            raise RuntimeError(f"DEADLINE_EXCEEDED: {key}")
        with self.lock:
            self.calls += 1
            value = self.kv[key]
            self._took(key, value)
            return value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self.lock:
            self.calls += 1
            out = [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]
            for k, v in out:
                self._took(k, v)
            return out

    def key_value_delete(self, key: str) -> None:
        with self.lock:
            self.calls += 1
            self.kv.pop(key, None)
            self.events.pop(key, None)

    def wait_at_barrier(self, name: str, timeout_ms: int) -> None:
        with self.lock:
            self.calls += 1
            self._took(name, "")
            self.arrived[name] += 1
            event = self.events["barrier/" + name]
            if self.arrived[name] == self.count:
                event.set()
        if not event.wait(timeout_ms / 1000):
            raise RuntimeError(f"barrier {name} timed out")


_local = threading.local()


@contextmanager
def processes(client: Counting) -> Iterator[None]:
    """``multihost`` answering as the process each thread is (``_local.pid``), through
    ``client``."""
    saved = (multihost.process_index, multihost.process_count, multihost._client)
    multihost.process_index = lambda: _local.pid  # type: ignore[assignment]
    multihost.process_count = lambda: client.count  # type: ignore[assignment]
    multihost._client = lambda: client
    try:
        yield
    finally:
        multihost.process_index, multihost.process_count, multihost._client = saved


def run_all(count: int, job: Callable[[int], Any]) -> tuple[Counting, float]:
    """``job(pid)`` on ``count`` threads, one a process; the counting client, and seconds."""
    client = Counting(count)
    errors: list[BaseException] = []

    def run(pid: int) -> None:
        _local.pid = pid
        try:
            job(pid)
        except BaseException as e:
            errors.append(e)

    threading.stack_size(256 << 10)
    with processes(client):
        t = time.perf_counter()
        threads = [threading.Thread(target=run, args=(p,)) for p in range(count)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        seconds = time.perf_counter() - t
    if errors:
        raise errors[0]
    return client, seconds


# --- the state ---------------------------------------------------------------------------


def leaf_names(leaves: int) -> list[str]:
    return [f"layer{i:03d}/w" for i in range(leaves)]


def slice_of(p: int) -> tuple[tuple[int, int], ...]:
    return ((p * CHUNK, (p + 1) * CHUNK),)


def expected(leaf: int, n: int) -> np.ndarray:
    return (np.arange(n * CHUNK, dtype=np.float32) + leaf * 0.5).astype(np.float32)


def write_databases(step: Any, n: int, leaves: int) -> float:
    """Each process's database, as ``ocdbt_write.write`` writes it; the seconds per
    process."""
    md = arrays.zarr_metadata([n * CHUNK], "float32", [CHUNK], None)
    t = time.perf_counter()
    for p in range(n):
        writes = []
        for i, name in enumerate(leaf_names(leaves)):
            piece = expected(i, n)[p * CHUNK : (p + 1) * CHUNK]
            writes.append(
                arrays.ArrayWrite(name, md, [(slice_of(p), lambda x=piece: x)], p == 0, 64)
            )
        db = arrays.database_dir(step, p)
        db.makedirs()
        ocdbt_write.write(db, writes)
    return (time.perf_counter() - t) / n


def merge(root: str, n: int, leaves: int) -> dict:
    step = location(os.path.join(root, f"merge{n}"))
    per_process_s = write_databases(step, n, leaves)
    t = time.process_time()
    arrays.merge(step, n)
    merge_s = time.process_time() - t
    import tensorstore as ts

    got = ts.open(
        arrays.array_spec(arrays.database_dir(step, None), leaf_names(leaves)[-1]),
        context=arrays.new_context(),
    )
    values = got.result().read().result()
    if values.tobytes() != expected(leaves - 1, n).tobytes():
        raise AssertionError(f"N={n}: the merged root reads other values")
    shutil.rmtree(step.url)
    return {"write_per_process_s": per_process_s, "merge_s": merge_s}


def manifest(root: str, n: int, leaves: int) -> dict:
    mesh = {
        "axis_names": ["data"],
        "shape": [n],
        "device_ids": list(range(n)),
        "process_indices": list(range(n)),
        "axis_types": ["Explicit"],
    }
    records = tuple(
        mf.LeafRecord(
            path=[["k", part] for part in name.split("/")],
            name=name,
            kind="array",
            shape=[n * CHUNK],
            dtype="float32",
            sharding={"type": "named", "mesh": 0, "spec": ["data"]},
            chunk_shape=[CHUNK],
            nbytes=n * CHUNK * 4,
            writer_salt=0,
        )
        for name in leaf_names(leaves)
    )
    m = mf.Manifest(
        records,
        [mesh],
        n,
        [leaves * 64] * n,
        process_hosts=[f"host-{p:05d}.cluster.example" for p in range(n)],
    )
    where = location(os.path.join(root, f"manifest{n}"))
    where.makedirs()
    t = time.process_time()
    text = m.to_json().encode()
    where.write_bytes(mf.MANIFEST_FILE, text)
    write_s = time.process_time() - t
    where.write_bytes(mf.COMMIT_FILE, b"")
    t = time.process_time()
    back = mf.read_manifest(where)
    parse_s = time.process_time() - t
    if back.process_count != n or len(back.leaves) != leaves:
        raise AssertionError("the manifest read back differs")
    shutil.rmtree(where.url)
    return {"manifest_bytes": len(text), "manifest_write_s": write_s, "manifest_parse_s": parse_s}


# --- the emergency restore's facts ------------------------------------------------------------


def holdings(n: int, leaves: int, wiped: int) -> list[Holdings]:
    """Process p holds its own slices and process p-1's (replication 1); ``wiped`` none."""
    names = leaf_names(leaves)
    need = dict.fromkeys(names, n)
    out = []
    for p in range(n):
        if p == wiped:
            out.append(Holdings((), {}))
            continue
        held = frozenset(SliceKey(name, slice_of(q)) for name in names for q in (p, (p - 1) % n))
        out.append(Holdings((), {STEP: StepHolding("d", need, held, (p, (p - 1) % n))}))
    return out


def needs(n: int, leaves: int) -> list[list[SliceKey]]:
    return [[SliceKey(name, slice_of(p)) for name in leaf_names(leaves)] for p in range(n)]


def planner(n: int, leaves: int) -> dict:
    views = holdings(n, leaves, n // 2)
    texts = [v.to_json() for v in views]
    wanted = needs(n, leaves)
    t = time.process_time()
    with gc_pause.paused():  # as restore.share_holdings and the manager's restore run them
        parsed = [Holdings.from_json(text) for text in texts]
        tries, _ = candidates(parsed)
        plan = StepPlan.start(tries[0], parsed, wanted)
        plan.replan([[] for _ in range(n)])
        senders = by_sender(plan.sends)
        rounds = shift_rounds(plan.sends, n)
    seconds = time.process_time() - t
    if senders != {(n // 2 + 1) % n: {n // 2: set(wanted[n // 2])}} or len(rounds) != 1:
        raise AssertionError(f"N={n}: an unexpected plan {senders}")
    return {"planner_s": seconds, "holdings_bytes": sum(map(len, texts))}


# --- key-value rounds -------------------------------------------------------------------------


def save_rounds(n: int, leaves: int) -> dict:
    """``saving.commit``'s coordination: one ``agree`` round, the "written" round that
    brings every process's fingerprint sums (one 24-digit text a leaf it wrote) to process
    0 (``multihost.gather``, keys deleted after), and the "committed" barrier."""
    tree = [(name, "array", [n * CHUNK], "float32") for name in leaf_names(leaves)]
    description = {"path": "/ckpt/00001000", "leaves": leaves, "tree": tree}

    def job(pid: int) -> None:
        me = saving._Writer(f"host-{pid:05d}.cluster.example", f"{pid:012x}", 64 * leaves, True)
        extra = json.dumps(dataclasses.asdict(me))
        agreed = multihost.agree("jaxckpt/save/0", description, 600, extra=extra)
        save_id = json.loads(agreed.first)["save_id"]
        sums = {name: f"{pid:024x}" for name in leaf_names(leaves)}
        multihost.gather(f"jaxckpt/{save_id}/written", json.dumps(sums), 600)
        multihost.barrier(f"jaxckpt/{save_id}/committed", 600)

    client, _ = run_all(n, job)
    return {"save_keys": client.keys, "save_bytes": client.bytes}


def restore_rounds(n: int, leaves: int, before_max: int) -> dict:
    """The emergency restore's rounds, through process 0 (now), and every process gathering
    everything (before), with the same values."""
    wiped = n // 2
    views = holdings(n, leaves, wiped)
    wanted = needs(n, leaves)

    def now(pid: int) -> None:
        published = restore.share_holdings(views[pid], tag="r", timeout_s=600)
        req = restore.Request(location("/nonexistent"), published, None, None, "r", 600, None)  # type: ignore[arg-type]
        at = restore._Step(req, STEP, None, pid)
        at.round("doc", None, restore._elect(at))
        restore._first_plan(at, wanted[pid])
        at.round("bad0", [], restore._replan(at))

    def before(pid: int) -> None:
        got = multihost.all_gather("b/held", views[pid].to_json(), 600)
        all_views = [Holdings.from_json(t) for t in got]
        candidates(all_views)
        multihost.all_gather("b/doc", json.dumps(None), 600)
        multihost.all_gather("b/needs", json.dumps(keys_to_json(wanted[pid])), 600)
        multihost.all_gather("b/bad0", json.dumps([]), 600)

    def widths(pid: int) -> None:  # peers.send_rows: one per move round (one round here)
        size = str(64 * leaves if pid == wiped + 1 else 0)
        multihost.decided("w/len", size, lambda sizes: str(max(map(int, sizes))), 600)

    out: dict[str, Any] = {"restore_before_keys": -1, "restore_before_bytes": -1}
    for what, job in (("restore", now), ("restore_before", before), ("send_rows", widths)):
        if what == "restore_before" and n > before_max:
            continue  # (N² key-value entries in one Python process: minutes)
        client, seconds = run_all(n, job)
        out.update({f"{what}_keys": client.keys, f"{what}_bytes": client.bytes})
        out[f"{what}_s"] = seconds
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="64,128,256,512,1024,2048,4096")
    ap.add_argument("--leaves", type=int, default=8)
    ap.add_argument("--before-max", type=int, default=1024, help="the O(N²) baselines up to this N")
    ap.add_argument("--json", default=os.path.join(harness.RESULTS, "scale_sim.json"))
    a = ap.parse_args()
    counts = [int(x) for x in a.n.split(",")]
    rows: dict[int, dict] = {}
    table = harness.Table(
        (("N", ">5"), ("merge s", ">8.3f"), ("mfst KB", ">8.1f"), ("mfst w s", ">8.4f"))
        + (("parse s", ">8.4f"), ("plan s", ">7.3f"), ("save keys", ">9d"))
        + (("save KB", ">8.1f"), ("rst keys", ">9d"), ("rst KB", ">9.1f"))
        + (("before keys", ">11d"), ("before KB", ">11.1f"), ("x bytes", ">7.1f"))
        + (("rows keys", ">9d"),),
        sep=" ",
    )
    print(f"leaves: {a.leaves}, one {CHUNK * 4}-byte chunk of each a process; one core")
    print(table.head())
    root = tempfile.mkdtemp(
        prefix="scale_sim_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    try:
        for n in counts:
            r = {"n": n, **merge(root, n, a.leaves), **manifest(root, n, a.leaves)}
            r.update(
                planner(n, a.leaves),
                **save_rounds(n, a.leaves),
                **restore_rounds(n, a.leaves, a.before_max),
            )
            rows[n] = r
            print(
                table.row(
                    n,
                    r["merge_s"],
                    r["manifest_bytes"] / 1e3,
                    r["manifest_write_s"],
                    r["manifest_parse_s"],
                    r["planner_s"],
                    r["save_keys"],
                    r["save_bytes"] / 1e3,
                    r["restore_keys"],
                    r["restore_bytes"] / 1e3,
                    r["restore_before_keys"],
                    r["restore_before_bytes"] / 1e3,
                    r["restore_before_bytes"] / r["restore_bytes"],
                    r.get("send_rows_keys", -1),
                ),  # fmt: skip
                flush=True,
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("x bytes: the restore's key-value bytes before / now (the same run); -1: not run")
    for key, label in (
        ("merge_s", "merge"),
        ("planner_s", "planner"),
        ("restore_bytes", "restore bytes"),
    ):
        first, last = counts[0], counts[-1]
        growth = rows[last][key] / max(rows[first][key], 1e-12)
        print(f"{label}: x{growth:.1f} from N={first} to N={last} (N x{last / first:.0f})")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump({"leaves": a.leaves, "rows": rows}, f, indent=1)
    print("wrote", a.json)


if __name__ == "__main__":
    main()
