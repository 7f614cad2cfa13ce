"""Real processes as far as this machine goes: 1 to 16 jax.distributed processes on
127.0.0.1, each its own host, through every multi-process path, timed by phase against N,
with the same moves made without jaxckpt beside them.

usage: python bench/scale.py [--procs 1,2,4,8,16] [--mib 32] [--devices 1] [--repeats 5]
                            [--data-parallel GIB]

Each N runs as one job (``bench/scale_worker.py``; ``--devices`` CPU devices a process,
``$JAXCKPT_HOST`` a host of its own) on a data-parallel state of ``--mib`` MiB (8 parameters
replicated over every device, 3/4 of the bytes; one leaf sharded over every device; 40 small
replicated leaves) and runs: ``jaxckpt.save``; ``jaxckpt.restore`` onto the same process
count, onto the same count again in the same job (programs compiled, hosts known), and of
the checkpoint the previous job (another process count) saved; ``CheckpointManager`` save
and restore; ``EmergencyCheckpointManager`` (replication 1) save, the last process's local
directory wiped, restore. Every restore is compared bit for bit; the page cache of a
checkpoint is dropped before each restore.

Then, in the same processes and without jaxckpt: a key-value round as ``all_gather`` makes
it and a bare barrier through the coordination service's client; the parameters' bytes
moved from 1/N on each process to every device by ``jax.device_put`` (cold: with its
compile; warm) and broadcast from process 0 (``multihost_utils.broadcast_one_to_all``);
each process's 1/N of the checkpoint's files read cold with ``os.preadv``.

``JAXCKPT_PROTOCOL_TIMING=1`` (set here, inherited by the workers) makes
``jaxckpt._src.multihost`` time each barrier's own latency (release minus the last arrival,
plus the key-value calls): the "protocol" column, the coordination without the waiting for
slower processes. With ``--data-parallel GIB``, also bench/data_parallel.py's table
(jaxckpt against Orbax) for the same process counts. Hostile values (every dtype's random
bits) through 8 processes as separate hosts: ``bench/hostile_hosts.py``.
"""

from __future__ import annotations

import argparse
import os
import time

import harness
from scale_worker import layout, worker

os.environ["JAXCKPT_PROTOCOL_TIMING"] = "1"  # inherited by the workers

CORES = os.cpu_count() or 1
RESULTS = os.path.join(harness.RESULTS, "scale.json")
OPS = (
    "save",
    "restore",
    "restore_again",
    "restore_other",
    "manager_save",
    "manager_restore",
    "emergency_save",
    "emergency_restore",
)
PLAIN_RESTORES = ("restore", "restore_again", "restore_other", "manager_restore")
# the table's phases: each taken from the first of these names an op's figures have
PHASES = {
    "write": ("write", "local"),
    "kv": ("kv",),
    "barrier": ("barrier",),
    "protocol": ("protocol",),
    "merge": ("merge",),
    "manifest": ("manifest",),
    "plan": ("plan",),
    "read": ("read",),
    "move": ("move", "peer_exchange"),
    "compile": ("compile",),
    "place": ("place",),
}


def phase(op: str, rec: dict, name: str) -> float | None:
    """Phase ``name`` of one op's figures. A plain restore places inside its read phase
    (place is taken out of read there); the emergency save's write and move add what its
    writer thread spent writing and waiting for peer copies."""
    got = next((rec[k] for k in PHASES[name] if k in rec), None)
    if name == "read" and got is not None and op in PLAIN_RESTORES:
        got -= rec["place"]
    if op == "emergency_save" and name in ("write", "move") and got is not None:
        got += rec["ew_write" if name == "write" else "ew_peer_wait"]
    return got


def run(procs: list[int], mib: float, devices: int, repeats: int) -> list[dict]:
    """One job per process count, each restoring the previous job's checkpoint as well."""
    jobs = []
    with harness.scratch() as d:
        previous, prev_n = "", None
        for n in procs:
            root = os.path.join(d, f"n{n}")
            os.makedirs(root)
            harness.log(f"{n} processes")
            t = time.perf_counter()
            per = harness.run_job(
                __file__, n, devices=devices, timeout_s=900, root=root, mib=mib,
                previous=previous, repeats=repeats,
            )  # fmt: skip
            jobs.append({"n": n, "from": prev_n, "per": per, "wall": time.perf_counter() - t})
            previous, prev_n = os.path.join(root, "ckpt"), n
    return jobs


