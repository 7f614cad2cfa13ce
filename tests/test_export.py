"""jaxckpt.export: a sharded Flax MLP exported on a (4, 2) mesh, served elsewhere."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import json
import shutil
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors

nn = pytest.importorskip("flax.linen")
pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")

AXES = ("data", "model")
BATCHES = (4, 8, 12)  # multiples of the data axis in every variant (4, 2 and 1)
SPECS = {
    "params": {
        "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
        "Dense_1": {"kernel": P("model", None), "bias": P()},
    }
}


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(512)(x))  # Dense_0: (32, 512), Dense_1: (512, 8)
        return nn.Dense(8)(hidden)


def apply(params, x):
    return MLP().apply(params, x)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    mesh = jax.make_mesh((4, 2), AXES)
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 32)))
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, SPECS)
    x_spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 32"), jnp.float32)
    path = root / "mlp"
    sig = jaxckpt.export.save(
        path,
        apply,
        params,
        x_spec,
        mesh=mesh,
        in_specs=(P("data", None),),
        out_specs=P("data", None),
        device_counts=[1, 4, 8],
    )
    host_params = jax.device_get(params)
    data = root / "data"
    data.mkdir()
    rng = np.random.default_rng(0)
    for b in (3, *BATCHES):
        x = rng.standard_normal((b, 32)).astype(np.float32)
        np.save(data / f"x_{b}.npy", x)
        np.save(data / f"y_{b}.npy", np.asarray(apply(host_params, x)))
    return SimpleNamespace(path=path, data=data, sig=sig, host_params=host_params)


def _copy(exported, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(exported.path, dst)
    return dst


# Runs in a fresh interpreter whose sys.path holds no test or model code.
SERVE = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np
    from jax.sharding import Mesh
    import jaxckpt

    path, data, permute, batches = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    mesh = None
    if permute == "1":
        order = [5, 2, 7, 0, 3, 6, 1, 4]
        mesh = Mesh(np.array(jax.devices())[order].reshape(4, 2), ("data", "model"))
    served = jaxckpt.export.load(path, mesh=mesh)
    out = {"devices": jax.device_count(), "errors": {}, "specs": set(), "mesh_ids": None}
    for b in batches.split(","):
        y = served(np.load(f"{data}/x_{b}.npy"))
        want = np.load(f"{data}/y_{b}.npy")
        out["errors"][b] = float(np.max(np.abs(np.asarray(y) - want)))
        assert y.shape == want.shape, (y.shape, want.shape)
        out["specs"].add(str(y.sharding.spec))
        out["axis_sizes"] = list(y.sharding.mesh.devices.shape)
        out["mesh_ids"] = [d.id for d in y.sharding.mesh.devices.flat]
    out["specs"] = sorted(out["specs"])
    out["model_code"] = sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "test_export"))
    print(json.dumps(out))
    """
)


