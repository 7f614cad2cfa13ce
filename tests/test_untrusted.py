"""Files from elsewhere are untrusted input: ``manifest.json``, ``local.json`` and an export's
``signature.json``, each mutated from a real file jaxckpt wrote.

The rule: a reader either loads the file exactly (the result is what the file says, arrays
bit-exact), or raises a :mod:`jaxckpt.errors` class whose message names the file and what is
wrong. Never a bare KeyError/ValueError/TypeError/AttributeError/IndexError, never a silently
partial result, never a read outside the checkpoint's directory (an audit hook watches every
file Python opens or lists; a full copy of the checkpoint sits next to it as a decoy).

Mutations: truncation, garbage bytes, or one to three fields each replaced by a hostile value
(wrong JSON type, huge or negative numbers, long lists, paths leaving the directory), removed,
or tweaked within its type. (The emergency tier refuses a damaged local.json by logging a
warning naming it and treating that copy as missing; its parser raises the error.) After the module, each reader's inputs and outcomes are printed
(``--hypothesis-show-statistics`` shows them as hypothesis events too); longer runs:
``JAXCKPT_HYPOTHESIS_PROFILE=fuzz pytest tests/test_untrusted.py``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import json
import logging
import os
import shutil
import sys

import jax
import numpy as np
import pytest
from conftest import sharded
from hypothesis import event, given, note
from hypothesis import strategies as st

import jaxckpt
from jaxckpt._src import tree
from jaxckpt._src.emergency import local
from jaxckpt.errors import CheckpointError, ManifestError

# --- watching for reads outside the directory ------------------------------------------------

_WATCH: dict = {"root": None, "inside": (), "escaped": []}


def _audit(name: str, args: tuple) -> None:
    if _WATCH["root"] is None or name not in ("open", "os.listdir", "os.scandir"):
        return
    path = args[0] if args else None
    if not isinstance(path, (str, bytes, os.PathLike)):
        return
    path = os.path.realpath(os.fsdecode(path))
    if path.startswith(_WATCH["root"]) and not any(
        path == d or path.startswith(d + os.sep) for d in _WATCH["inside"]
    ):
        _WATCH["escaped"].append((name, path))


sys.addaudithook(_audit)


class _Watch:
    """Records every file opened or listed under ``root`` but outside ``inside``."""

    def __init__(self, root, *inside):
        self.root = os.path.realpath(root)
        self.inside = tuple(os.path.realpath(d) for d in inside)

    def __enter__(self):
        _WATCH.update(root=self.root, inside=self.inside, escaped=[])
        return self

    def __exit__(self, *exc):
        escaped = _WATCH["escaped"]
        _WATCH.update(root=None, inside=(), escaped=[])
        assert not escaped, f"read outside the directory: {escaped[:5]}"


# --- mutations ---------------------------------------------------------------------------------

ESCAPES = ["../decoy", "../decoy/arrays", "..", "/", "/etc/passwd", "./../decoy", "a/../../decoy"]
HUGE = [-1, -(2**63), 2**31, 2**53 + 1, 2**63, 2**64, 10**30, 0, 1]
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(HUGE),
    st.integers(),
    st.floats(),
    st.sampled_from(ESCAPES),
    st.text(max_size=12),
    st.just("x" * 100_000),
    st.lists(st.sampled_from(HUGE), max_size=6),
    st.lists(st.text(max_size=4), max_size=4),
    st.just([[0, 1]] * 5000),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


def _nodes(doc, at=()):
    """Every (path, value) in a JSON document, the root's children first."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc)
    for k, v in items:
        yield (*at, k), v
        if isinstance(v, (dict, list)):
            yield from _nodes(v, (*at, k))


def _set(doc, at, value, delete=False):
    node = doc
    for k in at[:-1]:
        node = node[k]
    if delete:
        del node[at[-1]]
    else:
        node[at[-1]] = value


def _tweaks(v):
    """Changes that keep ``v``'s JSON type."""
    if isinstance(v, bool):
        return [not v]
    if isinstance(v, int):
        return [v + 1, v - 1, -v - 1, v * 2**40 + 1, 2**64]
    if isinstance(v, float):
        return [v * 2, -v, float("nan"), float("inf")]
    if isinstance(v, str):
        return ["../" + v, "/" + v, v + "x", "", v.upper(), "../decoy"]
    if isinstance(v, list):
        long = v * (1000 if len(v) < 10 else 2)  # stays under a million entries
        return [v[:-1], v + v[-1:], v[::-1], [], long] if v else [[0], [None]]
    if isinstance(v, dict):
        return [{}, {**v, "unknown_field_of_a_later_minor": 1}, dict(list(v.items())[:-1])]
    return [0, "", [], {}]