def print_phases(jobs: list[dict]) -> None:
    cols = (("op", "<17"), ("N", ">3"), ("total", ">7.3f"), ("slowest", ">8.3f"))
    cols += tuple((name, ">8.3f") for name in PHASES) + (("cpu sum", ">8.2f"),)
    table = harness.Table(cols, sep=" ")
    print(table.head(rule=True))
    for op in OPS:
        for job in jobs:
            per = [p["ops"][op] for p in job["per"] if op in p["ops"]]
            if not per:
                continue
            first = per[0]
            label = op if op != "restore_other" else f"restore_from_{job['from']}"
            cells = [phase(op, first, name) for name in PHASES]
            cpu = sum(p["cpu"] for p in per)
            print(table.row(label, job["n"], first["total"], max(p["total"] for p in per),
                            *cells, cpu))  # fmt: skip
    print(
        "seconds, process 0 (it merges and writes the manifest); slowest: the longest total of "
        "any process; cpu sum: CPU seconds of all processes together (user + system, every "
        f"thread), to set against {CORES} cores x total. Phases overlap and do not add up: kv "
        "and barrier are inside the others (a barrier's time includes waiting for the slowest "
        "process; protocol: the coordination's own latency, without that waiting); compile is XLA's tracing, lowering and compiling, inside move (and plan); "
        "read leaves out place. restore_again: the same restore a second time in the same job; "
        "restore_from_M: the checkpoint M processes saved. Emergency save: write = the local "
        "step (calling thread + writer thread), move = the peer exchange (+ the writer's wait "
        "for peer copies); emergency restore: the last process's local directory wiped, its "
        "slices from peers."
    )


def _max(job: dict, op: str, key: str) -> float:
    return max(p["ops"][op].get(key, 0.0) for p in job["per"])


def print_reference(jobs: list[dict], mib: float) -> None:
    params = sum(4 * s[0] * s[1] for s, rep in layout(mib).values() if rep and len(s) == 2)
    print(
        f"\n== the same moves without jaxckpt (slowest process), parameters {params / 1e6:.1f} MB"
    )
    cols = (("N", ">3"), ("kv round", ">9.4f"), ("jx kv", ">8.4f"), ("barrier", ">8.4f"))
    cols += (("file read", ">9.3f"), ("jx read", ">8.3f"), ("put cold", ">9.3f"))
    cols += (("compile", ">8.3f"), ("put warm", ">9.3f"), ("jx move", ">8.3f"))
    cols += (("jx again", ">9.3f"), ("bcast", ">7.3f"), ("GB/s in", ">8.2f"))
    cols += (("1st sync", ">9.3f"), ("compile", ">8.3f"))
    table = harness.Table(cols, sep=" ")
    print(table.head(rule=True))
    ratios: list[str] = []
    for job in jobs:
        n, ref = job["n"], [p["ops"]["reference"] for p in job["per"]]

        def worst(key: str, ref: list[dict] = ref) -> float | None:
            got = [r[key] for r in ref if key in r]
            return max(got) if got else None

        restore = job["per"][0]["ops"]["restore"]
        kv_calls = None
        if n > 1:  # jaxckpt's key-value seconds per restore, for the round it makes
            kv_calls = restore["kv"] + restore["barrier"]
        warm = worst("ref_move_warm")
        again = _max(job, "restore_again", "move")
        if n > 1 and warm:
            read = _max(job, "restore", "read") - _max(job, "restore", "place")
            ratios.append(
                f"{n}: read {read / worst('ref_read'):.2f}x, warm move {again / warm:.2f}x, "
                f"kv {kv_calls / worst('ref_kv_round'):.2f}x a round"
            )
        inbound = params * (n - 1) / n
        print(table.row(
            n, worst("ref_kv_round"), kv_calls, worst("ref_barrier"), worst("ref_read"),
            _max(job, "restore", "read") - _max(job, "restore", "place"),
            worst("ref_move_first"), worst("ref_move_first_compile"), warm,
            _max(job, "restore", "move"), _max(job, "restore_again", "move"),
            worst("ref_broadcast"), inbound / warm / 1e9 if warm else None,
            worst("ref_first_sync"), worst("ref_first_sync_compile"),
        ))  # fmt: skip
    print("ratios, jaxckpt / the same move without it: " + "; ".join(ratios))
    print(
        "kv round: set + barrier + listing through the coordination service's client (median); "
        "jx kv: jaxckpt's key-value and barrier seconds in the first restore (its one round: "
        "the hosts); barrier: a bare barrier. file read: each process's 1/N of the "
        "checkpoint's bytes, cold, os.preadv; jx read: jaxckpt's read phase less place. put "
        "cold / warm: jax.device_put of the parameters from 1/N a process to every device, "
        "each leaf finished before the next (as jaxckpt moves them), first call (compile: its "
        "compile seconds) and again; jx move / jx again: jaxckpt's move phase in the first "
        "restore and in the second of the job. bcast: multihost_utils.broadcast_one_to_all of "
        "the parameters from process 0, warm. GB/s in: parameter bytes each process receives "
        "((N-1)/N of them) over put warm. 1st sync: the job's first collective "
        "(multihost_utils.sync_global_devices, before the save: gloo connects the processes "
        "and its psum compiles; compile: of that) - no restore pays it here."
    )


