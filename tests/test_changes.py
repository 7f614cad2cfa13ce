"""Stale saves (changes.py): a manager given the same arrays at steps 10, 20 and 30 (the shape
of NVIDIA-NeMo/RL#3312) warns once, naming the steps; a training run does not; the run log
counts the leaves each save changed."""

import json
import logging
import os

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import sharded

import jaxckpt
from jaxckpt._src.changes import changed, fingerprints
from jaxckpt._src.manifest import LeafRecord, Manifest


def _saves(directory) -> list[dict]:
    events = []
    for name in os.listdir(os.path.join(directory, "runlog")):
        with open(os.path.join(directory, "runlog", name)) as f:
            events += [json.loads(line) for line in f if line.strip()]
    return sorted((e for e in events if e["event"] == "save"), key=lambda e: e["step"])


def _stale(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "holds exactly the arrays" in r.getMessage()]


def test_the_same_arrays_at_three_steps_warn_once(mesh42, tmp_path, caplog):
    state = {"w": sharded(np.ones((16, 8), np.float32), mesh42, ("data",)), "b": jnp.zeros(8)}
    opts = jaxckpt.Options(save_interval_steps=10)
    with (
        caplog.at_level(logging.WARNING, "jaxckpt"),
        jaxckpt.CheckpointManager(tmp_path / "run", opts) as mgr,
    ):
        for step in (10, 20, 30):  # a cached structure: the first step's arrays again
            assert mgr.save(step, {**state, "step": step})
    warned = _stale(caplog)
    assert len(warned) == 1, warned
    assert "step 20 " in warned[0] and "of step 10 " in warned[0], warned[0]
    assert [(e["step"], e.get("leaves_changed")) for e in _saves(tmp_path / "run")] == [
        (10, None),  # nothing before it
        (20, 0),
        (30, 0),
    ]


def test_a_training_run_does_not_warn(mesh42, tmp_path, caplog):
    w = sharded(np.ones((16, 8), np.float32), mesh42, ("data",))
    frozen = jnp.arange(8.0)  # a leaf that never changes: not every leaf, no warning
    with caplog.at_level(logging.WARNING, "jaxckpt"):
        with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
            for step in range(3):
                w = w * 0.5
                mgr.save(step, {"w": w, "frozen": frozen})
        assert _stale(caplog) == []
        # a restarted job's manager compares with the last step on disk
        with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
            mgr.save(3, {"w": w, "frozen": frozen})
    assert [e.get("leaves_changed") for e in _saves(tmp_path / "run")] == [None, 1, 1, 0]
    assert len(_stale(caplog)) == 1 and "step 3 " in _stale(caplog)[0]


def _manifest(*leaves: LeafRecord) -> Manifest:
    return Manifest(
        leaves=leaves, meshes=[], process_count=1, process_hosts=["h"], bytes_per_process=[0]
    )


def test_changed_counts_new_reshaped_and_different_leaves():
    a = LeafRecord(["a"], "a", "array", [2], "float32", fingerprint="1" * 24)
    b = LeafRecord(["b"], "b", "array", [2], "float32", fingerprint="2" * 24)
    before = fingerprints(_manifest(a, b))
    assert before is not None and changed(before, before) == 0
    moved = fingerprints(
        _manifest(a, LeafRecord(["b"], "b", "array", [2], "float32", fingerprint="3" * 24))
    )
    assert moved is not None and changed(moved, before) == 1
    reshaped = fingerprints(
        _manifest(LeafRecord(["a"], "a", "array", [1, 2], "float32", fingerprint="1" * 24), b)
    )
    assert reshaped is not None and changed(reshaped, before) == 1
    new = fingerprints(
        _manifest(a, b, LeafRecord(["c"], "c", "numpy", [], "int8", fingerprint="0" * 24))
    )
    assert new is not None and changed(new, before) == 1
    python = LeafRecord(["s"], "s", "python", value=3, python_type="int")
    assert fingerprints(_manifest(a, python)) == {"a": ((2,), "float32", "1" * 24)}
    old = LeafRecord(["a"], "a", "array", [2], "float32")  # written before format 1.10
    assert fingerprints(_manifest(old, b)) is None


def test_metadata_gives_the_fingerprints(tmp_path):
    jaxckpt.save(tmp_path / "a", {"x": np.arange(6.0), "s": 1})
    jaxckpt.save(tmp_path / "b", {"x": np.arange(6.0), "s": 2})
    a, b = jaxckpt.metadata(tmp_path / "a"), jaxckpt.metadata(tmp_path / "b")
    assert a["x"].fingerprint == b["x"].fingerprint and len(a["x"].fingerprint) == 24
    assert a["s"].fingerprint is None


def test_a_malformed_fingerprint_is_refused_naming_the_file(tmp_path):
    jaxckpt.save(tmp_path / "a", {"x": np.arange(6.0)})
    path = tmp_path / "a" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["leaves"][0]["fingerprint"] = 12
    path.write_text(json.dumps(doc))
    with pytest.raises(jaxckpt.errors.ManifestError, match=r"manifest.json.*fingerprint"):
        jaxckpt.metadata(tmp_path / "a")
