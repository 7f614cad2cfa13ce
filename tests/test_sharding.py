"""Shard layouts (which device writes which index) and mesh JSON."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._src import sharding


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


# --- replica-parallel writes and sub-chunks ------------------------------------------------


def test_chunk_shape_halves_the_largest_dimension_and_divides_the_shard():
    # 1024 x 256 float32 = 1 MiB; at most 64 KiB a chunk: halve the largest dimension first
    c = sharding.chunk_shape((1024, 256), 4, 64 << 10, 1)
    assert np.prod(c) * 4 <= 64 << 10 and 1024 % c[0] == 0 and 256 % c[1] == 0
    assert max(c) <= 4 * min(c)  # close to cubes
    assert sharding.chunk_shape((1024, 256), 4, None, 1) == (1024, 256)  # chunks follow shards
    # a prime extent cannot be split: the other dimension is
    assert sharding.chunk_shape((7, 4096), 4, 4096, 1)[0] == 7
    # replicas on 3 processes: at least 3 chunks along the largest dimension of a big shard
    c = sharding.chunk_shape((1536, 512), 4, None, 3)
    assert c == (512, 512)
    assert sharding.chunk_shape((16, 16), 4, None, 3) == (16, 16)  # small: one writer


def test_groups_cover_the_shard_once_along_chunk_boundaries():
    index = ((0, 1024), (256, 512))
    parts = sharding._groups(index, (128, 256), 3)
    assert [g for _, g in parts] == [0, 1, 2]
    rows = [r[0] for r, _ in parts]
    assert rows[0][0] == 0 and rows[-1][1] == 1024
    assert all(a[1] == b[0] and a[1] % 128 == 0 for a, b in zip(rows, rows[1:], strict=False))
    assert all(r[1] == (256, 512) for r, _ in parts)
    # fewer chunks than replicas: one part a chunk
    assert len(sharding._groups(((0, 256),), (128,), 4)) == 2


def test_write_split_spreads_replicated_shards_over_their_processes(mesh42):
    # one process here: every shard has one holder, so the split is the plain ownership
    s = sharding.write_split(NamedSharding(mesh42, P(None, "model")), (1024, 512), 4, None)
    assert s.chunks == (1024, 256)
    assert all(len(p) == 1 for p in s.parts.values())
    s = sharding.write_split(NamedSharding(mesh42, P()), (1024, 512), 4, 1 << 18)
    assert np.prod(s.chunks) * 4 <= 1 << 18
    (index,) = s.parts
    covered = sum(len(list(sharding.chunks_in(r, s.chunks))) for r, _ in s.parts[index])
    assert covered == (1024 // s.chunks[0]) * (512 // s.chunks[1])
    assert s.writer(index, 0, salt=5) == 0


@pytest.mark.parametrize(
    "spec, shape",
    [
        (P("data", "model"), (8, 6)),
        (P(None, ("data", "model")), (3, 16)),
        (P(("model", "data")), (8,)),
        (P(), (4, 4)),
        (P(), ()),
    ],
)
def test_named_indices_match_jax(mesh42, spec, shape):
    s = NamedSharding(mesh42, spec)
    mesh_json = sharding.mesh_to_json(mesh42)
    got = sharding.named_indices(sharding.spec_to_json(spec), mesh_json, shape)
    ids = [d.id for d in mesh42.devices.flat]
    want = s.devices_indices_map(shape)
    for (index, proc), dev_id in zip(got, ids, strict=True):
        device = next(d for d in want if d.id == dev_id)
        assert index == sharding.from_slices(want[device], shape), (spec, dev_id)
        assert proc == device.process_index


def test_saved_writers_follow_the_split_rule(mesh42, tmp_path):
    import jaxckpt
    from jaxckpt._src.manifest import Manifest

    x = jax.device_put(np.zeros((1024, 512), np.float32), NamedSharding(mesh42, P(None, "model")))
    jaxckpt.save(tmp_path / "c", {"x": x}, chunk_bytes=1 << 17)
    m = Manifest.from_json((tmp_path / "c" / "manifest.json").read_text(), where="test")
    (rec,) = m.leaves
    assert rec.chunk_writers is None and rec.writer_salt == 0  # no per-chunk list
    writers = sharding.saved_writers(rec, m.meshes)
    grid = [s // c for s, c in zip(rec.shape, rec.chunk_shape, strict=True)]
    assert len(writers) == np.prod(grid) and set(writers.values()) == {0}