def test_serves_in_fresh_processes_on_8_permuted_4_and_1_devices(exported, tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    runs = {  # devices: (permute, batches)
        8: ("1", ",".join(map(str, BATCHES))),
        4: ("0", ",".join(map(str, BATCHES))),
        1: ("0", ",".join(map(str, (3, *BATCHES)))),
    }
    procs = {}
    for n, (permute, batches) in runs.items():
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
        env["JAX_PLATFORMS"] = "cpu"
        cmd = [
            sys.executable,
            str(script),
            str(exported.path),
            str(exported.data),
            permute,
            batches,
        ]
        procs[n] = subprocess.Popen(
            cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    expected_sizes = {8: [4, 2], 4: [2, 2], 1: [1, 1]}
    for n, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"{n} devices:\n{stderr[-3000:]}"
        out = json.loads(stdout.strip().splitlines()[-1])
        assert out["devices"] == n
        assert set(out["errors"]) == set(runs[n][1].split(","))
        assert max(out["errors"].values()) < 1e-4, out["errors"]
        assert out["specs"] == [str(P("data", None))]
        assert out["axis_sizes"] == expected_sizes[n]
        assert out["model_code"] == []
        if n == 8:  # outputs live on the caller's permuted mesh
            assert out["mesh_ids"] == [5, 2, 7, 0, 3, 6, 1, 4]


def test_symbolic_batch_sizes_in_process(exported):
    served = jaxckpt.export.load(exported.path)
    assert served.variant["device_count"] == 8
    rng = np.random.default_rng(1)
    for b in (4, 8, 16, 40):
        x = rng.standard_normal((b, 32)).astype(np.float32)
        y = served(x)
        assert y.shape == (b, 8)
        assert y.sharding.spec == P("data", None)
        np.testing.assert_allclose(np.asarray(y), apply(exported.host_params, x), atol=1e-5)
    one = Mesh(np.array(jax.devices()[3:4]).reshape(1, 1), AXES)  # any b on one device
    single = jaxckpt.export.load(exported.path, mesh=one)
    for b in (1, 3, 5):
        x = rng.standard_normal((b, 32)).astype(np.float32)
        np.testing.assert_allclose(np.asarray(single(x)), apply(exported.host_params, x), atol=1e-5)


def test_signature(exported):
    sig = json.loads((exported.path / "signature.json").read_text())
    assert sig == exported.sig
    assert sig["format"] == "jaxckpt.export" and sig["format_version"] == list(
        jaxckpt.FORMAT_VERSION
    )
    assert sig["versions"]["jax"] == jax.__version__ and sig["versions"]["jaxlib"]
    assert sig["mesh"]["axis_names"] == list(AXES)
    assert sig["mesh"]["exported_from"] == [4, 2]
    assert sig["inputs"] == [
        {"index": 0, "name": "x", "shape": ["b", 32], "dtype": "float32", "spec": ["data", None]}
    ]
    assert sig["outputs"] == [
        {"name": "_root", "shape": ["b", 8], "dtype": "float32", "spec": ["data", None]}
    ]
    variants = {v["device_count"]: v for v in sig["variants"]}
    assert {n: v["axis_sizes"] for n, v in variants.items()} == {1: [1, 1], 4: [2, 2], 8: [4, 2]}
    assert variants[8]["input_divisors"] == [[4, 1]]
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    for v in variants.values():
        assert lo <= v["calling_convention_version"] <= hi
        assert len(v["sha256"]) == 64 and v["platforms"] == ["cpu"]
        assert isinstance(v["serialization_version"], int)
    specs = {leaf["name"]: leaf["spec"] for leaf in sig["params"]["leaves"]}
    assert specs["params/Dense_0/kernel"] == [None, "model"]
    assert specs["params/Dense_1/bias"] == []
    assert jaxckpt.export.load(exported.path).signature == sig


def test_axis_size_rule():
    rule = jaxckpt.export.axis_sizes_for
    assert [rule((4, 2), n) for n in (1, 2, 4, 6, 8, 16)] == [
        (1, 1),
        (1, 2),
        (2, 2),
        (3, 2),
        (4, 2),
        (8, 2),
    ]
    assert rule((2, 2, 2), 4) == (1, 2, 2)


def test_parameters_stored_once(exported):
    manifests = [f for _, _, files in os.walk(exported.path) for f in files if f == "manifest.json"]
    assert len(manifests) == 1  # one jaxckpt checkpoint: params/
    restored = jaxckpt.restore(exported.path / "params")
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(exported.host_params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), b)
    kernel = np.asarray(exported.host_params["params"]["Dense_0"]["kernel"])
    artifacts = sorted((exported.path / "artifacts").iterdir())
    assert [a.name for a in artifacts] == [f"devices_{n}.jaxexport" for n in (1, 4, 8)]
    total = sum(a.stat().st_size for a in artifacts)
    assert total < kernel.nbytes  # no variant carries the weights
    for a in artifacts:
        blob = a.read_bytes()
        assert kernel.tobytes()[:64] not in blob and kernel.tobytes()[-64:] not in blob


def test_unavailable_device_count_and_wrong_mesh(exported):
    two = Mesh(np.array(jax.devices()[:2]).reshape(2, 1), AXES)
    with pytest.raises(errors.ExportError, match=r"exported for \[1, 4, 8\] device\(s\), not 2"):
        jaxckpt.export.load(exported.path, mesh=two)
    flipped = Mesh(np.array(jax.devices()).reshape(2, 4), AXES)
    with pytest.raises(errors.ExportError, match=r"'data': 4, 'model': 2"):
        jaxckpt.export.load(exported.path, mesh=flipped)


def test_wrong_inputs_name_the_argument(exported):
    served = jaxckpt.export.load(exported.path)
    x = np.zeros((8, 32), np.float32)
    cases = [
        (x.astype(np.float64), r"argument 0 \('x'\) has the wrong dtype.*float32.*float64"),
        (x[:, :31], r"argument 0 \('x'\) has the wrong size in dimension 1.*\(b, 32\).*\(8, 31\)"),
        (x[None], r"argument 0 \('x'\) has the wrong number of dimensions"),
        (x[:6], r"argument 0 \('x'\) has size 6 in dimension 0, which is split 4 ways"),
    ]
    for bad, pattern in cases:
        with pytest.raises(errors.ExportArgumentError, match=pattern):
            served(bad)
    with pytest.raises(errors.ExportArgumentError, match=r"takes 1 argument\(s\) \['x'\], got 2"):
        served(x, x)


def test_corrupted_or_missing_artifact(exported, tmp_path):
    path = _copy(exported, tmp_path)
    art = path / "artifacts" / "devices_8.jaxexport"
    blob = bytearray(art.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    art.write_bytes(bytes(blob))
    with pytest.raises(errors.ChecksumError, match=r"devices_8\.jaxexport is corrupt"):
        jaxckpt.export.load(path)
    art.unlink()
    with pytest.raises(errors.ExportError, match=r"devices_8\.jaxexport is missing"):
        jaxckpt.export.load(path)
    four = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), AXES)  # other variants still load
    assert jaxckpt.export.load(path, mesh=four).variant["device_count"] == 4


