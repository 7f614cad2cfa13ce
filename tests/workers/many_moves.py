"""Worker: a restore across separate hosts that moves hundreds of leaves (read once + move).

usage: many_moves.py DIR N   N leaves of random bits (float32 and bfloat16), saved over
                             ('data', 'model'), restored replicated over 'data': each one
                             read once and moved; every shard compared as bytes
"""

import os
import sys

import multiproc

multiproc.init()

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from hostile import assert_same_bits, random_bits  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

os.environ["JAXCKPT_HOST"] = f"host{jax.process_index()}"
path, n = sys.argv[1], int(sys.argv[2])
mesh = jax.make_mesh((jax.process_count(), jax.local_device_count()), ("data", "model"))
rng = np.random.default_rng(3)
SHAPES = [(256, 512), (512, 256), (1024,), (256, 256), (512, 512)]  # a signature each, with dtype
values = {
    f"l{i:03d}": random_bits(SHAPES[i % 5], (np.float32, ml_dtypes.bfloat16)[i % 2], rng)
    for i in range(n)
}


def spec(ndim: int, saved: bool) -> P:
    """Saved over ('data', 'model'); restored over 'model' alone (replicated over 'data')."""
    if ndim == 1:
        return P(("data", "model")) if saved else P("model")
    return P("data" if saved else None, "model")


saved = {k: NamedSharding(mesh, spec(v.ndim, True)) for k, v in values.items()}
jaxckpt.save(
    path,
    {
        k: jax.make_array_from_callback(v.shape, saved[k], lambda i, v=v: v[i])
        for k, v in values.items()
    },
)
target = {
    k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, spec(v.ndim, False)))
    for k, v in values.items()
}
out = jaxckpt.restore(path, target)
for k, v in values.items():
    for shard in out[k].addressable_shards:
        assert_same_bits(v[shard.index], np.asarray(shard.data), k)
print("ok", jax.process_index(), flush=True)
