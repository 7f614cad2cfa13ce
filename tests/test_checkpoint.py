"""save / restore / metadata of one checkpoint: leaves, dtypes, meshes, targets, errors."""

import collections
import glob
import json
import os

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_equal, sharded
from flax.training import train_state
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors

DTYPES = [
    "bool",
    "int4",
    "int8",
    "int16",
    "int32",
    "uint4",
    "uint8",
    "uint16",
    "uint32",
    "bfloat16",
    "float16",
    "float32",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float8_e3m4",
    "float8_e4m3",
    "float8_e8m0fnu",
    "float4_e2m1fn",
    "complex64",
]


def _values(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    dt = jnp.dtype(dtype)
    if dt == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if jnp.issubdtype(dt, jnp.complexfloating):
        return (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
    if jnp.issubdtype(dt, jnp.integer):
        info = jnp.iinfo(dt)
        return rng.integers(int(info.min), int(info.max) + 1, shape).astype(dt)
    return rng.standard_normal(shape).astype(np.float32).astype(dt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_round_trips_bit_exactly(dtype, mesh42, tmp_path):
    x = _values(dtype, (8, 4))
    tree = {
        "sharded": sharded(x, mesh42, ("data", "model")),
        "replicated": sharded(x, mesh42, ()),
        "numpy": x,
    }
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c")
    assert_tree_equal(out, tree)
    assert out["sharded"].sharding.spec == P("data", "model")


def test_leaf_kinds_round_trip(mesh42, tmp_path):
    single = jax.device_put(jnp.arange(6.0), jax.devices()[3])
    tree = {
        "partial": sharded(
            np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh42, (None, "model")
        ),
        "single": single,
        "scalar0d": sharded(np.float32(3.5), mesh42, ()),
        "empty": sharded(np.zeros((0, 4), np.float32), mesh42, ()),
        "np_empty": np.zeros((3, 0), np.int32),
        "np_scalar": np.float32(2.25),
        "key": jax.random.key(7),
        "keys": jax.device_put(
            jax.random.split(jax.random.key(1), 8), NamedSharding(mesh42, P("data"))
        ),
        "py": [1, 2.5, True, "text", None, -(2**70), 0, False, 0.0, ""],
    }
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert_tree_equal(out, tree)
    assert out["keys"].sharding.spec == P("data")
    assert out["single"].sharding == single.sharding
    # without a target the same values come back (containers as dicts/lists)
    plain = jaxckpt.restore(tmp_path / "c")
    assert_tree_equal(plain, tree)


Point = collections.namedtuple("Point", ["x", "y"])


@flax.struct.dataclass
class Pair:
    a: jax.Array
    b: dict


def test_containers_restore_into_their_types(mesh42, tmp_path):
    arr = sharded(np.ones((4, 2), np.float32), mesh42, ("data",))
    tree = {
        "tuple": (arr, 1),
        "list": [arr, [arr]],
        "named": Point(arr, 2.0),
        "struct": Pair(arr, {"c": arr}),
    }
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert isinstance(out["named"], Point) and isinstance(out["struct"], Pair)
    assert isinstance(out["tuple"], tuple)
    assert_tree_equal(out, tree)
    plain = jaxckpt.restore(tmp_path / "c")
    assert set(plain["struct"]) == {"a", "b"} and set(plain["named"]) == {"x", "y"}


# --- a Flax TrainState with Optax AdamW onto other meshes ---------------------------------


def _train_state(mesh):
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(16)])
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))

    def spec(x):
        if x.ndim == 2:
            return NamedSharding(mesh, P("data", "model"))
        if x.ndim == 1 and x.shape[0] % 2 == 0:
            return NamedSharding(mesh, P("model"))
        return NamedSharding(mesh, P())

    state = jax.tree.map(lambda x: jax.device_put(x, spec(x)) if hasattr(x, "ndim") else x, state)
    grads = jax.tree.map(jnp.ones_like, state.params)
    return state.apply_gradients(grads=grads), spec