def test_unsupported_versions(exported, tmp_path):
    path = _copy(exported, tmp_path)
    sig_file = path / "signature.json"
    original = json.loads(sig_file.read_text())
    hi = jax.export.maximum_supported_calling_convention_version

    def load_with(change):
        sig = json.loads(json.dumps(original))
        change(sig)
        sig_file.write_text(json.dumps(sig))
        jaxckpt.export.load(path)

    def newer_calling_convention(sig):
        sig["variants"][-1]["calling_convention_version"] = hi + 1

    with pytest.raises(errors.FormatVersionError, match=rf"version {hi + 1}.*supports.*\.\.{hi}"):
        load_with(newer_calling_convention)

    def newer_serialization(sig):
        sig["variants"][-1]["serialization_version"] = 999

    with pytest.raises(errors.FormatVersionError, match=rf"version 999.*jax {jax.__version__}"):
        load_with(newer_serialization)

    def newer_format(sig):
        sig["format_version"] = 99

    with pytest.raises(errors.FormatVersionError, match=r"format version 99\.0.*major version 1"):
        load_with(newer_format)


def test_save_refusals(exported, tmp_path):
    mesh = jax.make_mesh((4, 2), AXES)
    x_spec = jax.ShapeDtypeStruct((8, 32), jnp.float32)
    kw = dict(mesh=mesh, in_specs=P("data", None), out_specs=P("data", None))
    with pytest.raises(errors.CheckpointExistsError, match="already holds an export"):
        jaxckpt.export.save(exported.path, apply, exported.host_params, x_spec, **kw)
    with pytest.raises(errors.ExportError, match=r"names axes \['batch'\]"):
        jaxckpt.export.save(
            tmp_path / "a", apply, exported.host_params, x_spec, **{**kw, "in_specs": P("batch")}
        )
    odd = jax.ShapeDtypeStruct(jax.export.symbolic_shape("2*b, 32"), jnp.float32)
    with pytest.raises(errors.ExportError, match=r"expression '2\*b' and is split 4 ways"):
        jaxckpt.export.save(tmp_path / "b", apply, exported.host_params, odd, **kw)


