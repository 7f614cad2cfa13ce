"""Golden checkpoints that orbax-checkpoint 0.5.10, 0.6.4, 0.11.24 and 0.12.8 wrote
(tests/golden/orbax/make_orbax_golden.py), restored without orbax and compared byte for byte
with the values the generator stored beside them: onto the saved mesh, onto another mesh
through a target, and as NumPy. Also the refusals: what is missing is named, never skipped."""

from __future__ import annotations

import json
import os
import shutil
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.errors import (
    CheckpointNotFoundError,
    MissingDependencyError,
    OrbaxFormatError,
    StorageError,
)

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "orbax")
VERSIONS = sorted(
    (v for v in os.listdir(GOLDEN) if v[0].isdigit()),
    key=lambda v: tuple(int(p) for p in v.split(".")),
)


def expected(version: str) -> tuple[dict, dict[str, np.ndarray]]:
    """The generator's record (styles, leaves' dtype/shape/spec) and the values by name."""
    with open(os.path.join(GOLDEN, version, "expected.json")) as f:
        doc = json.load(f)
    raw = np.load(os.path.join(GOLDEN, version, "expected.npz"))
    values = {}
    for name, leaf in doc["leaves"].items():
        dtype = np.dtype(getattr(ml_dtypes, leaf["dtype"], None) or leaf["dtype"])
        values[name] = raw[name.replace("/", ".")].view(dtype).reshape(leaf["shape"])
    return doc, values


CASES = [(v, s) for v in VERSIONS for s in expected(v)[0]["styles"]]


def golden_path(version: str, style: str) -> str:
    """What a user passes: the item directory, or the MaxText step directory."""
    return os.path.join(GOLDEN, version, style, *(["3"] if style == "maxtext" else []))


def flat(tree) -> dict[str, object]:
    pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v for p, v in pairs}


def assert_bits(got: dict, want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = np.asarray(got[name])
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape)
        assert g.tobytes() == w.tobytes(), name


def nest(leaves: dict[str, object]) -> dict:
    """``{"a/b/0": x}`` as nested dicts, a node keyed 0..n-1 as a list (the saved tree)."""
    root: dict = {}
    for name, v in leaves.items():
        *parents, last = name.split("/")
        node = root
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = v

    def lists(node):
        if not isinstance(node, dict):
            return node
        if node and all(k.isdigit() for k in node):
            return [lists(node[str(i)]) for i in range(len(node))]
        return {k: lists(v) for k, v in node.items()}

    return lists(root)


def spec_of(leaf: dict) -> P:
    return P(*[tuple(e) if isinstance(e, list) else e for e in leaf["spec"]])


@pytest.mark.parametrize(("version", "style"), CASES)
def test_golden_restores_bit_exactly_onto_the_saved_mesh(version, style):
    doc, values = expected(version)
    out = flat(jaxckpt.restore(golden_path(version, style)))
    assert_bits(out, values)
    for name, leaf in doc["leaves"].items():
        if not isinstance(leaf["spec"], list) or not isinstance(out[name], jax.Array):
            continue  # Flax's aggregated leaves (0.5) come back as NumPy: no sharding saved
        sharding = out[name].sharding
        assert isinstance(sharding, NamedSharding) and sharding.spec == spec_of(leaf), name
        assert dict(sharding.mesh.shape) == {"data": 4, "model": 2}
    assert isinstance(out["params/dense/kernel"], jax.Array) and isinstance(out["step"], int)


@pytest.mark.parametrize(("version", "style"), CASES)
def test_golden_restores_onto_another_mesh_target_and_as_numpy(version, style):
    doc, values = expected(version)
    mesh = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    shardings = {}
    target = {}
    for name, leaf in doc["leaves"].items():
        v = values[name]
        if leaf["spec"] == "numpy":
            target[name] = np.zeros_like(v)
        elif leaf["spec"] == "python":
            target[name] = 0
        else:
            spec = spec_of(leaf) if isinstance(leaf["spec"], list) else P()
            shardings[name] = NamedSharding(mesh, spec)
            target[name] = jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[name])
    path = golden_path(version, style)
    out = flat(jaxckpt.restore(path, target=nest(target)))
    assert_bits(out, values)
    for name, sharding in shardings.items():
        assert out[name].sharding == sharding, name
    assert isinstance(out["host"], np.ndarray) and isinstance(out["step"], int)
    bound = flat(jaxckpt.restore(path, mesh=mesh))  # no target: the saved specs on ``mesh``
    assert_bits(bound, values)
    for name in shardings:
        if isinstance(bound[name], jax.Array) and name != "single":
            assert bound[name].sharding == NamedSharding(mesh, spec_of(doc["leaves"][name]))
    as_numpy = flat(
        jaxckpt.restore(path, target=nest({n: np.zeros_like(v) for n, v in values.items()}))
    )
    assert_bits(as_numpy, values)
    assert all(isinstance(v, np.ndarray) for n, v in as_numpy.items() if n != "step")