@pytest.mark.parametrize(
    "shape,names",
    [
        ((2, 4), ("data", "model")),
        ((8, 1), ("data", "model")),
        ((2, 2), ("data", "model")),
        ((1, 1), ("data", "model")),
    ],
)
def test_train_state_restores_onto_other_meshes(shape, names, mesh42, tmp_path):
    state, _ = _train_state(mesh42)
    jaxckpt.save(tmp_path / "c", state)
    n = shape[0] * shape[1]
    new_mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)
    _, spec = _train_state(new_mesh)
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x)) if hasattr(x, "ndim") else x
        ),
        state,
    )
    out = jaxckpt.restore(tmp_path / "c", target=target)
    assert_tree_equal(out, state)
    leaf = out.params["params"]["layers_0"]["kernel"]
    assert leaf.sharding.mesh.devices.shape == shape
    assert out.opt_state[0].mu["params"]["layers_0"]["kernel"].sharding.mesh.devices.shape == shape


def test_restore_onto_1d_mesh_and_as_numpy(mesh42, tmp_path):
    state, _ = _train_state(mesh42)
    jaxckpt.save(tmp_path / "c", state)
    mesh8 = jax.make_mesh((8,), ("data",))
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh8, P()))
            if hasattr(x, "ndim")
            else x
        ),
        state,
    )
    assert_tree_equal(jaxckpt.restore(tmp_path / "c", target=target), state)
    as_numpy = jax.tree.map(
        lambda x: np.zeros(x.shape, x.dtype) if hasattr(x, "ndim") else x, state
    )
    out = jaxckpt.restore(tmp_path / "c", target=as_numpy)
    assert isinstance(out.params["params"]["layers_0"]["kernel"], np.ndarray)
    assert_tree_equal(
        out, jax.tree.map(lambda x: np.asarray(x) if hasattr(x, "ndim") else x, state)
    )


def test_restore_without_target_uses_numpy_when_mesh_does_not_fit(mesh42, tmp_path):
    x = sharded(np.arange(32.0, dtype=np.float32).reshape(8, 4), mesh42, ("data", "model"))
    # a checkpoint saved on a mesh bigger than the devices we have now
    jaxckpt.save(tmp_path / "c", {"x": x})
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["meshes"][0]["shape"] = [8, 2]  # pretend it was 16 devices
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    out = jaxckpt.restore(tmp_path / "c")
    assert isinstance(out["x"], np.ndarray)
    np.testing.assert_array_equal(out["x"], np.asarray(x))


def test_mesh_argument_binds_saved_specs(mesh42, tmp_path):
    x = sharded(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh42, ("data", "model"))
    y = sharded(np.arange(8.0, dtype=np.float32), mesh42, ("model",))
    jaxckpt.save(tmp_path / "c", {"x": x, "y": y})
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    out = jaxckpt.restore(tmp_path / "c", mesh=mesh)
    assert out["x"].sharding == NamedSharding(mesh, P("data", "model"))
    assert out["y"].sharding == NamedSharding(mesh, P("model"))
    assert_tree_equal(out, {"x": x, "y": y})
    with pytest.raises(errors.ShardingError, match="model"):
        jaxckpt.restore(tmp_path / "c", mesh=jax.make_mesh((8,), ("data",)))


def test_partial_restore_and_missing_leaf(mesh42, tmp_path):
    tree = {
        "a": sharded(np.ones((4, 4), np.float32), mesh42, ("data",)),
        "b": {"c": 1, "d": np.ones(3)},
    }
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c", target={"b": {"d": np.zeros(3)}})
    assert set(out) == {"b"} and set(out["b"]) == {"d"}
    np.testing.assert_array_equal(out["b"]["d"], np.ones(3))
    with pytest.raises(errors.LeafNotFoundError, match="b/e"):
        jaxckpt.restore(tmp_path / "c", target={"b": {"e": np.zeros(3)}})


def test_dtype_cast_on_restore(mesh42, tmp_path):
    x = sharded(np.linspace(-2, 2, 32, dtype=np.float32).reshape(8, 4), mesh42, ("data",))
    jaxckpt.save(tmp_path / "c", {"x": x})
    target = {"x": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=x.sharding)}
    out = jaxckpt.restore(tmp_path / "c", target=target)
    assert out["x"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x).astype(jnp.bfloat16))


def test_sharding_leaves_as_target(mesh42, tmp_path):
    x = sharded(np.arange(16.0, dtype=np.float32).reshape(4, 4), mesh42, ("data",))
    jaxckpt.save(tmp_path / "c", {"x": x})
    s = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("b"))
    out = jaxckpt.restore(tmp_path / "c", target={"x": s})
    assert out["x"].sharding == s
    np.testing.assert_array_equal(out["x"], x)


