"""Worker: save a state sharded over every process, or restore one and check it.

usage: save_restore.py save|restore DIR

``restore`` checks three ways on whatever process/device layout it runs with: a target on
another mesh layout (2 x 4), ``mesh=`` (8 x 1), and neither (the saved 4 x 2 mesh rebuilt by
position, with the saved axis names). Env JAXCKPT_TEST_KILL_RANK=r: process r SIGKILLs
itself after writing its shards, before the commit barrier (to test a death mid-save).
"""

import os
import signal
import sys

import multiproc

multiproc.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def expected():
    return {
        "w": np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
        "b": np.arange(32, dtype=np.float32),
        "r": np.full((16, 16), 3, np.int32),
        "step": 7,
    }


SPECS = {"w": P("data", "model"), "b": P("model"), "r": P()}


def main(mode: str, path: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    exp = expected()
    if mode == "save":
        tree = {
            k: jax.make_array_from_callback(
                v.shape, NamedSharding(mesh, SPECS[k]), lambda i, v=v: v[i]
            )
            for k, v in exp.items()
            if k in SPECS
        }
        tree["step"] = exp["step"]
        kill_rank = os.environ.get("JAXCKPT_TEST_KILL_RANK")
        if kill_rank is not None and int(kill_rank) == jax.process_index():
            _die_before_barrier("written")
        if os.environ.get("JAXCKPT_TEST_SKEW"):  # processes disagree on the path
            path = f"{path}-{jax.process_index()}"
        jaxckpt.save(path, tree, timeout_s=float(os.environ.get("JAXCKPT_TEST_TIMEOUT", 600)))
        print("saved", jax.process_index())
        return
    other = jax.make_mesh((2, 4), ("data", "model"))
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(other, SPECS[k]))
        for k, v in exp.items()
        if k in SPECS
    }
    target["step"] = 0
    flat = jax.make_mesh((8, 1), ("data", "model"))
    outs = {
        "target": (jaxckpt.restore(path, target=target), other),
        "mesh": (jaxckpt.restore(path, mesh=flat), flat),
        "neither": (jaxckpt.restore(path), None),
    }
    for how, (out, want_mesh) in outs.items():
        assert out["step"] == 7, how
        for k in SPECS:
            arr = out[k]
            got = arr.sharding.mesh
            if want_mesh is None:  # the saved mesh, rebuilt by position
                assert got.axis_names == ("data", "model"), (how, got)
                assert got.devices.shape == (4, 2), (how, got)
                assert arr.sharding.spec == SPECS[k], (how, arr.sharding)
            else:
                assert got == want_mesh, (how, got)
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), exp[k][shard.index])
    print("restored ok", jax.process_index())


def _die_before_barrier(suffix: str) -> None:
    """Makes this process SIGKILL itself when the save reaches its ``suffix`` barrier."""
    from jaxckpt._src import multihost

    real = multihost.barrier

    def barrier(name: str, timeout_s: float, **kw) -> None:
        if name.endswith("/" + suffix):
            print("killing myself", jax.process_index(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real(name, timeout_s, **kw)

    multihost.barrier = barrier


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