def growth(jobs: list[dict]) -> None:
    multi = [j for j in jobs if j["n"] > 1]
    if len(multi) < 2:
        return
    a, b = multi[0], multi[-1]
    print(f"\n== growth of the restore from {a['n']} to {b['n']} processes (process 0)")
    for key in ("total", "plan", "read", "move", "compile", "place", "kv", "barrier"):
        x, y = a["per"][0]["ops"]["restore"].get(key), b["per"][0]["ops"]["restore"].get(key)
        if x is None or y is None:
            continue
        print(f"  {key:<8} {x:7.3f} -> {y:7.3f} s  (+{y - x:6.3f})")
    cpu_per = []
    for j in (a, b):
        per = [p["ops"]["restore"] for p in j["per"]]
        cpu, tot, n = sum(r["cpu"] for r in per), per[0]["total"], j["n"]
        read, move = (sum(r[k] for r in per) / n for k in ("read_cpu", "move_cpu"))
        ref = [p["ops"]["reference"] for p in j["per"]]
        put = sum(r["ref_move_warm_cpu"] for r in ref) / n
        print(
            f"  {n:>2} processes: restore {tot:.3f} s, CPU of all processes {cpu:.2f} s = "
            f"{cpu / tot:.2f} of the {CORES} cores busy; per process {cpu / n:.3f} CPU s "
            f"(read {read:.3f}, move {move:.3f}; jax.device_put warm alone {put:.3f})"
        )
        cpu_per.append(cpu / n)
    grew = cpu_per[1] / cpu_per[0]
    print(
        f"{harness.verdict(grew <= 1.5)} the restore's CPU per process grows {grew:.2f}x from "
        f"{a['n']} to {b['n']} processes (target: at most 1.5x: the library's own work per "
        "process does not grow with N; the wall does, where N processes share the cores)"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="1,2,4,8,16")
    ap.add_argument(
        "--mib",
        type=float,
        default=32.0,
        help="state size, MiB (below about 16 the parameters are one chunk each: not read once)",
    )
    ap.add_argument("--devices", type=int, default=1, help="CPU devices per process")
    ap.add_argument("--repeats", type=int, default=5, help="reference coordination rounds")
    ap.add_argument(
        "--data-parallel",
        type=float,
        default=0.0,
        metavar="GIB",
        help="also run the data-parallel table (bench/data_parallel.py) with a state of GIB",
    )
    a = ap.parse_args()
    procs = [int(x) for x in a.procs.split(",")]
    total = sum(4 * s[0] * (s[1] if len(s) > 1 else 1) for s, _ in layout(a.mib).values())
    print(
        f"== {a.mib:g} MiB state ({total / 1e6:.1f} MB), {a.devices} CPU device(s) a process, "
        f"each process its own host, {CORES} cores; {time.strftime('%Y-%m-%d')}; load average "
        f"{os.getloadavg()[0]:.1f} (the machine is shared: others' work shows in every figure)"
    )
    jobs = run(procs, a.mib, a.devices, a.repeats)
    failed = {
        (j["n"], op): leaves
        for j in jobs
        for p in j["per"]
        for op, leaves in p["bad"].items()
        if leaves
    }
    print_phases(jobs)
    print_reference(jobs, a.mib)
    growth(jobs)
    print("\njob wall seconds (start to end, process start-up included): "
          + ", ".join(f"{j['n']}: {j['wall']:.1f}" for j in jobs))  # fmt: skip
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")
    checked = sum(len(p["bad"]) for j in jobs for p in j["per"])
    print(f"{harness.verdict(not failed)} every restore bit-exact ({checked} restores checked"
          + (f"; differing leaves: {failed}" if failed else "") + ")")  # fmt: skip
    harness.write_json(RESULTS, {"mib": a.mib, "devices": a.devices, "jobs": jobs})
    if a.data_parallel:
        import data_parallel

        print(f"\n== data-parallel state, {a.data_parallel} GiB, jaxckpt vs Orbax, medians")
        dp = data_parallel.table(a.data_parallel, procs, max(3, a.repeats))
        data_parallel.write_results(dp)
        data_parallel.verdicts(dp)


if __name__ == "__main__":
    harness.entry(main, worker)