@st.composite
def mutated(draw, original: bytes, utf8: bool = False):
    """``original`` (a JSON file) truncated, or with garbage bytes, or with one to three
    fields changed: returns (bytes, what was done). ``utf8``: garbage stays valid UTF-8."""
    doc = json.loads(original)
    how = draw(st.sampled_from(["truncate", "garbage", "replace", "delete", "tweak", "tweak"]))
    if how == "truncate":
        n = draw(st.integers(0, len(original) - 1))
        return original[:n], f"truncated to {n} bytes"
    if how == "garbage":
        at = draw(st.integers(0, len(original) - 1))
        junk = draw(st.binary(min_size=1, max_size=16))
        if utf8:
            junk = draw(st.text(min_size=1, max_size=8)).encode()
        return original[:at] + junk + original[at + len(junk) :], f"garbage {junk!r} at {at}"
    whats = []
    for _ in range(draw(st.integers(1, 3))):  # up to three fields changed together
        whats.append(_change(draw, doc, how))
        how = draw(st.sampled_from(["replace", "delete", "tweak", "tweak"]))
    return json.dumps(doc, indent=1).encode(), "; ".join(whats)


def _change(draw, doc, how: str) -> str:
    """Changes one field of ``doc`` in place, each field equally likely (a list's entries
    count as one field): ``how`` is replace (by a hostile value), delete or tweak."""
    nodes = list(_nodes(doc))
    fields = sorted({_field(at) for at, _ in nodes})
    field = draw(st.sampled_from(fields))
    at, old = draw(st.sampled_from([(at, v) for at, v in nodes if _field(at) == field]))
    if how == "delete" and isinstance(_parent(doc, at), dict):
        _set(doc, at, None, delete=True)
        return f"deleted {list(at)}"
    new = draw(st.sampled_from(_tweaks(old)) if how == "tweak" else HOSTILE)
    _set(doc, at, copy.deepcopy(new))  # never shared with another field or example
    return f"{list(at)}: {_short(old)} -> {_short(new)}"


def _field(at: tuple) -> str:
    return "/".join("*" if isinstance(k, int) else k for k in at)


def _parent(doc, at):
    for k in at[:-1]:
        doc = doc[k]
    return doc


def _short(v) -> str:
    text = repr(v)
    return text if len(text) < 60 else text[:57] + "..."


# --- outcomes ----------------------------------------------------------------------------------

COUNTS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module", autouse=True)
def _print_counts(request):
    """Prints, after the module, each reader's inputs and outcomes (past pytest's capture)."""
    yield
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        for reader, c in sorted(COUNTS.items()):
            print(
                f"\nuntrusted {reader}: {sum(c.values())} inputs: "
                + ", ".join(f"{n} {k}" for k, n in sorted(c.items()))
            )


def outcome(reader: str, what: str) -> None:
    COUNTS[reader][what] += 1
    event(what)


def refused(reader: str, e: BaseException, *names: tuple[str, str]) -> None:
    """``e`` must be a jaxckpt error naming one of ``names`` ((what, path): the file, or
    another file or directory of the checkpoint)."""
    assert isinstance(e, CheckpointError), f"not a jaxckpt error: {type(e).__name__}: {e}"
    named = [what for what, path in names if path in str(e)]
    assert named, f"{type(e).__name__} names none of {names}: {e}"
    outcome(reader, f"raised {type(e).__name__} naming {named[0]}")


# --- manifest.json -------------------------------------------------------------------------------


