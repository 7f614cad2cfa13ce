"""Emergency checkpointing: local vs remote saves and restores, 2 processes on 127.0.0.1.

usage: python bench/emergency.py [--mib 1024] [--processes 2] [--repeats 5] [--no-s3]

The state is bench/compare.py's bench state at --mib MiB: a transformer's parameters and Adam
moments (170 leaves; sharded, partly sharded and replicated over a (4, 2) mesh of all the
devices, each process holding its own part). Measures, per process (median over --repeats; the slowest process is reported):
  * blocking time (until ``save`` returns) and wall time (until committed) of a local save
    (replication=1: includes the peer exchange) and of a remote save by the plain
    CheckpointManager to a second directory and to S3 (moto server on 127.0.0.1);
  * the local save (replication=0) against a raw write + fsync of the same bytes from the
    shards' own buffers, alternating (target: >= 0.9x);
  * restore time from local copies, from peer copies (process 1's local directory deleted),
    and from the remote directory and S3;
  * the overhead per training step of ``local_interval_steps=1`` on the example model (the
    Flax MLP + Optax AdamW of examples/train_flax.py, as in examples/resilient_training.py);
  * the first restore from local copies in fresh processes (as after a failure: no memory
    to reuse), mapped (``mapped``) against read (``JAXCKPT_MAP=0``, as before mapping),
    alternating, --fresh-repeats pairs (target: mapped no slower).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shutil
import sys

import harness
from harness import median


def worker(
    root: str, mib: int, s3: str | None, repeats: int, run_log: bool = True, fresh: str = ""
) -> dict:
    """One process: its median seconds of every save, restore and training step measured
    (``fresh``: a step of ``fresh_worker`` instead)."""
    if fresh:
        return fresh_worker(root, mib, fresh)
    import time

    import jax
    import numpy as np

    import jaxckpt
    from jaxckpt._src import multihost

    pid = jax.process_index()
    # the 1 GB bench state of bench/compare.py: a transformer's params + Adam moments, 170
    # leaves, sharded, partly sharded and replicated over a (4, 2) mesh of every device
    import compare

    state, _ = compare.build_state(mib / 1024, compare.make_mesh((4, 2), jax.device_count()))
    jax.block_until_ready(state)
    out: dict[str, float] = {}
    step_no = iter(range(1, 10**6))

    def barrier(name: str) -> None:
        multihost.barrier(f"bench/{name}", 600)

    def timed_save(key: str, mgr, repeats: int) -> None:
        blocking, wall = [], []
        for r in range(repeats):
            barrier(f"{key}/{r}")
            t = time.perf_counter()
            mgr.save(next(step_no), state)
            blocking.append(time.perf_counter() - t)
            mgr.wait_until_finished()
            barrier(f"{key}/{r}/done")
            wall.append(time.perf_counter() - t)
        out[f"{key} blocking"] = median(blocking)
        out[f"{key} wall"] = median(wall)

    def timed_restore(key: str, fn, repeats: int, parts=None) -> None:
        times, split = [], []
        for r in range(repeats):
            barrier(f"{key}/{r}")
            t = time.perf_counter()
            jax.block_until_ready(fn())
            barrier(f"{key}/{r}/done")
            times.append(time.perf_counter() - t)
            if parts is not None:
                split.append(dict(parts()))
        out[key] = median(times)
        if split:  # the emergency restore's phases, median over repeats
            for part in ("plan", "read", "move", "place"):
                at = median(d.get(part, 0.0) for d in split)
                out[f"  {part}{' ' * (6 - len(part))}({key.split(': ')[-1]})"] = at

    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1,
        replication=1,
        timeout_s=600,
        run_log=run_log,
        remote=jaxckpt.Options(save_interval_steps=10**9),
    )
    local_dir = os.path.join(root, f"host{pid}")
    em = jaxckpt.EmergencyCheckpointManager(local_dir, os.path.join(root, "em_remote"), opts)
    timed_save("local save, first (compiles the exchange)", em, 1)
    timed_save("local save, replication=1", em, repeats)
    out["  of which starting the peer copies"] = em.last_save_figures.phases.get(
        "peer_exchange", 0.0
    )
    em0 = jaxckpt.EmergencyCheckpointManager(
        os.path.join(root, f"norepl{pid}"),
        os.path.join(root, "em_remote0"),
        dataclasses.replace(opts, replication=0),
    )
    # the local tier against the disk: the same bytes written raw (one file + fsync, from
    # the shards' own buffers), alternating with the saves; both processes at once
    mine = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            mine.setdefault((id(leaf), str(shard.index)), shard.data)
    buffers = [np.asarray(a) for a in mine.values()]
    raw_s, save_s = [], []
    for r in range(repeats):
        for kind in ("raw", "save") if r % 2 else ("save", "raw"):
            barrier(f"raw-vs-local/{r}/{kind}")
            t = time.perf_counter()
            if kind == "raw":
                raw_file = os.path.join(root, f"raw{pid}.bin")
                harness.write_file(raw_file, buffers)
            else:
                em0.save(next(step_no), state)
                em0.wait_until_finished()
            barrier(f"raw-vs-local/{r}/{kind}/done")
            (raw_s if kind == "raw" else save_s).append(time.perf_counter() - t)
            if kind == "raw":
                os.remove(raw_file)
    out["local save, replication=0 wall (vs raw)"] = median(save_s)
    out["raw write + fsync of the same bytes"] = median(raw_s)
    out["  bytes written locally by this process (GB)"] = sum(b.nbytes for b in buffers) / 1e9
    em0.close()
    remotes = {"dir": os.path.join(root, "remote")}
    if s3:
        remotes["S3"] = s3
    for name, where in remotes.items():
        mgr_opts = jaxckpt.Options(async_save=True, max_to_keep=2, run_log=run_log)
        mgr = jaxckpt.CheckpointManager(where, mgr_opts)
        timed_save(f"manager async save ({name})", mgr, repeats)
        mgr.close()
    # The first restore in a process pays first-touch page faults for fresh memory, whatever
    # it restores from: do one untimed, so the timed ones compare tiers, not their order.
    reading = jaxckpt.Options(read_only=True)  # restores only: no lease, another may read
    warm = jaxckpt.CheckpointManager(remotes["dir"], reading)
    timed_restore("restore (warm-up, remote dir, untimed)", lambda: warm.restore(target=state), 1)
    parts = lambda: em.last_restore_figures.phases  # noqa: E731
    timed_restore("restore: local copies", lambda: em.restore(target=state), repeats, parts)
    assert em.last_report.tier == "local" and not em.last_report.from_peers
    barrier("wipe")
    if pid == jax.process_count() - 1:
        shutil.rmtree(local_dir)
    em.close()
    em = jaxckpt.EmergencyCheckpointManager(local_dir, os.path.join(root, "em_remote"), opts)
    timed_restore(
        "restore: peer copies (one host wiped)", lambda: em.restore(target=state), repeats, parts
    )
    assert em.last_report.tier == "local"
    assert pid != jax.process_count() - 1 or em.last_report.from_peers
    for name, where in remotes.items():
        mgr = jaxckpt.CheckpointManager(where, reading)
        timed_restore(f"restore: remote ({name})", lambda m=mgr: m.restore(target=state), repeats)

    # overhead per step of local_interval_steps=1 on the example model: the Flax MLP with
    # Optax AdamW of examples/train_flax.py (as in examples/resilient_training.py)
    sys.path.insert(0, os.path.join(harness.ROOT, "examples"))
    from jax.sharding import AxisType
    from train_flax import batches, create_state, global_batch, train_step

    mesh2 = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    it = batches()  # the example's Grain pipeline, 20 batches taken before timing
    feed = [global_batch(next(it), mesh2) for _ in range(20)]
    em2 = jaxckpt.EmergencyCheckpointManager(
        os.path.join(root, f"small{pid}"), os.path.join(root, "small_remote"), opts
    )
    per_step: dict[bool, list[float]] = {False: [], True: []}
    for rep, with_save in enumerate((False, True) * (repeats + 1)):
        s, _ = train_step(create_state(mesh2), *feed[0])
        if with_save:
            em2.save(10**6 * (rep + 1), s)  # compiles the exchange before timing
            em2.wait_until_finished()
        jax.block_until_ready(s)
        barrier(f"steps{rep}")
        t = time.perf_counter()
        for i in range(20):
            s, loss = train_step(s, *feed[i])
            if with_save:
                em2.save(10**6 * (rep + 1) + i + 1, s)
        jax.block_until_ready(s)
        em2.wait_until_finished()
        if rep >= 2:  # the first pair warms up
            per_step[with_save].append((time.perf_counter() - t) / 20)
    em2.close()
    out["step without save"] = median(per_step[False])
    out["step with save"] = median(per_step[True])
    out["overhead per step, local_interval_steps=1"] = (
        out["step with save"] - out["step without save"]
    )
    return out


def fresh_worker(root: str, mib: int, what: str) -> dict:
    """``what`` "save": one local step of the bench state, and a tiny checkpoint. "restore":
    in this fresh process, the tiny checkpoint restored (jax and jaxckpt warmed up), then
    the local step, timed: seconds, CPU seconds and the restore's phases."""
    import time

    import jax
    import numpy as np

    import jaxckpt

    pid = jax.process_index()
    import compare  # (after jax set up its devices: the job's own)

    mesh = compare.make_mesh((4, 2), jax.device_count())
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1,
        replication=1,
        timeout_s=600,
        remote=jaxckpt.Options(save_interval_steps=10**9),
    )
    em = jaxckpt.EmergencyCheckpointManager(
        os.path.join(root, f"host{pid}"), os.path.join(root, "remote"), opts
    )
    if what == "save":
        state, _ = compare.build_state(mib / 1024, mesh)
        em.save(1, state)
        em.wait_until_finished()
        em.close()
        jaxckpt.save(os.path.join(root, "tiny"), {"x": np.ones((64, 64), np.float32)})
        return {}
    target = compare.abstract_state(mib / 1024, mesh)
    jaxckpt.restore(os.path.join(root, "tiny"))
    t, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(em.restore(target=target))
    out = {"s": time.perf_counter() - t, "cpu": time.process_time() - cpu}
    assert em.last_report.tier == "local" and not em.last_report.from_peers
    out.update(em.last_restore_figures.phases)
    em.close()
    return out