def test_shape_mismatch(mesh42, tmp_path):
    jaxckpt.save(tmp_path / "c", {"x": np.ones((4, 4))})
    with pytest.raises(errors.ShapeMismatchError, match=r"'x'.*\(4, 4\).*\(4, 5\)"):
        jaxckpt.restore(tmp_path / "c", target={"x": np.zeros((4, 5))})


# --- writes: dedup, chunks, files ------------------------------------------------------------


def test_replicated_array_written_once(mesh42, tmp_path):
    x = sharded(np.random.default_rng(0).standard_normal((512, 512)).astype(np.float32), mesh42, ())
    jaxckpt.save(tmp_path / "c", {"x": x})
    data = sum(
        os.path.getsize(f)
        for f in glob.glob(str(tmp_path / "c" / "arrays" / "**"), recursive=True)
        if os.path.isfile(f)
    )
    assert x.nbytes <= data < 1.05 * x.nbytes + 8192
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["bytes_per_process"] == [x.nbytes]


def test_chunks_follow_shards_and_zstd(mesh42, tmp_path):
    x = sharded(np.zeros((64, 32), np.float32), mesh42, ("data", "model"))
    jaxckpt.save(tmp_path / "c", {"x": x}, compression="zstd")
    info = json.loads((tmp_path / "c" / "manifest.json").read_text())["leaves"][0]
    assert info["chunk_shape"] == [16, 16]
    assert len(info["chunk_writers"]) == 8
    on_disk = sum(
        os.path.getsize(f)
        for f in glob.glob(str(tmp_path / "c" / "**"), recursive=True)
        if os.path.isfile(f)
    )
    assert on_disk < x.nbytes / 4  # zeros compress
    assert_tree_equal(jaxckpt.restore(tmp_path / "c"), {"x": x})


def test_few_files_for_many_arrays(mesh42, tmp_path):
    tree = {
        f"w{i}": sharded(np.full((64, 64), i, np.float32), mesh42, ("data",)) for i in range(200)
    }
    jaxckpt.save(tmp_path / "c", tree)
    files = [f for f in glob.glob(str(tmp_path / "c" / "**"), recursive=True) if os.path.isfile(f)]
    assert len(files) <= 12, files


def test_tensorstore_alone_reads_a_leaf(mesh42, tmp_path):
    import tensorstore as ts

    x = sharded(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh42, ("data", "model"))
    jaxckpt.save(tmp_path / "c", {"params": {"w": x}})
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    leaf = next(leaf for leaf in manifest["leaves"] if leaf["name"] == "params/w")
    # The spec as docs/FORMAT.md gives it: zarr3 over the step's OCDBT database.
    spec = {
        "driver": "zarr3",
        "kvstore": {"driver": "ocdbt", "base": f"file://{tmp_path / 'c' / manifest['arrays']}/"},
        "path": leaf["name"] + "/",
    }
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), np.asarray(x))