def _tree(mesh):
    rng = np.random.default_rng(0)
    return {
        "w": sharded(rng.standard_normal((16, 8)).astype(np.float32), mesh, ("data", "model")),
        "b": sharded(np.arange(8, dtype=jax.numpy.bfloat16), mesh, ("model",)),
        "count": sharded(np.asarray(7, np.int32), mesh, ()),
        "n": np.arange(6, dtype=np.uint8).reshape(2, 3),
        "s": np.float32(1.5),
        "key": jax.random.key(3),
        "py": {"i": 3, "f": 0.25, "t": "text", "b": True, "none": None},
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A real checkpoint (every leaf kind, a (4, 2) mesh), its manifest and restore."""
    root = tmp_path_factory.mktemp("untrusted")
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    jaxckpt.save(root / "ckpt", _tree(mesh), custom_metadata={"run": "a", "n": [1, 2]})
    shutil.copytree(root / "ckpt", root / "decoy")  # what an escaping path would reach
    original = (root / "ckpt" / "manifest.json").read_bytes()
    return root, original, _by_name(jaxckpt.restore(root / "ckpt"))


def _by_name(restored) -> dict:
    out = {}
    for path, v in tree.flatten(restored):
        if isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            v = jax.random.key_data(v)
        out[tree.path_name(path)] = np.asarray(v) if hasattr(v, "dtype") else v
    return out


def _same_arrays(got: dict, want: dict, doc: dict) -> None:
    """Arrays bit-exact; Python leaves what the (mutated) file says."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    values = {leaf["name"]: leaf.get("value") for leaf in doc["leaves"]}
    for name, v in got.items():
        if isinstance(v, np.ndarray):
            assert v.dtype == want[name].dtype and v.shape == want[name].shape, name
            assert v.tobytes() == want[name].tobytes(), name
        else:
            assert v == values[name] or v != v, (name, v, values[name])


@pytest.mark.property
@given(data=st.data())
def test_manifest_is_loaded_exactly_or_refused_naming_the_file(saved, data):
    """metadata() and restore() of a mutated manifest.json: loaded exactly, or a jaxckpt error
    naming manifest.json (or the checkpoint); nothing outside the directory is read."""
    root, original, want = saved
    text, what = data.draw(mutated(original, utf8=True))  # see the test below
    note(what)
    ckpt = root / "ckpt"
    (ckpt / "manifest.json").write_bytes(text)
    try:
        with _Watch(root, ckpt):
            try:
                jaxckpt.metadata(ckpt)
                got = _by_name(jaxckpt.restore(ckpt))
            except Exception as e:
                refused(
                    "manifest.json",
                    e,
                    ("manifest.json", str(ckpt / "manifest.json")),
                    ("the checkpoint", str(ckpt)),
                )
                return
        _same_arrays(got, want, json.loads(text))
        outcome("manifest.json", "loaded exactly")
    finally:
        (ckpt / "manifest.json").write_bytes(original)


def test_manifest_that_is_not_utf8_is_refused_naming_the_file(saved):
    root, original, _ = saved
    ckpt = root / "ckpt"
    (ckpt / "manifest.json").write_bytes(b"\x80" + original[1:])
    try:
        with pytest.raises(CheckpointError, match="manifest.json"):
            jaxckpt.metadata(ckpt)
    finally:
        (ckpt / "manifest.json").write_bytes(original)


def test_the_watch_sees_a_read_outside_the_directory(saved):
    """The audit hook the properties rely on: opening the decoy beside the checkpoint fails."""
    root, _, _ = saved
    watch = _Watch(root, root / "ckpt")
    with pytest.raises(AssertionError, match="read outside the directory"), watch:
        (root / "decoy" / "manifest.json").read_bytes()
    with _Watch(root, root / "ckpt"):
        (root / "ckpt" / "manifest.json").read_bytes()


# --- local.json (the emergency tier) -------------------------------------------------------------


@pytest.fixture(scope="module")
def local_step(tmp_path_factory):
    """A real local step written by the emergency manager, its local.json and parse."""
    root = tmp_path_factory.mktemp("untrusted_local")
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1, remote=jaxckpt.Options(save_interval_steps=100)
    )
    with jaxckpt.EmergencyCheckpointManager(root / "l", root / "r", opts) as mgr:
        mgr.save(5, _tree(mesh))
        mgr.wait_until_finished()
    shutil.copytree(root / "l", root / "decoy")
    directory = jaxckpt._src.storage.location(root / "l")
    original = (root / "l" / "00000005" / "local.json").read_bytes()
    return root, directory, original, local.read_step(directory, 5)


OPTIONAL_LOCAL_FIELDS = {"replication", "hosts", "sends_to", "receives_from", "per_process"}


def _local_says(doc: dict) -> dict:
    """``doc`` as JSON, leaf records with their defaults left out, unknown fields dropped."""
    from jaxckpt._src.manifest import LeafRecord

    doc = json.loads(json.dumps(doc))
    known = set(local.LocalStep.__dataclass_fields__) | {"format", "slices"}
    if type(doc.get("format_version")) is int:  # the 1.0 form of [1, 0]
        doc["format_version"] = [doc["format_version"], 0]
    if isinstance(doc.get("leaves"), list):
        doc["leaves"] = [LeafRecord.from_dict(r).to_dict() for r in doc["leaves"]]
    return {k: v for k, v in doc.items() if k in known - {"required", "path"}}


