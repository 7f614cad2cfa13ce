"""Real multi-process runs through jax.distributed on 127.0.0.1 (CPU devices, gloo)."""

import json
import os
import pathlib

import multiproc
import pytest

WORKER = os.path.join(os.path.dirname(__file__), "workers", "save_restore.py")


@pytest.mark.slow
def test_two_processes_save_one_process_restores(tmp_path):
    path = str(tmp_path / "c")
    multiproc.run(WORKER, 2, devices_per_process=4, args=["save", path]).check()
    manifest = json.loads(pathlib.Path(path, "manifest.json").read_text())
    assert manifest["process_count"] == 2
    # each process wrote its own shards once: bytes per process sum to the logical bytes
    logical = 64 * 32 * 4 + 32 * 4 + 16 * 16 * 4
    assert sum(manifest["bytes_per_process"]) == logical
    assert all(b > 0 for b in manifest["bytes_per_process"])
    assert sorted(os.listdir(os.path.join(path, "arrays"))) == ["d", "manifest.ocdbt", "p0", "p1"]
    multiproc.run(WORKER, 1, devices_per_process=8, args=["restore", path]).check()


@pytest.mark.slow
def test_one_process_saves_two_processes_restore(tmp_path):
    path = str(tmp_path / "c")
    multiproc.run(WORKER, 1, devices_per_process=8, args=["save", path]).check()
    multiproc.run(WORKER, 2, devices_per_process=4, args=["restore", path]).check()