def test_two_arguments_share_a_symbol_and_dict_outputs(tmp_path):
    mesh = jax.make_mesh((4, 2), AXES)
    params = {
        "w": jax.device_put(np.ones((16, 8), np.float32), NamedSharding(mesh, P(None, "model")))
    }

    def score(p, x, mask):
        y = x @ p["w"]
        return {"y": y, "total": (y * mask[:, None]).sum(axis=1)}

    x_spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 16"), jnp.float32)
    mask_spec = jax.ShapeDtypeStruct((x_spec.shape[0],), jnp.float32)
    out_specs = {"y": P("data", "model"), "total": P()}
    jaxckpt.export.save(
        tmp_path / "e",
        score,
        params,
        x_spec,
        mask_spec,
        mesh=mesh,
        in_specs=(P("data"), P()),
        out_specs=out_specs,
    )
    served = jaxckpt.export.load(tmp_path / "e")
    x, mask = np.ones((8, 16), np.float32), np.arange(8, dtype=np.float32)
    out = served(x, mask)
    assert out["y"].sharding.spec == P("data", "model")
    np.testing.assert_allclose(np.asarray(out["total"]), 128 * mask)
    with pytest.raises(
        errors.ExportArgumentError, match=r"argument 1 \('mask'\) has b=4.*argument 0 has b=8"
    ):
        served(x, mask[:4])


def test_the_callers_parameters_stay_alive_after_export(tmp_path):
    """Parameters on the export mesh's devices in another order, shards of the same shape:
    an int8 table (its own bits) was donated to jax's put and deleted under the caller."""
    mesh = jax.make_mesh((4, 2), AXES)
    permuted = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), AXES)
    table = np.arange(64, dtype=np.int8).reshape(8, 8)
    params = {
        "table": jax.device_put(table, NamedSharding(permuted, P("data"))),
        "scale": jax.device_put(np.full(8, 0.5, np.float32), NamedSharding(permuted, P())),
    }
    jaxckpt.export.save(
        tmp_path / "e",
        lambda p, x: x * p["scale"],
        params,
        jax.ShapeDtypeStruct((8,), jnp.float32),
        mesh=mesh,
        in_specs=(P(),),
        out_specs=P(),
    )
    assert not any(x.is_deleted() for x in params.values())
    assert np.array_equal(np.asarray(params["table"]), table)
    saved = jaxckpt.restore(tmp_path / "e" / "params")
    assert np.array_equal(np.asarray(saved["table"]), table)


def test_parameters_keep_their_bytes(tmp_path):
    """Parameters of every dtype filled with random bits, on another mesh than the export's
    or as NumPy values, are placed and stored byte for byte (bf16 NaN payloads included)."""
    from hostile import DTYPES, assert_same_bits, random_bits

    rng = np.random.default_rng(3)
    other = jax.make_mesh((2, 4), AXES)
    dtypes = [d for d in DTYPES if jax.dtypes.canonicalize_dtype(d) == d]
    narrow = {"int1", "uint1", "int2", "uint2"}  # jax.export can't serialize these
    with pytest.raises(errors.ExportError, match=r"cannot serialize int2 \(parameters \['w'\]"):
        jaxckpt.export.save(
            tmp_path / "narrow",
            lambda p, x: x,
            {"w": np.zeros(4, dtype=ml_dtypes.int2)},
            jax.ShapeDtypeStruct((4,), jnp.float32),
            mesh=jax.make_mesh((4, 2), AXES),
            in_specs=(P(),),
            out_specs=P(),
        )
    assert not (tmp_path / "narrow").exists()
    params = {d.name: random_bits((8, 8), d, rng) for d in dtypes if d.name not in narrow}
    placed = {
        k: jax.device_put(v, NamedSharding(other, P("model", "data"))) for k, v in params.items()
    }
    spec = jax.ShapeDtypeStruct((4,), jnp.float32)
    for name, tree in (("arrays", placed), ("numpy", params)):
        jaxckpt.export.save(
            tmp_path / name,
            lambda p, x: x,
            tree,
            spec,
            mesh=jax.make_mesh((4, 2), AXES),
            in_specs=(P(),),
            out_specs=P(),
        )
        restored = jaxckpt.restore(tmp_path / name / "params")
        for k, v in params.items():
            assert_same_bits(v, np.asarray(restored[k]), f"{name} {k}")


def test_signature_keeps_the_fields_a_newer_minor_version_adds(exported, tmp_path):
    """A reader ignores fields it does not know when serving; signature() still shows them."""
    path = _copy(exported, tmp_path)
    sig_file = os.path.join(path, "signature.json")
    with open(sig_file) as f:
        doc = json.load(f)
    doc["added_later"] = {"note": 1}
    doc["params"]["added_later"] = True
    with open(sig_file, "w") as f:
        json.dump(doc, f)
    got = jaxckpt.export.signature(path)
    assert got == doc
    jaxckpt.export.load(path)  # and it still serves
