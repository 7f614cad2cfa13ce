"""save / metadata of one checkpoint: every dtype and leaf kind round-trips, what is written."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_tree_equal, leaf_spec, sharded
from jax.sharding import NamedSharding
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
    assert "chunk_writers" not in info and info["writer_salt"] == 0  # follows from the spec
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
    spec = leaf_spec(tmp_path / "c", "params/w")  # as docs/FORMAT.md gives it
    np.testing.assert_array_equal(ts.open(spec).result().read().result(), np.asarray(x))


# --- errors ----------------------------------------------------------------------------------


def test_refuses_to_overwrite(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": 1})
    with pytest.raises(errors.CheckpointExistsError, match="already holds"):
        jaxckpt.save(tmp_path / "c", {"a": 2})
    assert jaxckpt.restore(tmp_path / "c") == {"a": 1}


def test_bad_compression_is_refused_naming_path_and_fix(tmp_path):
    with pytest.raises(errors.OptionsError, match=r"/c: compression='lz4'.*'zstd' or 'blosc'"):
        jaxckpt.save(tmp_path / "c", {"a": np.ones(2)}, compression="lz4")
    assert os.listdir(tmp_path) == []


def test_unsupported_leaf_leaves_nothing(tmp_path):
    with pytest.raises(errors.UnsupportedLeafError, match=r"'bad'.*object"):
        jaxckpt.save(tmp_path / "c", {"ok": np.ones(2), "bad": object()})
    assert not os.path.exists(tmp_path / "c")
    assert os.listdir(tmp_path) == []


def _donated(x: jax.Array) -> jax.Array:
    """``x`` after a jit that donates it has run (its buffer is gone)."""
    jax.block_until_ready(jax.jit(lambda a: a + 1, donate_argnums=0)(x))
    return x


@pytest.mark.parametrize("how", ["save", "manager", "stage"])
def test_a_donated_array_is_named_and_nothing_is_written(how, tmp_path, mesh42):
    """A leaf donated (or deleted) before the save read it: an error naming the leaf and
    the fix, not jax's "Array has been deleted", and no step written or listed."""
    sharding = NamedSharding(mesh42, P("data"))
    tree = {"ok": jax.device_put(np.ones((8, 4)), sharding),
            "gone": _donated(jax.device_put(np.ones((8, 4), np.float32), sharding))}  # fmt: skip
    assert tree["gone"].is_deleted()
    with pytest.raises(errors.DeletedArrayError, match=r"'gone'.*donated.*jaxckpt.stage"):
        if how == "save":
            jaxckpt.save(tmp_path / "c", tree)
        elif how == "stage":
            jaxckpt.stage(tree)
        else:
            with jaxckpt.CheckpointManager(tmp_path / "m") as mgr:
                mgr.save(1, tree)
    assert not os.path.exists(tmp_path / "c")
    if how == "manager":
        with jaxckpt.CheckpointManager(tmp_path / "m") as mgr:
            assert mgr.all_steps() == []


def test_an_empty_array_donated_still_saves(tmp_path):
    """An empty leaf has no bytes to lose: deleted or not, its shape and dtype are saved."""
    empty = jnp.zeros((0, 4), jnp.bfloat16)
    empty.delete()
    jaxckpt.save(tmp_path / "c", {"e": empty, "y": jnp.ones(3)})
    out = jaxckpt.restore(tmp_path / "c")
    assert out["e"].shape == (0, 4) and out["e"].dtype == jnp.bfloat16


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


def test_metadata_without_reading_data(mesh42, tmp_path):
    x = sharded(np.ones((8, 4), np.float32), mesh42, ("data", "model"))
    jaxckpt.save(tmp_path / "c", {"x": x, "step": 3}, custom_metadata={"note": "hi"})
    info = jaxckpt.metadata(tmp_path / "c")
    assert info["x"].shape == (8, 4) and info["x"].dtype == np.float32
    assert info["x"].mesh_axes == ("data", "model") and info["x"].mesh_shape == (4, 2)
    assert info["x"].spec == P("data", "model") and info["x"].nbytes == 128
    assert info["step"].value == 3
    assert jaxckpt.custom_metadata(tmp_path / "c") == {"note": "hi"}


