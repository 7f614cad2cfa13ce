"""Worker: ``peers.send_shards`` between the processes of a job, checked against the sharding.

usage: peers_send.py SHIFTS   (comma-separated, e.g. "1" or "1,2")
Every process sends its owned shards of several leaves to processes ``p + j`` and checks that
it received exactly the slices its senders hold and it lacks, with their values and senders.
Prints ``OK <json>`` (leaf -> number of slices received, and the leaves sent as rows).
"""

import json
import sys

import multiproc

multiproc.init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax._src.sharding_impls import GSPMDSharding  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jaxckpt._src.emergency import peers  # noqa: E402
from jaxckpt._src.sharding import from_slices  # noqa: E402

shifts = tuple(int(j) for j in sys.argv[1].split(","))
me, count = jax.process_index(), jax.process_count()
n = jax.device_count()
mesh = jax.make_mesh((n // 2, 2), ("data", "model"))
sub = Mesh(np.array(jax.devices()[: n // count]), ("x",))  # process 0's devices only
values = {
    "w": (np.arange(64 * 32, dtype=np.float32).reshape(64, 32), NamedSharding(mesh, P("data", "model"))),
    "b": (np.arange(32).astype(jnp.bfloat16), NamedSharding(mesh, P("model"))),
    "r": (np.arange(8).astype(jnp.int4), NamedSharding(mesh, P())),
    "d": (np.arange(16 * 4, dtype=np.int8).reshape(16, 4), NamedSharding(mesh, P("data"))),
    "t": (np.arange(3 * 2 * 8, dtype=np.float16).reshape(3, 2, 8), NamedSharding(mesh, P(None, "model", "data"))),
    "sub": (np.arange(12, dtype=np.float32), NamedSharding(sub, P("x"))),
    # not a NamedSharding (some jax ops return these): restacked over a flat mesh first
    "g": (np.arange(32 * 4, dtype=np.float32).reshape(32, 4), GSPMDSharding(tuple(mesh.devices.flat), NamedSharding(mesh, P("data"))._to_xla_hlo_sharding(2))),
}  # fmt: skip


def check(values: dict, reuse=None):
    arrays = {
        k: jax.make_array_from_callback(v.shape, s, lambda i, v=v: v[i], dtype=v.dtype)
        for k, (v, s) in values.items()
    }
    moving, as_rows = peers.send_shards(arrays, shifts, reuse=reuse)
    got, origins = moving.collect()
    assert as_rows == ["sub"], as_rows
    counts = {}
    for name, (value, sharding) in values.items():
        if name == "sub":
            continue
        imap = sharding.devices_indices_map(value.shape)
        held = {}
        for d, idx in imap.items():
            held.setdefault(d.process_index, set()).add(from_slices(idx, value.shape))
        expect = {}
        for j in shifts:
            sender = (me - j) % count
            for idx in sorted(held[sender] - held[me]):
                expect.setdefault(idx, sender)
        mine = {i: a for (nm, i), a in got.items() if nm == name}
        assert set(mine) == set(expect), (name, sorted(mine), sorted(expect))
        for idx, sender in expect.items():
            assert origins[(name, idx)] == sender, (name, idx, origins[(name, idx)], sender)
            want = value[tuple(slice(a, b) for a, b in idx)]
            assert mine[idx].dtype == want.dtype, (name, mine[idx].dtype, want.dtype)
            np.testing.assert_array_equal(mine[idx], want)
        counts[name] = len(mine)
    return moving, counts


moving, counts = check(values)
# Again with other values, into the first transfer's buffers (donated: no allocation)
first = [b for bufs in moving._buffers.values() for b in bufs]
assert first
flipped = {k: (np.ascontiguousarray(v[::-1]), s) for k, (v, s) in values.items()}
_, again = check(flipped, reuse=moving)
assert again == counts, (again, counts)
assert all(b.is_deleted() for b in first), "the reused buffers were not donated"
print("OK", json.dumps({"received": counts, "as_rows": ["sub"]}), flush=True)
