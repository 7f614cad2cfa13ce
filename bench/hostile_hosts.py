"""Hostile values across 8 processes, each its own host: every dtype's random bits (NaN
payloads, signed zeros, subnormals, sub-byte integers) saved and restored across process
counts, every shard compared as bytes; pass/fail per leaf.

usage: python bench/hostile_hosts.py [--procs 8] [--other 4] [--seed 19]

The leaves, values and specs are the suite's (``tests/workers/hostile_job.py``: every dtype
of ``tests/hostile.py``, fixed and random shapes and PartitionSpecs drawn from the seed, 8
devices in all). Three jobs on 127.0.0.1, every process its own host (``$JAXCKPT_HOST``):
  1. --procs processes, one device each: ``jaxckpt.save``; restored onto the saved specs
     (read once + move), ``mesh=``, replicated and random specs; ``CheckpointManager``
     async save and restore; ``EmergencyCheckpointManager`` (replication 1) saved, the last
     process's local directory wiped, restored (its shards from peer copies).
  2. --other processes (8 / --other devices each): the first job's checkpoint restored
     onto the saved and random specs; saved again.
  3. --procs processes: the second job's checkpoint restored onto the saved and random
     specs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import harness

TESTS_WORKERS = os.path.join(harness.ROOT, "tests", "workers")


def compare(out: dict, expected: dict) -> dict[str, str]:
    """{leaf: "" if every shard on this process has the expected bytes, else why not}."""
    from hostile import assert_same_bits

    got = {}
    for name, want in expected.items():
        a, b = name.split("/")
        arr, why = out[a][b], ""
        try:
            assert arr.dtype == want.dtype, f"dtype {arr.dtype} != {want.dtype}"
            for shard in arr.addressable_shards:
                assert_same_bits(want[shard.index], shard.data.__array__(), name)
        except AssertionError as e:
            why = str(e).splitlines()[0][:200] or "differs"
        got[name] = why
    return got


def worker(modes: list[str], saved: str, save_to: str, scratch: str) -> dict:
    """One process: each mode's restores compared leaf by leaf."""
    sys.path.insert(0, TESTS_WORKERS)
    import hostile_job as hj  # joins the job (multiproc.init) and enables 64-bit types
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import PartitionSpec as P

    import jaxckpt

    pid, n = jax.process_index(), jax.process_count()
    os.environ["JAXCKPT_HOST"] = f"hostile-host{pid}"
    mesh = jax.make_mesh((n, jax.device_count() // n), ("data", "model"))
    other = jax.make_mesh((jax.device_count() // n, n), ("data", "model"))
    exp = hj.expected()
    out: dict[str, dict[str, str]] = {}

    def random_target() -> dict:
        rng = np.random.default_rng(hj.SEED + 1)
        return hj.target(other, lambda k, s: hj.random_spec(s, rng))

    for mode in modes:
        if mode == "restore":
            out[f"{n}p saved specs"] = compare(
                jaxckpt.restore(saved, target=hj.target(mesh, hj.saved_spec)), exp
            )
            out[f"{n}p mesh="] = compare(jaxckpt.restore(saved, mesh=mesh), exp)
            out[f"{n}p replicated"] = compare(
                jaxckpt.restore(saved, target=hj.target(other, lambda k, s: P())), exp
            )
            out[f"{n}p random specs"] = compare(jaxckpt.restore(saved, target=random_target()), exp)
        elif mode == "save":
            jaxckpt.save(save_to, hj.state(mesh))
        elif mode == "manager":
            with jaxckpt.CheckpointManager(os.path.join(scratch, "managed")) as mgr:
                mgr.save(1, hj.state(mesh))
                mgr.wait_until_finished()
                out[f"{n}p manager"] = compare(
                    mgr.restore(1, target=hj.target(mesh, hj.saved_spec)), exp
                )
        elif mode == "emergency":
            opts = hj.emergency_options(120)
            local = os.path.join(scratch, f"local{pid}")
            remote = os.path.join(scratch, "remote")
            with jaxckpt.EmergencyCheckpointManager(local, remote, opts) as m:
                m.save(1, hj.state(mesh))
            multihost_utils.sync_global_devices("saved")
            if pid == n - 1:
                shutil.rmtree(local)
            multihost_utils.sync_global_devices("wiped")
            with jaxckpt.EmergencyCheckpointManager(local, remote, opts) as m:
                got = m.restore(target=hj.target(mesh, hj.saved_spec))
                report = m.last_report
            assert report is not None and report.tier == "local", report
            tag = f"{n}p emergency, host{n - 1} wiped"
            out[tag] = compare(got, exp)
            if pid == n - 1:  # its slices came from peers
                out[tag]["(slices from peers)"] = "" if report.from_peers else "none"
        elif mode == "regrid":
            out[f"{n}p saved specs"] = compare(
                jaxckpt.restore(saved, target=hj.target(mesh, hj.saved_spec)), exp
            )
            out[f"{n}p random specs"] = compare(jaxckpt.restore(saved, target=random_target()), exp)
    return out


def run_job(n: int, seed: int, **kwargs: object) -> tuple[dict[str, dict[str, list[str]]], float]:
    """The job's {scenario: {leaf: [why, per failing process]}} and its wall seconds."""
    env = {"JAXCKPT_TEST_SEED": str(seed)}
    t = time.perf_counter()
    per = harness.run_job(__file__, n, devices=8 // n, timeout_s=900, env=env, **kwargs)
    wall = time.perf_counter() - t
    merged: dict[str, dict[str, list[str]]] = {}
    for pid, got in enumerate(per):
        for scenario, leaves in got.items():
            into = merged.setdefault(scenario, {})
            for leaf, why in leaves.items():
                into.setdefault(leaf, [])
                if why:
                    into[leaf].append(f"process {pid}: {why}")
    return merged, wall


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=8)
    ap.add_argument("--other", type=int, default=4)
    ap.add_argument("--seed", type=int, default=19)
    a = ap.parse_args()
    sys.path.insert(0, TESTS_WORKERS)
    os.environ["JAXCKPT_TEST_SEED"] = str(a.seed)
    import hostile_job as hj  # (outside a job: the layout only, no jax.distributed)

    scenarios: dict[str, dict[str, list[str]]] = {}
    with harness.scratch() as d:
        first, second = os.path.join(d, "first"), os.path.join(d, "second")
        plan = [
            (a.procs, ["save", "restore", "manager", "emergency"], first, first),
            (a.other, ["regrid", "save"], first, second),
            (a.procs, ["regrid"], second, ""),
        ]
        for i, (n, modes, saved, save_to) in enumerate(plan):
            source = "" if saved == save_to else f" of the checkpoint {plan[i - 1][0]} saved"
            harness.log(f"{n} processes: {', '.join(modes)}{source}")
            merged, wall = run_job(
                n,
                a.seed,
                modes=modes,
                saved=saved,
                save_to=save_to,
                scratch=os.path.join(d, f"j{i}"),
            )
            harness.log(f"  {wall:.1f} s")
            label = f" (from {plan[i - 1][0]}p)" if saved != save_to else ""
            scenarios.update({k + label: v for k, v in merged.items()})
    names = list(scenarios)
    print(
        f"== seed {a.seed}: {len(hj.LAYOUT)} leaves, {len(names)} restores, each process its own host"
    )
    for i, s in enumerate(names):
        print(f"  [{i}] {s}")
    table = harness.Table(
        (("leaf", "<30"), ("shape", "<16"), ("saved spec", "<28"))
        + tuple((f"[{i}]", ">5") for i in range(len(names))),
        sep=" ",
    )
    print(table.head(rule=True))
    failures = []
    for leaf, (_, shape, spec) in hj.LAYOUT.items():
        cells = []
        for s in names:
            why = scenarios[s].get(leaf)
            cells.append("-" if why is None else "FAIL" if why else "PASS")
            failures += [f"{leaf} {s}: {w}" for w in why or []]
        print(table.row(leaf, str(shape), str(tuple(spec)), *cells))
    for s in names:
        extra = {k: v for k, v in scenarios[s].items() if k not in hj.LAYOUT}
        for k, why in extra.items():
            print(f"  [{names.index(s)}] {k}: {'FAIL ' + '; '.join(why) if why else 'PASS'}")
    total = sum(len(v) for v in scenarios.values())
    print(f"{harness.verdict(not failures)} {total - len(failures)} of {total} leaf restores "
          "bit-exact on every process")  # fmt: skip
    for f in failures[:20]:
        print("  " + f)
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        print(harness.TAG + json.dumps(worker(**json.loads(sys.argv[2]))), flush=True)
    else:
        main()