def test_the_deprecated_metadata_names_are_gone(tmp_path):
    """0.1.0 drops ``save(metadata=)`` and ``jaxckpt.user_metadata`` (``custom_metadata``
    names both), and the page-cache choices of ``save``'s signature (a manager's ``Options``
    make them): passing them is a TypeError, and nothing is written."""
    for gone in ({"metadata": {"old": True}}, {"direct_io": False}, {"drop_page_cache": True}):
        with pytest.raises(TypeError, match="unexpected keyword"):
            jaxckpt.save(tmp_path / "c", {"step": 3}, **gone)
    with (
        jaxckpt.CheckpointManager(tmp_path / "m") as mgr,
        pytest.raises(TypeError, match="unexpected keyword"),
    ):
        mgr.save(1, {"s": 0}, metadata={"a": 1})
    assert not hasattr(jaxckpt, "user_metadata") and not (tmp_path / "c").exists()


def test_python_float_nans_keep_sign_and_payload(tmp_path):
    """JSON's NaN has no sign or payload: a NaN Python float leaf also carries its 64 bits
    (format 1.5 ``float_bits``); other floats (-0.0, inf, subnormals) are exact as JSON."""
    import struct

    def from_bits(b: int) -> float:
        return struct.unpack("<d", struct.pack("<Q", b))[0]

    def bits(x: float) -> int:
        return struct.unpack("<Q", struct.pack("<d", x))[0]

    tree = {
        "nans": [
            from_bits(b) for b in (0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001)
        ],
        "others": [-0.0, float("inf"), -float("inf"), 5e-324, 0.1],
    }
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c")
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(out), strict=True):
        assert type(b) is float and bits(a) == bits(b), (hex(bits(a)), hex(bits(b)))
    leaves = json.loads((tmp_path / "c" / "manifest.json").read_text())["leaves"]
    assert [leaf.get("float_bits") for leaf in leaves[:4]] == [
        "7ff8000000000000", "fff8000000000000", "7ff0000000000001", None
    ]  # fmt: skip


def _fingerprints(path) -> dict:
    with open(os.path.join(path, "manifest.json")) as f:
        leaves = json.load(f)["leaves"]
    return {leaf["name"]: leaf.get("fingerprint") for leaf in leaves}


def test_fingerprints_follow_the_values_not_the_layout(tmp_path, mesh42):
    """The same values saved from two meshes, as NumPy in small chunks, and through
    TensorStore's writer (zstd) have one fingerprint per leaf; one changed leaf changes
    only its own. (Two processes, every dtype: tests/workers/hostile_job.py.)"""
    rng = np.random.default_rng(0)
    values = {
        "w": rng.standard_normal((16, 24)).astype(jnp.bfloat16),
        "m": rng.standard_normal((8, 4, 16)).astype(np.float32),
        "k": rng.integers(-(2**31), 2**31, (16,), dtype=np.int32),
    }
    other = jax.make_mesh((8,), ("a",))
    layouts = {
        "mesh42": {k: sharded(v, mesh42, P("data")) for k, v in values.items()},
        "mesh8": {k: sharded(v, other, P(*[None] * (v.ndim - 1), "a")) for k, v in values.items()},
        "numpy": values,
    }
    for name, tree in layouts.items():
        jaxckpt.save(tmp_path / name, {**tree, "step": 3})
    jaxckpt.save(tmp_path / "chunked", values, chunk_bytes=64)
    jaxckpt.save(tmp_path / "zstd", layouts["mesh8"], compression="zstd")
    want = _fingerprints(tmp_path / "mesh42")
    assert want["step"] is None and all(len(want[k]) == 24 for k in values)
    for name in ["mesh8", "numpy", "chunked", "zstd"]:
        got = _fingerprints(tmp_path / name)
        assert {k: got[k] for k in values} == {k: want[k] for k in values}, name
    changed = dict(values, m=values["m"].copy())
    changed["m"][3, 2, 1] = np.nextafter(changed["m"][3, 2, 1], np.float32(np.inf))
    jaxckpt.save(tmp_path / "changed", changed)
    got = _fingerprints(tmp_path / "changed")
    assert [k for k in values if got[k] != want[k]] == ["m"]
