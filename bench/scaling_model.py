"""The scaling model of docs/SCALING.md, and its figure (docs/scaling.png).

    python bench/scaling_model.py [--measured bench/results/data_parallel.json]
                                  [--simulated bench/results/scale_sim.json]

A 70B-parameter train state (bf16 parameters and Adam moments in f32: 140 + 560 = 700 GB)
fully sharded over H hosts of 8 accelerators. Every input is a figure measured on this
project's machines (named below, with the command that gives it) or a stated hardware
assumption; the measured points of bench/data_parallel.py, and bench/scale_sim.py's (the
library's own code for everything but bulk bytes, N = 64 ... 4,096 on one core), are drawn
beside the model.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import harness

STATE_BYTES = 140e9 + 560e9
LEAVES_SHARDED = 1680  # 80 layers x 7 matrices x (params, mu, nu): sharded over every device
DEVICES_PER_HOST = 8

# Measured here (2-core VM, CPU devices):
CALLS_PER_SAVE = 5  # bench/scale.py: 2 key-value rounds + 3 barriers per save
PROTOCOL_MS = {2: 1.37, 4: 1.81, 8: 3.03}  # bench/scale.py, 64 KiB/process: latency per save
RECORD_BYTES = 400  # one leaf record in manifest.json (format 1.3: no per-chunk list)
RECORD_PARSE_US = 20.0  # ... parsed, LeafRecord built
KV_VALUE_BYTES = 60  # one process's value in a key-value round (digest, host, save id, bytes)
COORDINATOR_GBS = 1.0  # assumed: what the coordination service serves per second
MERGE_READ_S = {"nvme": 0.0005, "object": 0.03}  # assumed: one per-process database's root
MERGE_CONCURRENCY = 32  # assumed: databases opened at once by the merge
MERGE_KEY_US = 2.5  # bench/scale_sim.py: the merge's cost per chunk key, one core
CHUNKS_PER_LEAF_HOST = DEVICES_PER_HOST  # a sharded leaf: one chunk per device

# Hardware assumptions (per host):
NVME_WRITE_GBS, NVME_READ_GBS = 3.0, 6.0  # local NVMe
OBJECT_GBS = 1.2  # per-host throughput to an object store (~10 GbE of a 25 GbE NIC)
D2H_GBS = 20.0  # device->host copy into pinned memory (PCIe 4 x16, 8 devices in parallel)


def protocol_s(hosts: int) -> float:
    """Coordination latency per save, a line fitted through the measured points."""
    xs, ys = list(PROTOCOL_MS), list(PROTOCOL_MS.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return (my + slope * (hosts - mx)) / 1e3


def kv_s(hosts: int) -> float:
    """The save's one key-value round: process 0 reads every value, the others one verdict
    (before this session every process read every value: hosts^2 through the coordinator)."""
    return 2 * hosts * KV_VALUE_BYTES / (COORDINATOR_GBS * 1e9)


def merge_s(hosts: int, storage: str, leaves: int = LEAVES_SHARDED) -> float:
    """Process 0 links every process's OCDBT database into the root one at commit: the
    databases' roots read, then every chunk key copied into the root's B-tree (measured
    per key on one core by bench/scale_sim.py; the key count is leaves x devices)."""
    keys = leaves * CHUNKS_PER_LEAF_HOST * hosts
    reads = math.ceil(hosts / MERGE_CONCURRENCY) * MERGE_READ_S[storage]
    return reads + keys * MERGE_KEY_US / 1e6


def model(hosts: int, storage: str) -> dict:
    per_host = STATE_BYTES / hosts
    write = NVME_WRITE_GBS if storage == "nvme" else OBJECT_GBS
    read = NVME_READ_GBS if storage == "nvme" else OBJECT_GBS
    manifest_bytes = LEAVES_SHARDED * RECORD_BYTES  # independent of hosts since format 1.3
    manifest_s = manifest_bytes / (write * 1e9)
    commit = protocol_s(hosts) + kv_s(hosts) + merge_s(hosts, storage) + manifest_s
    return {
        "hosts": hosts,
        "bytes_per_host": per_host,
        "blocking_s": per_host / (D2H_GBS * 1e9),
        "save_s": per_host / (write * 1e9) + manifest_s + commit,
        "restore_s": per_host / (read * 1e9) + LEAVES_SHARDED * RECORD_PARSE_US / 1e6,
        "host_memory_save": per_host,  # the staged host copy of an async save
        "host_memory_restore": per_host + 128 * 2**20,  # result + read budget
        "manifest_bytes": manifest_bytes,
        "kv_s": kv_s(hosts),
    }


def lost_fraction(hosts: int, host_hours_per_failure: float, interval_s: float) -> float:
    """Share of the job's time lost to failures with the emergency tier: each failure loses
    half a local-save interval of work plus the restart (restore from local/peer copies)."""
    restart = model(hosts, "nvme")["restore_s"] + 60.0  # + process restart and jax init
    failures_per_s = hosts / (host_hours_per_failure * 3600)
    return failures_per_s * (interval_s / 2 + restart)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", default=os.path.join(harness.RESULTS, "data_parallel.json"))
    ap.add_argument("--simulated", default=os.path.join(harness.RESULTS, "scale_sim.json"))
    ap.add_argument("--out", default=os.path.join(harness.ROOT, "docs", "scaling.png"))
    a = ap.parse_args()
    table = harness.Table(
        (("hosts", ">6"), ("storage", ">7"), ("GB/host", ">8.2f"), ("blocking s", ">10.2f"))
        + (("save s", ">8.1f"), ("restore s", ">9.1f"), ("manifest MB", ">11.1f"))
        + (("lost %/1k h", ">11.2f"),),
        sep=" ",
    )
    print(table.head())
    for h in (8, 64, 512, 4096):
        for storage in ("nvme", "object"):
            m = model(h, storage)
            cells = (m["bytes_per_host"] / 1e9, m["blocking_s"], m["save_s"], m["restore_s"])
            lost = 100 * lost_fraction(h, 1000, 600)
            print(table.row(h, storage, *cells, m["manifest_bytes"] / 1e6, lost))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    grid = [2**k for k in range(0, 13)]
    ax = axes[0]
    for storage, style in (("nvme", "-"), ("object", "--")):
        ax.plot(
            grid,
            [model(h, storage)["save_s"] for h in grid],
            "C0" + style,
            label=f"save, {storage}",
        )
        ax.plot(
            grid,
            [model(h, storage)["restore_s"] for h in grid],
            "C1" + style,
            label=f"restore, {storage}",
        )
    ax.plot(
        grid,
        [merge_s(h, "object") for h in grid],
        "C3:",
        label="commit: merge of per-host databases (object store)",
    )
    ax.set(xscale="log", yscale="log", xlabel="hosts (8 accelerators each)", ylabel="seconds",
           title="70B train state (700 GB), model")  # fmt: skip
    ax.legend(fontsize=8)
    ax = axes[1]
    if os.path.exists(a.measured):
        with open(a.measured) as f:
            rows = json.load(f)
        procs = sorted(int(n) for n in rows)
        for lib, color in (("jaxckpt", "C0"), ("orbax", "C2")):
            ax.plot(
                procs,
                [rows[str(n)][lib]["save_gbs"] for n in procs],
                color + "o-",
                label=f"{lib} save",
            )
            ax.plot(
                procs,
                [rows[str(n)][lib]["restore_gbs"] for n in procs],
                color + "s--",
                label=f"{lib} restore",
            )
        ax.set(xlabel="processes (one simulated host each, 2 cores)", ylabel="GB/s",
               title=f"measured: data-parallel state, {rows[str(procs[0])]['logical'] / 2**30:.1f} GiB")  # fmt: skip
        ax.set_xticks(procs)
        ax.legend(fontsize=8)
    else:
        ax.set_title("no measured points: run bench/data_parallel.py")
    ax = axes[2]
    for n, color in ((100, "C3"), (1000, "C0"), (10000, "C2")):
        ax.plot(
            grid,
            [100 * lost_fraction(h, n, 600) for h in grid],
            color,
            label=f"1 failure / {n} host-h",
        )
    ax.set(xscale="log", yscale="log", xlabel="hosts", ylabel="% of time lost",
           title="emergency tier, local save every 10 min")  # fmt: skip
    ax.legend(fontsize=8)
    simulated(axes[3], a.simulated)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


def simulated(ax: object, path: str) -> None:
    """bench/scale_sim.py's points (the library's code, one core) beside the model's lines
    for the same state (the simulation's leaves, one chunk a process)."""
    if not os.path.exists(path):
        ax.set_title("no simulated points: run bench/scale_sim.py")  # type: ignore[attr-defined]
        return
    with open(path) as f:
        doc = json.load(f)
    rows = sorted(doc["rows"].values(), key=lambda r: r["n"])
    ns = [r["n"] for r in rows]
    leaves = doc["leaves"]
    points = (
        ("merge_s", "C3", "merge (process 0)"),
        ("planner_s", "C0", "emergency planner (process 0)"),
        ("manifest_parse_s", "C2", "manifest.json parse"),
    )
    for key, color, label in points:
        ax.plot(ns, [r[key] for r in rows], color + "o", label=f"{label}, measured")  # type: ignore[attr-defined]
    keys_per_host = leaves / CHUNKS_PER_LEAF_HOST  # the simulation: one chunk a leaf a host
    ax.plot(ns, [merge_s(n, "nvme", keys_per_host) for n in ns], "C3-", label="merge, model")  # type: ignore[attr-defined]
    ax2 = ax.twinx()  # type: ignore[attr-defined]
    ax2.plot(ns, [r["restore_bytes"] / 1e6 for r in rows], "C1s--", label="emergency restore KV MB")
    before = [r for r in rows if r["restore_before_bytes"] > 0]  # (run up to --before-max)
    ax2.plot(
        [r["n"] for r in before],
        [r["restore_before_bytes"] / 1e6 for r in before],
        "C1x:",
        label="... before (O(N²))",
    )
    ax2.plot(ns, [r["save_bytes"] / 1e6 for r in rows], "C4s--", label="save KV MB")
    ax2.set(yscale="log", ylabel="key-value MB through the coordinator")
    ax2.legend(fontsize=7, loc="lower right")
    ax.set(xscale="log", yscale="log", xlabel="processes (simulated, one core)", ylabel="seconds",  # type: ignore[attr-defined]
           title=f"simulated: {leaves} leaves, one chunk each a process")  # fmt: skip
    ax.legend(fontsize=7, loc="upper left")  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