def test_corrupted_chunk_is_detected_and_named(mesh42, tmp_path):
    x = sharded(
        np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32), mesh42, ("data",)
    )
    jaxckpt.save(tmp_path / "c", {"layer": {"w": x}})
    files = [
        f
        for f in glob.glob(str(tmp_path / "c" / "arrays" / "**"), recursive=True)
        if os.path.isfile(f)
    ]
    biggest = max(files, key=os.path.getsize)
    with open(biggest, "r+b") as f:
        f.seek(os.path.getsize(biggest) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(errors.ChecksumError, match=r"layer/w.*process 0"):
        jaxckpt.restore(tmp_path / "c")


# --- errors ----------------------------------------------------------------------------------


def test_refuses_to_overwrite(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": 1})
    with pytest.raises(errors.CheckpointExistsError, match="already holds"):
        jaxckpt.save(tmp_path / "c", {"a": 2})
    assert jaxckpt.restore(tmp_path / "c") == {"a": 1}


def test_unsupported_leaf_leaves_nothing(tmp_path):
    with pytest.raises(errors.UnsupportedLeafError, match=r"'bad'.*object"):
        jaxckpt.save(tmp_path / "c", {"ok": np.ones(2), "bad": object()})
    assert not os.path.exists(tmp_path / "c")
    assert os.listdir(tmp_path) == []


def test_missing_and_uncommitted_checkpoints(tmp_path):
    with pytest.raises(errors.CheckpointNotFoundError, match="nothing is there"):
        jaxckpt.restore(tmp_path / "nope")
    jaxckpt.save(tmp_path / "c", {"a": np.ones(2)})
    os.remove(tmp_path / "c" / "COMMITTED")
    with pytest.raises(errors.CheckpointNotFoundError, match="never finished"):
        jaxckpt.restore(tmp_path / "c")


def test_newer_major_format_is_refused(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": np.ones(2)})
    path = tmp_path / "c" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = [2, 0]
    path.write_text(json.dumps(doc))
    with pytest.raises(errors.FormatVersionError, match="version 2.0"):
        jaxckpt.restore(tmp_path / "c")


def test_metadata_without_reading_data(mesh42, tmp_path):
    x = sharded(np.ones((8, 4), np.float32), mesh42, ("data", "model"))
    jaxckpt.save(tmp_path / "c", {"x": x, "step": 3}, metadata={"note": "hi"})
    info = jaxckpt.metadata(tmp_path / "c")
    assert info["x"].shape == (8, 4) and info["x"].dtype == np.float32
    assert info["x"].mesh_axes == ("data", "model") and info["x"].mesh_shape == (4, 2)
    assert info["x"].spec == P("data", "model") and info["x"].nbytes == 128
    assert info["step"].value == 3
    assert jaxckpt.user_metadata(tmp_path / "c") == {"note": "hi"}


def test_single_device_sharding_restore(tmp_path):
    x = jax.device_put(np.arange(4.0), jax.devices()[5])
    jaxckpt.save(tmp_path / "c", {"x": x})
    out = jaxckpt.restore(tmp_path / "c", target={"x": SingleDeviceSharding(jax.devices()[2])})
    assert out["x"].sharding.device_set == {jax.devices()[2]}
    np.testing.assert_array_equal(out["x"], x)


def test_restored_replicas_do_not_share_memory(mesh42, tmp_path):
    """Read buffers become device buffers without a copy, but never two devices' at once."""
    x = sharded(np.arange(512 * 64, dtype=np.float32).reshape(512, 64), mesh42, ("data",))
    jaxckpt.save(tmp_path / "c", {"x": x})
    out = jaxckpt.restore(tmp_path / "c", target={"x": x})["x"]
    pointers = [s.data.unsafe_buffer_pointer() for s in out.addressable_shards]
    assert len(set(pointers)) == len(pointers) == 8
    # donating the restored array must not disturb anything else restored
    other = jaxckpt.restore(tmp_path / "c", target={"x": x})["x"]
    jax.jit(lambda a: a * 2, donate_argnums=0)(out).block_until_ready()
    np.testing.assert_array_equal(np.asarray(other), np.asarray(x))


def test_numpy_byte_order_and_unsupported_dtypes(tmp_path):
    big_endian = np.arange(5, dtype=">f4")
    jaxckpt.save(tmp_path / "c", {"x": big_endian, "i": np.arange(3, dtype=">i8")})
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(out["x"], np.arange(5, dtype=np.float32))
    np.testing.assert_array_equal(out["i"], np.arange(3))
    for bad in (np.array(["a", "b"]), np.array([b"x"]), np.array([object()]), np.zeros(2, "i4,f4")):
        with pytest.raises(errors.UnsupportedLeafError, match=r"'bad'.*dtype"):
            jaxckpt.save(tmp_path / "d", {"bad": bad})
        assert not (tmp_path / "d").exists()


def test_mesh_fills_in_target_leaves_without_sharding(mesh42, tmp_path):
    x = sharded(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh42, ("data", "model"))
    jaxckpt.save(tmp_path / "c", {"x": x, "y": np.ones(3)})
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    target = {"x": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16), "y": np.zeros(3)}
    out = jaxckpt.restore(tmp_path / "c", target=target, mesh=mesh)
    assert out["x"].sharding == NamedSharding(mesh, P("data", "model"))
    assert out["x"].dtype == jnp.bfloat16 and isinstance(out["y"], np.ndarray)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x).astype(jnp.bfloat16))
