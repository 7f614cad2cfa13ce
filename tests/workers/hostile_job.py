"""Worker: every dtype filled with random bits, through the multi-process paths, compared as
bytes on every shard.

usage: hostile_job.py save DIR          jaxckpt.save of the state on a (P, D) mesh
       hostile_job.py restore DIR       restore onto the saved shardings (read once + move
                                        where hosts differ), onto mesh=, onto another target
       hostile_job.py manager DIR       CheckpointManager: async save, then restore
       hostile_job.py emergency ROOT    EmergencyCheckpointManager(replication=1): save step
                                        1; the last process wipes its local directory; every
                                        process restores (its shards from peer copies)
Env: JAXCKPT_TEST_MACHINES=separate gives each process its own machine ($JAXCKPT_HOST);
JAXCKPT_TEST_DTYPES (comma-separated names) narrows the dtypes; the values depend on the
seed only, so any process count restores them.
"""

import os
import shutil
import sys

import multiproc

multiproc.init()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from hostile import DTYPES, assert_same_bits, random_bits  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

SPECS = {"rep": P(None, "model"), "full": P("data", "model"), "all": P()}
SHAPE = (32, 64)


def dtypes() -> list[np.dtype]:
    names = os.environ.get("JAXCKPT_TEST_DTYPES")
    return [d for d in DTYPES if not names or d.name in names.split(",")]


def expected() -> dict:
    rng = np.random.default_rng(19)
    return {
        d.name: {k: random_bits(SHAPE, d, rng) for k in SPECS} for d in dtypes()
    }  # fmt: skip


def state(mesh) -> dict:
    return {
        name: {
            k: jax.make_array_from_callback(
                SHAPE, NamedSharding(mesh, SPECS[k]), lambda i, v=v: v[i]
            )
            for k, v in leaves.items()
        }
        for name, leaves in expected().items()
    }


def check(out: dict, where: str) -> None:
    """Every shard this process holds equals the expected slice, byte for byte."""
    exp = expected()
    for name, leaves in exp.items():
        for k, v in leaves.items():
            arr = out[name][k]
            assert arr.dtype == v.dtype, (where, name, k, arr.dtype)
            for shard in arr.addressable_shards:
                assert_same_bits(v[shard.index], np.asarray(shard.data), f"{where} {name}/{k}")


def target(mesh, spec_of) -> dict:
    return {
        name: {
            k: jax.ShapeDtypeStruct(SHAPE, v.dtype, sharding=NamedSharding(mesh, spec_of(k)))
            for k, v in leaves.items()
        }
        for name, leaves in expected().items()
    }


def main(mode: str, path: str) -> None:
    pid, n = jax.process_index(), jax.process_count()
    if os.environ.get("JAXCKPT_TEST_MACHINES") == "separate":
        os.environ["JAXCKPT_HOST"] = f"host{pid}"
    mesh = jax.make_mesh((n, jax.device_count() // n), ("data", "model"))
    if mode == "save":
        jaxckpt.save(path, state(mesh))
    elif mode == "restore":
        check(jaxckpt.restore(path, target=target(mesh, SPECS.get)), "saved specs")
        check(jaxckpt.restore(path, mesh=mesh), "mesh=")
        other = jax.make_mesh((jax.device_count() // n, n), ("data", "model"))
        check(jaxckpt.restore(path, target=target(other, lambda k: P())), "replicated")
    elif mode == "manager":
        with jaxckpt.CheckpointManager(path) as mgr:
            mgr.save(1, state(mesh))
            mgr.wait_until_finished()
            check(mgr.restore(1, target=target(mesh, SPECS.get)), "manager")
    elif mode == "emergency":
        opts = jaxckpt.EmergencyOptions(
            local_interval_steps=1, replication=1, timeout_s=60, remote_interval_steps=100
        )
        local = os.path.join(path, f"local{pid}")
        with jaxckpt.EmergencyCheckpointManager(local, os.path.join(path, "remote"), opts) as m:
            m.save(1, state(mesh))
        multihost_utils.sync_global_devices("saved")
        if pid == n - 1:
            shutil.rmtree(local)
        multihost_utils.sync_global_devices("wiped")
        with jaxckpt.EmergencyCheckpointManager(local, os.path.join(path, "remote"), opts) as m:
            out = m.restore(target=target(mesh, SPECS.get))
            report = m.last_report
        assert report is not None and report.step == 1, report
        check(out, f"emergency ({report.tier})")
        print("REPORT", report, flush=True)
    print("ok", mode, pid, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
