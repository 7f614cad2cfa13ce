"""Worker: save a state sharded over every process, or restore one and check it.

usage: save_restore.py save|restore DIR
"""

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
        jaxckpt.save(path, tree)
        print("saved", jax.process_index())
        return
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, SPECS[k]))
        for k, v in exp.items()
        if k in SPECS
    }
    target["step"] = 0
    for out in (jaxckpt.restore(path, target=target), jaxckpt.restore(path)):
        assert out["step"] == 7
        for k in SPECS:
            arr = out[k]
            assert arr.sharding.mesh.devices.shape == (4, 2), arr.sharding
            for shard in arr.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), exp[k][shard.index])
    print("restored ok", jax.process_index())


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
