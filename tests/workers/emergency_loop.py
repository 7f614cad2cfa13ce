"""Worker: an EmergencyCheckpointManager in a multi-process job.

usage: emergency_loop.py save ROOT N           saves steps 1..N, then closes
       emergency_loop.py recipe ROOT           the README's resume recipe: latest_step(),
                                                restore if not None, check, ``REPORT``
       emergency_loop.py restore ROOT [TIER STEP]  restores (saved mesh by position, then a
                                                target on another layout), checks the values
                                                and, if given, the tier and step
Each process's local directory is ROOT/host<h> with h = JAXCKPT_TEST_HOSTS[process id]
(a JSON list; default: h = process id), the remote one ROOT/remote. Env: JAXCKPT_TEST_LOCAL,
JAXCKPT_TEST_REMOTE (intervals), JAXCKPT_TEST_REPL (replication), JAXCKPT_TEST_KILL_PID and
JAXCKPT_TEST_KILL_STEP (that process SIGKILLs itself after writing that local step's arrays,
before its commit), JAXCKPT_TEST_MACHINES (a JSON list: the machine each process id runs
on, as JAXCKPT_HOST). Prints ``REPORT <json>`` after a restore, with ``mapped``: the slices
its first restore mapped from the local step's files (``direct.Reader.map``, counted).
The leaf ``big`` is random bfloat16 bits (NaN payloads, -0.0...) in slices of 256 KiB on
(4, 2): those a process restores from its own disk are mapped; values are checked as bits.
"""

import dataclasses
import json
import os
import signal
import sys

import iostats
import multiproc

multiproc.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._src.io import ocdbt_write  # noqa: E402

SPECS = {"w": P("data", "model"), "b": P("model"), "c": P(), "big": P("data")}  # c: 0-d


def expected(step: int) -> dict:
    return {
        "w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step,
        "b": np.arange(32, dtype=np.float32) * step,
        "c": np.asarray(3 * step, np.int32),
        "big": np.random.default_rng(step)
        .integers(0, 1 << 16, (1024, 512), dtype=np.uint16)
        .view(jax.numpy.bfloat16),
        "n": np.arange(5, dtype=np.int64) - step,
        "step": step,
    }


def state(mesh, step: int) -> dict:
    exp = expected(step)
    out = {
        k: jax.make_array_from_callback(
            exp[k].shape, NamedSharding(mesh, spec), lambda i, v=exp[k]: v[i]
        )
        for k, spec in SPECS.items()
    }
    out["n"], out["step"] = exp["n"], step
    out["key"] = jax.random.key(step)
    return out


def check(out: dict, step: int) -> None:
    exp = expected(step)
    assert out["step"] == step, out["step"]
    np.testing.assert_array_equal(out["n"], exp["n"])
    np.testing.assert_array_equal(
        jax.random.key_data(out["key"]), jax.random.key_data(jax.random.key(step))
    )
    for k in SPECS:
        for shard in out[k].addressable_shards:
            got, want = np.asarray(shard.data), np.ascontiguousarray(exp[k][shard.index])
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (k, shard.index)


def kill_after_local_write(step: int) -> None:
    real = ocdbt_write.write

    def write(db, writes, **options) -> None:
        real(db, writes, **options)
        if f"{step:08d}.tmp-" in db.url:
            print("killing myself", jax.process_index(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    ocdbt_write.write = write


def main(mode: str, root: str, rest: list[str]) -> None:
    pid = jax.process_index()
    hosts = json.loads(os.environ.get("JAXCKPT_TEST_HOSTS", "null")) or list(range(64))
    env = os.environ.get
    machines = json.loads(env("JAXCKPT_TEST_MACHINES", "null"))
    if machines:  # which simulated machine each process runs on (peer copies avoid their own)
        os.environ["JAXCKPT_HOST"] = machines[pid]
    timeout_s = float(env("JAXCKPT_TEST_TIMEOUT", 30))
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=int(env("JAXCKPT_TEST_LOCAL", 1)),
        local_max_to_keep=2,
        replication=int(env("JAXCKPT_TEST_REPL", 0)),
        timeout_s=timeout_s,
        remote=jaxckpt.Options(
            save_interval_steps=int(env("JAXCKPT_TEST_REMOTE", 100)),
            max_to_keep=2,
            timeout_s=timeout_s,
        ),
    )
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    mgr = jaxckpt.EmergencyCheckpointManager(
        os.path.join(root, f"host{hosts[pid]}"), os.path.join(root, "remote"), opts
    )
    if mode == "save":
        if int(env("JAXCKPT_TEST_KILL_PID", -1)) == pid:
            kill_after_local_write(int(env("JAXCKPT_TEST_KILL_STEP")))
        for step in range(1, int(rest[0]) + 1):
            mgr.save(step, state(mesh, step))
        mgr.close()
    elif mode == "recipe":  # the README's resume recipe, as written there
        if mgr.latest_step() is not None:
            out = mgr.restore()
            check(out, mgr.last_report.step)
            print("REPORT", json.dumps(dataclasses.asdict(mgr.last_report)), flush=True)
        else:
            print("REPORT null", flush=True)
        mgr.close()
    else:
        with iostats.counting_maps() as maps:
            out = mgr.restore()
        report = mgr.last_report
        check(out, report.step)
        # again, onto another layout given as a target
        other = jax.make_mesh((2, 4), ("data", "model"))
        target = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P()))
                if isinstance(x, jax.Array) and x.ndim
                else x
            ),
            out,
        )
        target["w"] = NamedSharding(other, P("model", "data"))
        check(mgr.restore(target=target), report.step)
        assert mgr.last_report.step == report.step
        print("REPORT", json.dumps({**dataclasses.asdict(report), "mapped": maps[0]}), flush=True)
        if rest:
            assert (report.tier, report.step) == (rest[0], int(rest[1])), report
        mgr.close()
    print("ok", mode, pid, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
