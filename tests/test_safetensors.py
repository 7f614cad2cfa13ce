"""jaxckpt.safetensors against the reference implementation (the ``safetensors`` package)."""

import json
import os
import sys

import jax
import ml_dtypes
import multiproc
import numpy as np
import pytest
from conftest import sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src.safetensors.format import coalesce, runs
from jaxckpt.safetensors import Cast, Reshape, SafetensorsError, Stack, Transpose

snp = pytest.importorskip("safetensors.numpy")

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import from_huggingface as hf  # noqa: E402

DTYPES = [
    np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.float16, ml_dtypes.bfloat16,
    np.int32, np.uint32, np.float32, np.int64, np.uint64, np.float64,
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
]  # fmt: skip


def _values(dtype, shape, seed):
    raw = np.random.default_rng(seed).integers(0, 100, size=shape)
    return (raw % 2).astype(dtype) if dtype == np.bool_ else raw.astype(dtype)


def _read_reference(directory) -> dict:
    """Every tensor as the reference implementation parses it (``safetensors.deserialize``:
    its NumPy loader has no float8 types), as NumPy arrays."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out |= _read_reference_file(os.path.join(directory, name))
    return out


def _read_reference_file(path) -> dict:
    import safetensors

    from jaxckpt._src.safetensors.format import DTYPES

    with open(path, "rb") as f:
        return {
            tensor: np.frombuffer(bytes(t["data"]), DTYPES[t["dtype"]]).reshape(t["shape"])
            for tensor, t in safetensors.deserialize(f.read())
        }


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# --- pure logic ------------------------------------------------------------------------------


def test_runs_and_coalescing():
    assert runs((4, 6), 2, ((1, 3), (2, 4))) == [(16, 4), (28, 4)]  # a row slice each
    assert runs((4, 6), 2, ((1, 3), (0, 6))) == [(12, 24)]  # whole rows: one run
    assert runs((), 4, ()) == [(0, 4)]
    # neighbours merge while what is read stays within 1.5x of what is needed
    assert [g[:2] for g in coalesce([(0, 8), (10, 8), (100, 4)])] == [(0, 18), (100, 4)]


# --- one process -----------------------------------------------------------------------------


def test_round_trip_of_every_dtype_read_by_the_reference(mesh42, tmp_path):
    tree = {"nested": {}, "host": np.arange(6, dtype=np.int64).reshape(2, 3)}
    for k, dtype in enumerate(DTYPES):
        name = np.dtype(dtype).name
        tree["nested"][name] = sharded(_values(dtype, (8, 4), k), mesh42, ("data", "model"))
    tree["scalar"] = jax.device_put(np.float32(2.5))
    jaxckpt.safetensors.save(tmp_path / "m", tree, max_file_bytes=600, metadata={"format": "pt"})
    files = sorted(os.listdir(tmp_path / "m"))
    assert "model.safetensors.index.json" in files and len(files) > 3
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    ref = _read_reference(tmp_path / "m")
    assert set(index["weight_map"]) == set(ref) and index["metadata"]["total_size"] == sum(
        v.nbytes for v in ref.values()
    )
    for name, file in index["weight_map"].items():  # the index points at the right file
        assert name in _read_reference_file(tmp_path / "m" / file)
    for dtype in DTYPES:
        name = np.dtype(dtype).name
        assert _same(ref[f"nested.{name}"], np.asarray(tree["nested"][name])), name
    assert _same(ref["host"], tree["host"]) and _same(ref["scalar"], np.float32(2.5))
    # back onto another mesh, and as NumPy
    other = jax.make_mesh((2, 4), ("data", "model"))
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(other, P("model")))
            if isinstance(x, jax.Array) and x.ndim
            else x
        ),
        tree,
    )
    out = jaxckpt.safetensors.load(tmp_path / "m", target)
    for name in tree["nested"]:
        assert _same(out["nested"][name], tree["nested"][name]), name
        assert out["nested"][name].sharding.mesh.devices.shape == (2, 4)
    assert isinstance(out["host"], np.ndarray) and _same(out["host"], tree["host"])
    info = jaxckpt.safetensors.metadata(tmp_path / "m")
    assert info["nested.bfloat16"].shape == (8, 4) and "__metadata__" not in info
    assert info.metadata == {f: {"format": "pt"} for f in files if f.endswith(".safetensors")}
    by_index = jaxckpt.safetensors.metadata(tmp_path / "m" / "model.safetensors.index.json")
    assert by_index == info  # the index's path: its directory


@pytest.mark.parametrize("shape", [(4, 2), (2, 4), (2, 2)])
def test_hf_llama_files_load_with_transposes_stacked_layers_and_renames(shape, tmp_path):
    c = hf.Config()
    original = hf.write_hf_model(str(tmp_path), c)
    devices = jax.devices()[: shape[0] * shape[1]]
    mesh = jax.make_mesh(shape, ("data", "model"), devices=devices)
    transforms = hf.llama_transforms(c)
    params = jaxckpt.safetensors.load(
        tmp_path, hf.abstract_params(c, mesh), names=hf.LLAMA_NAMES, transforms=transforms
    )
    assert params["layers"]["attn"]["q"]["kernel"].sharding.mesh.devices.size == len(devices)
    h, kv, hd, d = c.heads, c.kv_heads, c.head_dim, c.dim
    for i in range(c.layers):
        q = (
            original[f"model.layers.{i}.self_attn.q_proj.weight"]
            .reshape(h, hd, d)
            .transpose(2, 0, 1)
        )
        assert _same(params["layers"]["attn"]["q"]["kernel"][i], q)
        k = (
            original[f"model.layers.{i}.self_attn.k_proj.weight"]
            .reshape(kv, hd, d)
            .transpose(2, 0, 1)
        )
        assert _same(params["layers"]["attn"]["k"]["kernel"][i], k)
        o = (
            original[f"model.layers.{i}.self_attn.o_proj.weight"]
            .reshape(d, h, hd)
            .transpose(1, 2, 0)
        )
        assert _same(params["layers"]["attn"]["o"]["kernel"][i], o)
        up = original[f"model.layers.{i}.mlp.up_proj.weight"].T
        assert _same(params["layers"]["mlp"]["up"]["kernel"][i], up)
    assert _same(params["lm_head"]["kernel"], original["lm_head.weight"].T)
    # and back: the reference reads exactly the original tensors
    jaxckpt.safetensors.save(
        tmp_path / "again", params, names=hf.LLAMA_NAMES, transforms=transforms
    )
    again = _read_reference(tmp_path / "again")
    assert again.keys() == original.keys()
    assert all(_same(again[k], original[k]) for k in original)


def test_cast_on_save_and_across_kinds_on_load(mesh42, tmp_path):
    x = sharded(np.arange(32, dtype=np.float32).reshape(8, 4), mesh42, ("data", None))
    jaxckpt.safetensors.save(tmp_path / "m", {"x": x}, transforms=[("x", Cast("bfloat16"))])
    assert snp.load_file(tmp_path / "m" / "model.safetensors")["x"].dtype == ml_dtypes.bfloat16
    ints = jax.ShapeDtypeStruct((8, 4), np.int32, sharding=x.sharding)
    with pytest.raises(SafetensorsError, match=r"'x' is bfloat16, leaf 'x' is int32; add a Cast"):
        jaxckpt.safetensors.load(tmp_path / "m", {"x": ints})
    out = jaxckpt.safetensors.load(tmp_path / "m", {"x": ints}, transforms=[("x", Cast("int32"))])
    assert _same(out["x"], np.arange(32, dtype=np.int32).reshape(8, 4))


def test_s3_round_trip(mesh42, s3_url):
    tree = {"a": sharded(np.arange(64, dtype=np.float32).reshape(8, 8), mesh42, ("data", "model"))}
    jaxckpt.safetensors.save(s3_url, tree)
    out = jaxckpt.safetensors.load(
        s3_url, {"a": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=tree["a"].sharding)}
    )
    assert _same(out["a"], tree["a"])
    assert jaxckpt.safetensors.metadata(s3_url + "/model.safetensors")["a"].shape == (8, 8)


def test_s3_truncated_files_name_the_file(s3_url, tmp_path):
    """Object stores have no cheap size: a short file shows in a read past its end."""
    import tensorstore as ts

    from jaxckpt._src.storage import location

    snp.save_file({"w": np.ones((8, 30), np.float32)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    kv = ts.KvStore.open(location(s3_url).kvstore()).result()
    t = {"w": np.zeros((8, 30), np.float32)}
    for cut, why in [(40, "truncated or unreadable"), (len(data) - 4, "truncated")]:
        kv.write("model.safetensors", data[:cut]).result()
        with pytest.raises(SafetensorsError, match=rf"{s3_url}/model\.safetensors.*{why}"):
            jaxckpt.safetensors.load(s3_url + "/model.safetensors", t)


# --- errors ----------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    snp.save_file(
        {"model.w": np.ones((4, 2), np.float32), "model.b": np.zeros(2, np.float32)},
        tmp_path / "model.safetensors",
    )
    return tmp_path


def test_missing_tensor_names_leaf_tensor_and_close_names(small):
    t = {"model": {"W": jax.ShapeDtypeStruct((4, 2), np.float32)}}
    with pytest.raises(SafetensorsError, match=r"'model\.W'.*'model\.W'.*closest: \['model\.w'"):
        jaxckpt.safetensors.load(small, t)


def test_shape_mismatch_after_transforms(small):
    t = {"model": {"w": jax.ShapeDtypeStruct((4, 2), np.float32)}}
    with pytest.raises(
        SafetensorsError,
        match=r"model\.safetensors.*\[4, 2\] gives leaf 'model\.w' shape \[2, 4\]",
    ):
        jaxckpt.safetensors.load(small, t, transforms=[("w", Transpose((1, 0)))])


def test_corrupt_and_truncated_files_and_a_bad_index(small, tmp_path):
    t = {"model": {"w": jax.ShapeDtypeStruct((4, 2), np.float32)}}
    f = small / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"\xff" * 8 + data[8:])
    with pytest.raises(
        SafetensorsError, match=r"model\.safetensors: header length .* out of range"
    ):
        jaxckpt.safetensors.load(small, t)
    f.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(SafetensorsError, match="not valid JSON"):
        jaxckpt.safetensors.load(small, t)
    f.write_bytes(data[:-4])
    with pytest.raises(SafetensorsError, match=r"model\.safetensors is truncated"):
        jaxckpt.safetensors.load(small, t)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.w": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(SafetensorsError, match=r"model-00001-of-00002\.safetensors does not exist"):
        jaxckpt.safetensors.load(small, t)


def test_save_refusals(mesh42, tmp_path):
    with pytest.raises(SafetensorsError, match="PRNG key"):
        jaxckpt.safetensors.save(tmp_path / "k", {"key": jax.random.key(0)})
    x = sharded(np.ones((8, 4), np.float32), mesh42, ("data", None))
    with pytest.raises(SafetensorsError, match=r"several leaves map to tensor\(s\) \['w'\]"):
        jaxckpt.safetensors.save(tmp_path / "d", {"a": x, "b": x}, names=[(r"^(a|b)$", "w")])
    jaxckpt.safetensors.save(tmp_path / "m", {"x": x})
    with pytest.raises(SafetensorsError, match="already exists"):
        jaxckpt.safetensors.save(tmp_path / "m", {"x": x})
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # nothing half-written left


def test_save_refuses_a_leaf_it_cannot_store_and_writes_nothing(tmp_path):
    tree = {"a": np.ones((4, 4), np.float32), "b": {"bad": object()}, "c": np.zeros(2, np.float32)}
    with pytest.raises(
        SafetensorsError,
        match=r"leaf 'b\.bad' is a builtins\.object, which safetensors cannot hold.*np\.asarray",
    ):
        jaxckpt.safetensors.save(tmp_path / "m", tree)
    with pytest.raises(SafetensorsError, match=r"leaf 'n' is a builtins\.int"):
        jaxckpt.safetensors.save(tmp_path / "m", {"a": tree["a"], "n": 3})
    with pytest.raises(SafetensorsError, match=r"leaf 's'.*dtype <U1 has no safetensors name"):
        jaxckpt.safetensors.save(tmp_path / "m", {"s": np.array(["x"])})
    assert os.listdir(tmp_path) == []  # nothing written, not even a temporary directory
    jaxckpt.safetensors.save(tmp_path / "m", {"a": tree["a"], "none": None})  # None: skipped
    assert list(snp.load_file(tmp_path / "m" / "model.safetensors")) == ["a"]


def test_every_step_of_a_transform_chain_applies_in_order(mesh42, tmp_path):
    x = np.arange(256, dtype=np.float32).reshape(16, 16)
    snp.save_file({"x": x, "q": x[:, :8].copy()}, tmp_path / "model.safetensors")
    spec = NamedSharding(mesh42, P("data", "model"))
    target = {"x": jax.ShapeDtypeStruct((16, 16), np.float32, sharding=spec)}
    twice = [(r"^x$", [Transpose((1, 0)), Transpose((1, 0))])]
    assert _same(jaxckpt.safetensors.load(tmp_path, target, transforms=twice)["x"], x)
    # a Reshape after a Transpose
    then = [(r"^x$", [Transpose((1, 0)), Reshape((16, 16), (4, 4, 16))])]
    target = {"x": jax.ShapeDtypeStruct((4, 4, 16), np.float32, sharding=spec)}
    got = jaxckpt.safetensors.load(tmp_path, target, transforms=then)["x"]
    assert _same(got, x.T.reshape(4, 4, 16))
    # Llama's RoPE row permutation of q (HF halves -> interleaved pairs), then (in, out)
    rope = [
        Reshape((16, 8), (4, 2, 2, 8)),
        Transpose((0, 2, 1, 3)),
        Reshape((4, 2, 2, 8), (16, 8)),
        Transpose((1, 0)),
    ]
    model = x[:, :8].reshape(4, 2, 2, 8).transpose(0, 2, 1, 3).reshape(16, 8).T
    target = {"q": jax.ShapeDtypeStruct((8, 16), np.float32, sharding=spec)}
    got = jaxckpt.safetensors.load(tmp_path, target, transforms=[("q", rope)])
    assert _same(got["q"], model) and got["q"].sharding == spec
    # and inverted on save: the file holds the original tensor
    jaxckpt.safetensors.save(tmp_path / "again", got, transforms=[("q", rope)])
    assert _same(snp.load_file(tmp_path / "again" / "model.safetensors")["q"], x[:, :8])
    with pytest.raises(SafetensorsError, match=r"model\.safetensors.*Reshape.*\[8, 16\]"):
        jaxckpt.safetensors.load(tmp_path, target, transforms=[("q", [Transpose((1, 0)), *rope])])


def test_names_rules_are_first_match_and_i_is_the_only_placeholder(mesh42, tmp_path):
    layers = np.arange(2 * 4 * 2, dtype=np.float32).reshape(2, 4, 2)
    tree = {"layers": {"up": layers}, "head": np.ones(3, np.float32)}
    names = [(r"^layers\.(\w+)$", r"model.layers.{i}.\1.weight"), (r"^head$", "lm_head")]
    stack = [(r"^layers\.", [Stack()])]
    jaxckpt.safetensors.save(tmp_path / "m", tree, names=names, transforms=stack)
    ref = snp.load_file(tmp_path / "m" / "model.safetensors")
    assert sorted(ref) == ["lm_head", "model.layers.0.up.weight", "model.layers.1.up.weight"]
    assert _same(ref["model.layers.1.up.weight"], layers[1])
    # first match only: a specific rule, then a catch-all that would also match its result
    rules = [(r"^head$", "lm_head"), (r"^(.*)$", r"model.\1")]
    jaxckpt.safetensors.save(tmp_path / "c", {"head": tree["head"], "w": tree["head"]}, names=rules)
    assert sorted(snp.load_file(tmp_path / "c" / "model.safetensors")) == ["lm_head", "model.w"]
    # transforms: the first rule whose regex matches, the others not at all
    first = [(r"^layers\.", [Stack()]), (r"up", [Stack(), Transpose((1, 0))])]
    out = jaxckpt.safetensors.load(tmp_path / "m", tree, names=names, transforms=first)
    assert _same(out["layers"]["up"], layers)
    # braces other than {i} are not placeholders; {i} without Stack is a mistake
    with pytest.raises(SafetensorsError, match=r"'\{i\}' as its only braces"):
        jaxckpt.safetensors.load(
            tmp_path / "m",
            {"layers": layers},
            names=[(r"^layers$", "l.{i}.{0}")],
            transforms=[("^layers$", [Stack()])],
        )
    with pytest.raises(SafetensorsError, match=r"'head'.*has '\{i\}'.*add Stack\(\)"):
        jaxckpt.safetensors.load(tmp_path / "m", tree, names=[(r"^head$", "h.{i}")])


def test_metadata_keeps_the_files_metadata_apart(tmp_path):
    snp.save_file({"w": np.ones(2, np.float32)}, tmp_path / "a.safetensors", {"format": "pt"})
    info = jaxckpt.safetensors.metadata(tmp_path / "a.safetensors")
    assert list(info) == ["w"] and dict(info.items()) == {"w": info["w"]}
    assert info.metadata == {"a.safetensors": {"format": "pt"}}
    with pytest.raises(KeyError, match="each file's is in .metadata"):
        info["__metadata__"]


def test_errors_name_the_file_and_never_read_outside_its_directory(small, tmp_path):
    t = {"model": {"w": jax.ShapeDtypeStruct((4, 2), np.float32)}}
    f = small / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:8] + data[8:40])  # the header says more bytes than the file holds
    with pytest.raises(SafetensorsError, match=rf"{f}.* is truncated inside its .*-byte header"):
        jaxckpt.safetensors.load(small, t)
    f.write_bytes(data)
    # a valid file outside the directory the index is in: an index naming it is refused
    inside = tmp_path / "model"
    inside.mkdir()
    os.replace(f, inside / "model.safetensors")
    snp.save_file({"model.w": np.full((4, 2), 7, np.float32)}, tmp_path / "secret.safetensors")
    for bad in [
        "../secret.safetensors",
        str(tmp_path / "secret.safetensors"),
        "sub/../../secret.safetensors",
        "model.safetensors/../../secret.safetensors",
        "..\\secret.safetensors",
        "",
        7,
        "model.safetensors.index.json",
    ]:
        (inside / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.w": bad}})
        )
        with pytest.raises(
            SafetensorsError,
            match=r"model\.safetensors\.index\.json: tensor 'model\.w'.*not a \.safetensors file inside",
        ):
            jaxckpt.safetensors.load(inside, t)
    for bad, why in [
        ("[]", "weight_map"),
        ('{"weight_map": []}', "not a non-empty object"),
        ("{", "not a valid index"),
    ]:
        (inside / "model.safetensors.index.json").write_text(bad)
        with pytest.raises(SafetensorsError, match=rf"index\.json.*{why}"):
            jaxckpt.safetensors.metadata(inside)


# --- two processes -----------------------------------------------------------------------------


@pytest.mark.slow
def test_two_processes_save_balanced_and_load_only_what_they_need(tmp_path):
    worker = os.path.join(HERE, "workers", "safetensors_job.py")
    path = str(tmp_path / "m")

    def io(res):
        return [
            json.loads(line.split(" ", 1)[1])
            for out in res.check().outputs
            for line in out.splitlines()
            if line.startswith("IO ")
        ]

    written = [r["wchar"] for r in io(multiproc.run(worker, 2, args=["save", path]))]
    assert max(written) <= 1.25 * sum(written) / 2, written
    ref = _read_reference(path)  # the reference reads every tensor the processes wrote
    sys.path.insert(0, os.path.join(HERE, "workers"))
    assert {"w", "e", "b", "d_float8_e4m3fn", "d_bool"} <= ref.keys() and len(ref) == 15
    assert _same(ref["w"], np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024))
    # each process reads (rchar, page cache dropped) at most 1.5x what its devices need
    for r in io(multiproc.run(worker, 2, args=["load", path])):
        assert r["rchar"] <= 1.5 * r["need"], r


@pytest.mark.slow
@pytest.mark.parametrize("hosts", ["one host", "a host each"])
def test_two_processes_load_nan_payloads_every_process_needs_whole(hosts, tmp_path):
    """Random bit patterns (NaN payloads, -0.0, subnormals) in bf16, f16, f32 and float8,
    replicated like a norm scale: every process needs them whole, so a whole-array
    ``device_put`` would run JAX's cross-process equality check (NaN != NaN); and a stacked
    q projection through Llama's RoPE permutation (reshape, transpose, reshape, transpose),
    saved from shards on two processes. Compared as bytes, with the reference too."""
    env = {"JAXCKPT_TEST_HOSTS": "separate"} if hosts == "a host each" else {}
    worker = os.path.join(HERE, "workers", "safetensors_job.py")
    res = multiproc.run(worker, 2, args=["hostile", str(tmp_path / "m")], env=env).check()
    assert all("ok hostile" in out for out in res.outputs)
