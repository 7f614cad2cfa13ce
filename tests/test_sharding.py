"""Shard layouts (which device writes which index) and mesh JSON."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt import sharding


def test_layout_of_a_partly_replicated_leaf(mesh42):
    lay = sharding.layout(NamedSharding(mesh42, P("model")), (32,))
    # split in 2 over "model", replicated over "data": 2 shards, each written once
    assert lay.indices == (((0, 16),), ((16, 32),))
    assert lay.chunks == (16,)
    assert set(lay.owners) == set(lay.indices)
    assert len(set(lay.owners.values())) == 2
    assert set(lay.owned.values()) == set(lay.indices)  # one process holds every device here
    assert sorted(i for _, i in lay.held_at) == list(lay.indices)  # each index once
    assert all(0 <= k < len(jax.devices()) for k, _ in lay.held_at)


def test_layout_is_cached(mesh42):
    sh = NamedSharding(mesh42, P("data", "model"))
    assert sharding.layout(sh, (64, 32)) is sharding.layout(sh, (64, 32))
    lay = sharding.layout(sh, (64, 32))
    assert len(lay.owners) == 8 and lay.chunks == (16, 16)
    assert sharding.layout(NamedSharding(mesh42, P()), ()).chunks == ()


def test_mesh_json_is_a_fresh_copy(mesh42):
    a = sharding.mesh_to_json(mesh42)
    a["shape"].append(99)
    assert sharding.mesh_to_json(mesh42)["shape"] == [4, 2]
    meshes: list[dict] = []
    sharding.sharding_to_json(NamedSharding(mesh42, P("data")), meshes)
    meshes[0]["axis_names"].append("x")
    assert sharding.mesh_to_json(mesh42)["axis_names"] == ["data", "model"]


def test_held_at_positions_pick_the_right_device_data(mesh42):
    value = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    permuted = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    for mesh in (mesh42, permuted):
        for spec in (P("data", "model"), P("model"), P(None, "data"), P()):
            arr = jax.device_put(value, NamedSharding(mesh, spec))
            lay = sharding.layout(arr.sharding, value.shape)
            assert sorted(i for _, i in lay.held_at) == list(lay.indices)
            for k, index in lay.held_at:
                got = np.asarray(arr.addressable_data(k))
                np.testing.assert_array_equal(got, value[tuple(slice(a, b) for a, b in index)])