def fresh_restores(root: str, args) -> dict[str, list[float]]:
    """Seconds of the slowest process's first restore from local copies, in fresh jobs,
    mapped and read (``JAXCKPT_MAP=0``) alternating, each first in turn."""
    job = functools.partial(
        harness.run_job, __file__, args.processes, devices=8 // args.processes, timeout_s=900,
        root=root, mib=args.mib, s3=None, repeats=0,
    )  # fmt: skip
    job(fresh="save")
    times: dict[str, list[float]] = {"mapped": [], "read": []}
    for r in range(args.fresh_repeats):
        for way in ("mapped", "read") if r % 2 == 0 else ("read", "mapped"):
            got = job(fresh="restore", env={"JAXCKPT_MAP": "1" if way == "mapped" else "0"})
            times[way].append(max(x["s"] for x in got))
            harness.log(f"fresh restore, {way}: " + ", ".join(
                f"process {i} {x['s']:.3f} s (CPU {x['cpu']:.3f}, read {x['read']:.3f}, "
                f"place {x['place']:.3f})" for i, x in enumerate(got)))  # fmt: skip
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="total state size")
    ap.add_argument("--processes", type=int, default=2, choices=[2, 4])
    ap.add_argument("--no-s3", action="store_true")
    ap.add_argument("--repeats", type=int, default=5, help="timed saves / restores (median)")
    ap.add_argument(
        "--no-run-log", action="store_true", help="managers keep no run log (its cost: on vs off)"
    )
    ap.add_argument(
        "--fresh-repeats", type=int, default=3, help="fresh-process restore pairs (0: none)"
    )
    args = ap.parse_args()
    env, server, s3 = {}, None, None
    if not args.no_s3:
        import logging

        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_REGION": "us-east-1",
            "NO_PROXY": "127.0.0.1",
            "no_proxy": "127.0.0.1",
        }
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket="bench")
        s3 = "s3://bench/emergency"
    try:
        with harness.scratch("jaxckpt_bench_em_", parent=None) as root:
            results = harness.run_job(
                __file__, args.processes, devices=8 // args.processes, timeout_s=1800, env=env,
                root=root, mib=args.mib, s3=s3, repeats=args.repeats, run_log=not args.no_run_log,
            )  # fmt: skip
            fresh = fresh_restores(os.path.join(root, "fresh"), args) if args.fresh_repeats else {}
    finally:
        if server is not None:
            server.stop()
    print(
        f"\n{args.mib} MiB float32 state, {args.processes} processes (CPU devices), seconds; "
        f"median of {args.repeats} (of the slowest process)"
    )
    worst = {key: max(r[key] for r in results) for key in results[0]}
    harness.Table((("what", "<44"), ("s", ">9.4f")), markdown=True).print(worst.items())
    print("\ntargets (ratios within this run)")
    targets = [
        (
            "local save blocking <= manager async blocking (dir)",
            worst["local save, replication=1 blocking"],
            worst["manager async save (dir) blocking"],
        ),
        (
            "restore from local copies < from S3",
            worst["restore: local copies"],
            worst.get("restore: remote (S3)"),
        ),
        (
            "restore from peer copies < from S3",
            worst["restore: peer copies (one host wiped)"],
            worst.get("restore: remote (S3)"),
        ),
    ]
    ratio = (
        worst["raw write + fsync of the same bytes"]
        / worst["local save, replication=0 wall (vs raw)"]
    )
    print(f"  {harness.verdict(ratio >= 0.9)} {'local save >= 0.9x raw write + fsync':<52} "
          f"{ratio:6.2f}x")  # fmt: skip
    for what, ours, base in targets:
        if base is None:
            print(f"  SKIP {what} (no S3 server: --no-s3)")
            continue
        ok = ours <= base if "<=" in what else ours < base
        print(f"  {harness.verdict(ok)} {what:<52} {ours / base:6.2f}x")
    if fresh:
        mapped, read = median(fresh["mapped"]), median(fresh["read"])
        print(f"\nfirst restore from local copies in fresh processes, {args.fresh_repeats} "
              f"alternating pairs (slowest process, median): mapped {mapped:.3f} s, read "
              f"(JAXCKPT_MAP=0) {read:.3f} s; runs {fresh}")  # fmt: skip
        what = "fresh restore from local copies: mapped <= read"
        print(f"  {harness.verdict(mapped <= read)} {what:<52} {read / mapped:6.2f}x faster")


if __name__ == "__main__":
    harness.entry(main, worker)
