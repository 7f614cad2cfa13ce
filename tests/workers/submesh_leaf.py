"""Worker: a leaf that lives only on process 0's devices (a pipeline stage's parameters),
saved and restored in a 2-process job through jaxckpt.save/restore, a CheckpointManager
and an EmergencyCheckpointManager (peer copies on), onto the same shardings.

usage: submesh_leaf.py ROOT
"""

import os
import shutil
import sys

import multiproc

multiproc.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def main(root: str) -> None:
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    stage0 = Mesh(np.array([d for d in jax.devices() if d.process_index == 0]), ("model",))
    values = {
        "stage0": np.arange(64, dtype=np.float32).reshape(8, 8),
        "shared": np.arange(32, dtype=np.float32),
    }
    shardings = {
        "stage0": NamedSharding(stage0, P("model")),
        "shared": NamedSharding(mesh, P("model")),
    }
    state = {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda i, v=v: v[i], dtype=v.dtype)
        for k, v in values.items()
    }
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in values.items()
    }

    def check(out, how):
        for k, v in values.items():
            assert out[k].sharding == shardings[k], (how, k, out[k].sharding)
            assert out[k].dtype == v.dtype, (how, k)
            for shard in out[k].addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index], err_msg=how)
        print("restored", how, jax.process_index(), flush=True)

    jaxckpt.save(os.path.join(root, "plain"), state)
    check(jaxckpt.restore(os.path.join(root, "plain"), target=target), "jaxckpt.restore")
    with jaxckpt.CheckpointManager(os.path.join(root, "managed")) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
        check(mgr.restore(1, target=target), "CheckpointManager")
    opts = jaxckpt.EmergencyOptions(local_interval_steps=1, replication=1, timeout_s=60)
    local = os.path.join(root, f"local{jax.process_index()}")
    mgr = jaxckpt.EmergencyCheckpointManager(local, os.path.join(root, "remote"), opts)
    mgr.save(1, state)
    mgr.wait_until_finished()
    check(mgr.restore(target=target), "EmergencyCheckpointManager")
    mgr.close()
    # Process 0's disk is lost: its stage comes back from the copy process 1 received as a
    # packed row (the leaf cannot go device to device: process 1 holds none of it).
    if jax.process_index() == 0:
        shutil.rmtree(local)
    with jaxckpt.EmergencyCheckpointManager(local, os.path.join(root, "remote"), opts) as mgr:
        check(mgr.restore(target=target), "from peer copies")
        if jax.process_index() == 0:
            assert {p.leaf for p in mgr.last_report.from_peers} == {"stage0", "shared"}


if __name__ == "__main__":
    main(sys.argv[1])