@pytest.mark.property
@given(data=st.data())
def test_local_json_is_loaded_exactly_or_refused_naming_the_file(local_step, data, caplog):
    """The local.json parser the emergency restore uses: the step exactly as written, or the
    copy refused (read_step logs a warning naming the file and returns None, so the restore
    treats the copy as missing), or FormatVersionError naming it; parse_step raises a
    jaxckpt error naming the file for every refusal."""
    root, directory, original, want = local_step
    text, what = data.draw(mutated(original))
    note(what)
    step_dir = root / "l" / "00000005"
    where = str(step_dir / "local.json")
    (step_dir / "local.json").write_bytes(text)
    try:
        with _Watch(root, step_dir):
            try:
                local.parse_step(text, where=where, path=want.path)
            except Exception as e:
                assert isinstance(e, CheckpointError), f"{type(e).__name__}: {e}"
                assert where in str(e), str(e)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="jaxckpt"):
                try:
                    got = local.read_step(directory, 5)
                except Exception as e:
                    refused("local.json", e, ("local.json", where))
                    return
        if got is None:
            assert any(where in r.getMessage() for r in caplog.records), caplog.text
            outcome("local.json", "refused: warning naming the file, copy treated as missing")
            return
        if got == want:
            outcome("local.json", "loaded exactly")
            return
        says = _local_says(json.loads(text))  # loaded: then nothing differs from the file
        for k, v in _local_says(got.to_json()).items():
            assert says.get(k, v) == v, (what, k, says.get(k), v)
            assert k in says or k in OPTIONAL_LOCAL_FIELDS, (what, k)
        outcome("local.json", "loaded as the file says (a field of it changed)")
    finally:
        (step_dir / "local.json").write_bytes(original)


# --- signature.json (an export) ------------------------------------------------------------------

SIGNATURE = "signature.json"


def _affine(params, x):
    return jax.numpy.tanh(x @ params["w"] + params["b"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A real export (symbolic batch, two device counts), its signature and a served output."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    root = tmp_path_factory.mktemp("untrusted_export")
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    rng = np.random.default_rng(0)
    params = {
        "w": jax.device_put(
            rng.standard_normal((16, 8)).astype(np.float32), NamedSharding(mesh, P(None, "model"))
        ),
        "b": jax.device_put(np.arange(8, dtype=np.float32), NamedSharding(mesh, P())),
    }
    x_spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 16"), np.float32)
    jaxckpt.export.save(
        root / "e",
        _affine,
        params,
        x_spec,
        mesh=mesh,
        in_specs=(P("data", None),),
        out_specs=P("data", None),
        device_counts=[4, 8],
    )
    shutil.copytree(root / "e", root / "decoy")
    x = rng.standard_normal((8, 16)).astype(np.float32)
    want = np.asarray(jaxckpt.export.load(root / "e")(x))
    return root, (root / "e" / "signature.json").read_bytes(), x, want


@pytest.mark.property
@given(data=st.data())
def test_signature_is_loaded_exactly_or_refused_naming_the_file(exported, data):
    """jaxckpt.export.load with a mutated signature.json: serves exactly what was exported
    (output bit-exact), or raises a jaxckpt error naming signature.json (or the export, for an
    artifact whose checksum no longer matches); nothing outside the export is read."""
    root, original, x, want = exported
    text, what = data.draw(mutated(original))
    note(what)
    path = root / "e"
    (path / "signature.json").write_bytes(text)
    try:
        with _Watch(root, path):
            try:
                got = np.asarray(jaxckpt.export.load(path)(x))
            except Exception as e:
                refused(
                    "signature.json",
                    e,
                    ("signature.json", str(path / "signature.json")),
                    ("the artifact and signature.json", f"jaxexport: {SIGNATURE}"),
                    ("the artifact", str(path / "artifacts")),
                    ("the export", str(path)),
                )
                return
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), what
        outcome("signature.json", "loaded exactly")
    finally:
        (path / "signature.json").write_bytes(original)


def test_a_huge_list_index_in_a_path_is_refused(tmp_path):
    """A restore without a target builds lists up to a path's index: an index of 10**12 in
    a manifest would allocate until the process dies; it is a ManifestError instead."""
    jaxckpt.save(tmp_path / "c", {"l": [1.5, 2.5]})
    f = tmp_path / "c" / "manifest.json"
    doc = json.loads(f.read_text())
    doc["leaves"][1]["path"][1] = ["i", 10**12]
    doc["leaves"][1]["name"] = f"l/{10**12}"
    f.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=r"manifest.json.*sequence index above"):
        jaxckpt.restore(tmp_path / "c")
