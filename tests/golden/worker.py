"""Worker for the golden files' 2-process parts (run through tests/multiproc.py).

usage: worker.py save ROOT            writes ROOT/checkpoint_2proc and ROOT/local/host<p>
                                      (with per-process values since 1.4)
       worker.py restore_local REMOTE ROOT...
                                      restores the local tier of each ROOT/local (copies of
                                      the golden directories; remote tier REMOTE/<i>) and
                                      checks every value; prints ``REPORT <i> <json>`` and
                                      ``PER_PROCESS <i> <json>``
"""

import dataclasses
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for multiproc

import multiproc  # noqa: E402

multiproc.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, HERE)
import values  # noqa: E402

import jaxckpt  # noqa: E402


def local_state(mesh, step):
    out = {
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, P(*values.LOCAL_SPECS[k])), lambda i, v=v: v[i]
        )
        for k, v in values.local_values(step).items()
    }
    out["step"] = step
    return out


def manager(root, remote):
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1,
        replication=1,
        timeout_s=60,
        remote=jaxckpt.Options(save_interval_steps=1000, max_to_keep=3, timeout_s=60),
    )
    local = os.path.join(root, "local", f"host{jax.process_index()}")
    return jaxckpt.EmergencyCheckpointManager(local, remote, opts)


def main(mode, root, rest):
    mesh = jax.make_mesh(values.MESH_SHAPE, values.AXES)
    if mode == "save":
        own = values.per_process(jax.process_index())
        jaxckpt.save(os.path.join(root, "checkpoint_2proc"), values.state(mesh), per_process=own)
        mgr = manager(root, os.path.join(root, "remote"))
        mgr.save(values.STEP, local_state(mesh, values.STEP), per_process=own)
        mgr.close()
    else:  # restore_local REMOTE ROOT...: each root's local tier in turn, in one job
        for i, local_root in enumerate(rest):
            mgr = manager(local_root, os.path.join(root, str(i)))
            out = mgr.restore()
            report = mgr.last_report
            assert (report.tier, report.step) == ("local", values.STEP), (local_root, report)
            assert out["step"] == values.STEP
            for k, v in values.local_values(values.STEP).items():
                for shard in out[k].addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), v[shard.index])
            print("REPORT", i, json.dumps(dataclasses.asdict(report)), flush=True)
            print("PER_PROCESS", i, json.dumps(mgr.per_process(all=True)), flush=True)
            mgr.close()
    print("ok", mode, jax.process_index(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