@pytest.mark.parametrize(("version", "style"), CASES)
def test_golden_metadata_gives_every_shape_and_dtype(version, style):
    _, values = expected(version)
    meta = flat(jaxckpt.metadata(golden_path(version, style)))
    for name, v in values.items():
        if name == "step":
            continue  # a Python scalar: its value, not an ArrayInfo
        assert tuple(meta[name].shape) == v.shape and np.dtype(meta[name].dtype) == v.dtype, name


def copy(tmp_path, version, style) -> str:
    dst = str(tmp_path / f"{version}-{style}")
    shutil.copytree(os.path.join(GOLDEN, version, style), dst, symlinks=True)
    return dst


def test_orbax05_without_its_msgpack_file_is_refused_naming_it(tmp_path):
    path = copy(tmp_path, "0.5.10", "flax")
    os.remove(os.path.join(path, "checkpoint"))
    with pytest.raises(OrbaxFormatError) as e:
        jaxckpt.restore(path)
    text = str(e.value)
    assert f"{path}/checkpoint" in text and "orbax-checkpoint 0.5 or earlier" in text
    assert "skip_deserialize" in text


def test_orbax05_aggregated_leaves_without_msgpack_installed_say_what_to_install(
    tmp_path, monkeypatch
):
    monkeypatch.setitem(sys.modules, "msgpack", None)  # import msgpack raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'jaxckpt\[orbax\]'"):
        jaxckpt.restore(golden_path("0.5.10", "flax"))
    out = flat(jaxckpt.restore(golden_path("0.5.10", "ocdbt")))  # nothing aggregated there
    assert_bits(out, expected("0.5.10")[1])


def test_orbax05_step_without_checkpoint_metadata_is_read_not_called_unfinished(tmp_path):
    step = tmp_path / "run" / "3"
    shutil.copytree(golden_path("0.5.10", "maxtext"), step)
    assert not (step / "_CHECKPOINT_METADATA").exists()
    assert_bits(flat(jaxckpt.restore(step)), expected("0.5.10")[1])
    shutil.copytree(step / "items", step / "other")
    with pytest.raises(OrbaxFormatError, match=r"items \['items', 'other'\]"):
        jaxckpt.restore(step)


@pytest.mark.parametrize("version", ["0.5.10", "0.12.8"])
def test_an_orbax_manager_directory_is_refused_naming_a_step(version):
    run = os.path.join(GOLDEN, version, "maxtext")
    with pytest.raises(OrbaxFormatError, match=r"CheckpointManager directory \(steps \['3'\]\)"):
        jaxckpt.restore(run)


@pytest.mark.parametrize("steps", [["1"], ["1", "2"]])
def test_a_directory_of_numbered_pytree_saves_is_named_a_manager_directory(tmp_path, steps):
    """Orbax saves straight under numbered names (``root/1/_METADATA``) are steps, not the
    items of one step: one is not silently restored, two are not called items."""
    for step in steps:
        shutil.copytree(golden_path("0.12.8", "standard"), tmp_path / "run" / step)
    with pytest.raises(OrbaxFormatError, match=r"CheckpointManager directory.*pass a step"):
        jaxckpt.restore(tmp_path / "run")


def test_an_unfinished_orbax_save_is_refused(tmp_path):
    src = golden_path("0.12.8", "maxtext")
    tmp = tmp_path / "3.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(src, tmp)
    os.remove(tmp / "items" / "_METADATA")
    with pytest.raises(CheckpointNotFoundError, match="never finished"):
        jaxckpt.restore(tmp)


def test_a_missing_chunk_of_a_complete_orbax_checkpoint_is_an_error_not_zeros(tmp_path):
    path = copy(tmp_path, "0.12.8", "no_ocdbt")  # store_array_data_equal_to_fill_value: true
    os.remove(os.path.join(path, "params.dense.kernel", "0.0"))
    with pytest.raises(StorageError, match=r"params\.dense\.kernel/0\.0"):
        jaxckpt.restore(path)


@pytest.mark.parametrize(("version", "style"), [("0.5.10", "flax"), ("0.5.10", "maxtext")])
def test_orbax05_converts_to_jaxckpt_bit_exactly(tmp_path, version, style):
    from jaxckpt._src.cli import convert

    convert.to_jaxckpt(golden_path(version, style), tmp_path / "c")
    assert_bits(flat(jaxckpt.restore(tmp_path / "c")), expected(version)[1])


@pytest.mark.parametrize("name", ["_METADATA", "_sharding", "checkpoint", "params.embed/.zarray"])
def test_an_orbax_file_linked_out_of_the_checkpoint_is_refused(tmp_path, name):
    style = "no_ocdbt" if name.endswith(".zarray") else "flax"
    path = copy(tmp_path, "0.5.10", style)
    decoy = tmp_path / "decoy"
    shutil.copyfile(os.path.join(path, name), decoy)  # the right bytes, outside
    os.remove(os.path.join(path, name))
    os.symlink(decoy, os.path.join(path, name))
    with pytest.raises(OrbaxFormatError, match=f"{path}/{name}: .*outside the checkpoint"):
        jaxckpt.restore(path)
