"""Run-time figures: jax.monitoring events with the documented names, and on the manager."""

import jax
import numpy as np
import pytest
from conftest import sharded

import jaxckpt


@pytest.fixture
def events():
    durations, scalars = [], []

    def on_duration(name, secs, **kw):
        if name.startswith("/jaxckpt/"):
            durations.append((name, secs))

    def on_scalar(name, value, **kw):
        if name.startswith("/jaxckpt/"):
            scalars.append((name, value))

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_scalar_listener(on_scalar)
    yield durations, scalars
    jax.monitoring.unregister_event_duration_listener(on_duration)
    jax.monitoring.unregister_scalar_listener(on_scalar)


def test_save_and_restore_emit_their_phases(events, mesh42, tmp_path):
    durations, scalars = events
    x = sharded(np.ones((64, 32), np.float32), mesh42, ("data", "model"))
    figs = jaxckpt.save(tmp_path / "c", {"x": x})
    jaxckpt.restore(tmp_path / "c")
    names = {n for n, _ in durations}
    for phase in ("describe", "write", "commit", "total"):
        assert f"/jaxckpt/save/{phase}_secs" in names, names
    for phase in ("plan", "read", "move", "total"):
        assert f"/jaxckpt/restore/{phase}_secs" in names, names
    got = dict(scalars)
    assert got["/jaxckpt/save/bytes"] == x.nbytes == figs.bytes
    assert got["/jaxckpt/restore/bytes"] == x.nbytes  # one replica of each slice read
    assert got["/jaxckpt/save/gbps"] > 0 and all(s >= 0 for _, s in durations)
    assert sum(figs.phases.values()) <= figs.total_s + 1e-6


def test_manager_keeps_the_last_figures(events, mesh42, tmp_path):
    durations, _ = events
    x = sharded(np.ones((64, 32), np.float32), mesh42, ("data", "model"))
    with jaxckpt.CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, {"x": x})
        mgr.wait_until_finished()
        assert mgr.last_save_figures.bytes == x.nbytes and mgr.last_save_figures.op == "save"
        assert mgr.last_save_blocking_s is not None and mgr.last_save_blocking_s >= 0
        mgr.restore(1)
        assert mgr.last_restore_figures.op == "restore"
        assert mgr.last_restore_figures.bytes == x.nbytes
    assert "/jaxckpt/manager_save/blocking_secs" in {n for n, _ in durations}
