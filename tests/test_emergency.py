"""EmergencyCheckpointManager: the local tier, peer copies, agreement and recovery."""

import dataclasses
import json
import os
import pathlib
import shutil
import signal

import jax
import multiproc
import numpy as np
import pytest
from conftest import assert_tree_equal, listing, sharded
from iostats import mapped_from
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src.emergency import wire
from jaxckpt._src.emergency.planner import SliceKey
from jaxckpt._src.io import layout, linux
from jaxckpt._src.options import OptionsError
from jaxckpt.errors import CheckpointNotFoundError, DeletedArrayError, UnsupportedLeafError

HERE = os.path.dirname(__file__)
LOOP = os.path.join(HERE, "workers", "emergency_loop.py")
CONFIG = os.path.join(os.path.dirname(HERE), "configs", "emergency_gpu.toml")


def make_state(mesh, step):
    return {
        "w": sharded(
            np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + step, mesh, ("data", "model")
        ),
        "b": sharded(np.arange(32, dtype=np.float32) * step, mesh, ("model",)),
        "h": sharded(np.ones((8, 4), jax.numpy.bfloat16) * step, mesh, (None, "model")),
        "count": sharded(np.asarray(step, np.int32), mesh, ()),  # 0-d, like TrainState.step
        "n": np.arange(3) + step,
        "key": jax.random.key(step),
        "step": step,
        "none": None,
    }


def opts(**kw):
    """Local saves at every step; remote ones every ``remote_every`` (100), 3 kept."""
    remote = jaxckpt.Options(save_interval_steps=kw.pop("remote_every", 100), max_to_keep=3)
    base = dict(local_interval_steps=1, async_save=True, remote=remote)
    return jaxckpt.EmergencyOptions(**{**base, **kw})


def corrupt(step_dir: pathlib.Path, data: np.ndarray) -> None:
    """Flips one byte inside ``data``'s bytes where they sit in a local step's data files."""
    needle = np.ascontiguousarray(data).tobytes()
    for f in (step_dir / "arrays").rglob("*"):
        if f.is_file():
            blob = bytearray(f.read_bytes())
            at = blob.find(needle)
            if at >= 0:
                blob[at + len(needle) // 2] ^= 0xFF
                f.write_bytes(bytes(blob))
                return
    raise AssertionError(f"bytes of the slice not found under {step_dir}")


# --- single process: the local tier --------------------------------------------------------


def test_local_step_format_and_exact_restore(tmp_path, mesh42):
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, make_state(mesh42, step))
        mgr.wait_until_finished()
        assert mgr.local_steps() == [2, 3]  # local_max_to_keep=2
        assert mgr.remote.all_steps() == []
        out = mgr.restore()
        assert_tree_equal(out, make_state(mesh42, 3))
        assert out["w"].sharding == NamedSharding(mesh42, P("data", "model"))
        rep = mgr.last_report
        assert (rep.tier, rep.step, rep.from_peers, rep.rejected) == ("local", 3, (), ())
    d = tmp_path / "l" / "00000003"
    assert sorted(os.listdir(d)) == ["COMMITTED", "arrays", "local.json"]
    doc = json.loads((d / "local.json").read_text())
    assert doc["format"] == "jaxckpt-local" and doc["process_count"] == 1
    assert doc["slices"]["w"] == [
        f"{r}:{r + 16},{c}:{c + 16}" for r in (0, 16, 32, 48) for c in (0, 16)
    ]
    assert set(doc["held"]["w"]) == set(doc["slices"]["w"])  # every distinct shard, once
    assert doc["held"]["b"] == {"0:16": 0, "16:32": 0}
    kinds = {leaf["name"]: leaf["kind"] for leaf in doc["leaves"]}
    assert kinds == {"w": "array", "b": "array", "h": "array", "count": "array", "n": "numpy", "key": "prng_key",
                     "step": "python", "none": "python"}  # fmt: skip


def test_a_local_restore_opens_with_tensorstore_only_the_leaves_it_reads_with_it(
    x64, tmp_path, mesh42, monkeypatch
):
    """The local tier's reads take each leaf's layout from its ``zarr.json`` in the B-tree
    walk, as a restore does (``chunk_plan.leaf_layout``): every dtype with random bits restores
    bit-exactly, and only the leaves the direct path can't read are opened with
    TensorStore (``arrays.open_leaf`` watched)."""
    from hostile import DTYPES, assert_same_bits, direct_dtype, random_bits

    from jaxckpt._src.io import arrays

    rng = np.random.default_rng(31)
    tree = {
        d.name: sharded(random_bits((16, 8), d, rng), mesh42, P("data", "model")) for d in DTYPES
    }
    opened: list[str] = []
    real = arrays.open_leaf

    def watching(db, name, ctx):
        opened.append(name)
        return real(db, name, ctx)

    monkeypatch.delenv(linux.DIRECT_READ, raising=False)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        monkeypatch.setattr(arrays, "open_leaf", watching)
        out = mgr.restore()
        assert mgr.last_report.tier == "local"
    for k, v in tree.items():
        assert_same_bits(np.asarray(v), np.asarray(out[k]), k)
    assert sorted(set(opened)) == sorted(d.name for d in DTYPES if not direct_dtype(d))


MAP_SPECS = [P("data", "model"), P("data"), P(None, "model"), P()]


def test_a_local_restore_maps_whole_chunks_as_the_arrays_memory(x64, tmp_path, mesh42, monkeypatch):
    """Slices of 256 KiB or more come back as private mappings of the local step's data
    files (``mapped``), as a restore's do: random bits of every whole-byte dtype under four
    specs (replicas included), each device's bytes exact and its own memory; they stay so
    after retention deletes the step; ``JAXCKPT_MAP=0`` reads them instead."""
    from hostile import DTYPES, assert_same_bits, direct_dtype, random_bits

    rng = np.random.default_rng(5)
    tree = {}
    for i, d in enumerate(x for x in DTYPES if direct_dtype(x) and _whole_bytes(x)):
        rows = layout.SMALL_CHUNK_BYTES // d.itemsize // 64 * 4  # a (4, 2) slice: 256 KiB at least
        spec = MAP_SPECS[i % len(MAP_SPECS)]
        tree[d.name] = sharded(random_bits((rows, 128), d, rng), mesh42, spec)
    want = {k: np.asarray(v) for k, v in tree.items()}
    monkeypatch.delenv(linux.MAP, raising=False)
    o = dataclasses.replace(opts(), local_max_to_keep=1)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        out = mgr.restore()
        assert mgr.last_report.tier == "local"
        for k, v in out.items():
            assert all(mapped_from(v, tmp_path / "l" / "00000001")), k
            assert len({s.data.unsafe_buffer_pointer() for s in v.addressable_shards}) == 8, k
            assert_same_bits(want[k], np.asarray(v), k)
        mgr.save(2, tree)  # retention deletes step 1, whose files the arrays map
        mgr.wait_until_finished()
        assert mgr.local_steps() == [2]
        for k, v in out.items():
            for shard in v.addressable_shards:
                assert_same_bits(want[k][shard.index], np.asarray(shard.data), k)
        monkeypatch.setenv(linux.MAP, "0")
        read = mgr.restore()
        for k, v in read.items():
            assert not any(mapped_from(v, tmp_path / "l")), k
            assert_same_bits(want[k], np.asarray(v), k)


def test_a_corrupt_chunk_of_a_mapped_slice_is_never_restored(tmp_path, mesh42, monkeypatch):
    """A mapped slice's chunk fails its CRC32C (checked over the mapping): that step is
    rejected naming the copy, the older one restored, mapped."""
    monkeypatch.delenv(linux.MAP, raising=False)

    def state(step):
        w = np.random.default_rng(step).standard_normal((1024, 512)).astype(np.float32)
        return w, {"w": sharded(w, mesh42, P("data", "model"))}  # slices of 256 KiB

    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        w1, s1 = state(1)
        w2, s2 = state(2)
        mgr.save(1, s1)
        mgr.save(2, s2)
        mgr.wait_until_finished()
        corrupt(tmp_path / "l" / "00000002", w2[256:512, 256:512])
        out = mgr.restore()
        rep = mgr.last_report
        assert (rep.tier, rep.step) == ("local", 1)
        assert "no verified copy of w[256:512,256:512]" in rep.rejected[0].why
        assert "CRC32C" in rep.bad_copies[0].why
        assert all(mapped_from(out["w"], tmp_path / "l" / "00000001"))
        np.testing.assert_array_equal(np.asarray(out["w"]), w1)


def test_a_step_saved_again_leaves_the_arrays_mapped_from_it_as_they_were(
    tmp_path, mesh42, monkeypatch
):
    """The step a restore mapped is saved again, with other values: its committed files
    are not written again (nothing writes a committed step's files, which the arrays map),
    so the arrays and the next restore keep the step's values."""
    monkeypatch.delenv(linux.MAP, raising=False)
    rng = np.random.default_rng(3)
    w1, w2 = (rng.standard_normal((1024, 512)).astype(np.float32) for _ in range(2))
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        mgr.save(1, {"w": sharded(w1, mesh42, P("data", "model"))})
        mgr.wait_until_finished()
        out = mgr.restore()
        assert all(mapped_from(out["w"], tmp_path / "l" / "00000001"))
        mgr.save(1, {"w": sharded(w2, mesh42, P("data", "model"))})
        mgr.wait_until_finished()
        np.testing.assert_array_equal(np.asarray(out["w"]), w1)
        np.testing.assert_array_equal(np.asarray(mgr.restore()["w"]), w1)


def _whole_bytes(d: np.dtype) -> bool:
    return jax.dtypes.itemsize_bits(d) == 8 * d.itemsize


def test_step_digits_and_figures(tmp_path, mesh42):
    """Both tiers name steps with ``step_digits``; each save and restore leaves its phases'
    times in ``last_*_figures`` (the same Figures as the plain manager's)."""
    o = opts(step_digits=4, remote=jaxckpt.Options(save_interval_steps=2, step_digits=4))
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        mgr.save(2, make_state(mesh42, 2))
        mgr.wait_until_finished()
        assert listing(tmp_path / "l") == ["0002"]
        assert listing(tmp_path / "r") == ["0002"]
        assert set(mgr.last_save_figures.phases) == {"remote", "local"}
        assert set(mgr.last_write_figures.phases) == {"write"}
        assert mgr.last_write_figures.bytes > 64 * 32 * 4
        mgr.restore()
        assert set(mgr.last_restore_figures.phases) == {"plan", "read", "move", "place"}
        assert mgr.last_restore_figures.total_s >= sum(mgr.last_restore_figures.phases.values())
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        assert mgr.local_steps() == [2] and mgr.latest_step() == 2


def test_restore_onto_another_target(tmp_path, mesh42):
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        mgr.save(5, make_state(mesh42, 5))
        mesh = jax.make_mesh((2, 4), ("data", "model"))
        target = {"w": NamedSharding(mesh, P("model", None)), "n": np.zeros(3, np.int64)}
        out = mgr.restore(target=target)
        np.testing.assert_array_equal(out["w"], make_state(mesh42, 5)["w"])
        assert out["w"].sharding == target["w"]
        np.testing.assert_array_equal(out["n"], np.arange(3) + 5)
        out = mgr.restore(mesh=jax.make_mesh((8, 1), ("data", "model")))
        assert out["w"].sharding.mesh.shape == {"data": 8, "model": 1}
        np.testing.assert_array_equal(out["w"], make_state(mesh42, 5)["w"])
        # as jaxckpt.restore: a ShapeDtypeStruct without a sharding takes its saved spec on mesh
        w = make_state(mesh42, 5)["w"]
        out = mgr.restore(target={"w": jax.ShapeDtypeStruct(w.shape, w.dtype)}, mesh=mesh)
        assert out["w"].sharding == NamedSharding(mesh, w.sharding.spec)
        np.testing.assert_array_equal(out["w"], w)


def test_uncommitted_and_tmp_leftovers_are_removed(tmp_path, mesh42):
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        mgr.save(1, make_state(mesh42, 1))
    ldir = tmp_path / "l"
    shutil.copytree(ldir / "00000001", ldir / "00000002")
    (ldir / "00000002" / "COMMITTED").unlink()  # a step whose commit never happened
    (ldir / "00000003.tmp-abcd").mkdir()
    with jaxckpt.EmergencyCheckpointManager(ldir, tmp_path / "r", opts()) as mgr:
        assert listing(ldir) == ["00000001"]
        assert mgr.local_steps() == [1] and mgr.latest_step() == 1
        assert_tree_equal(mgr.restore(), make_state(mesh42, 1))


def test_corrupt_chunk_is_never_restored(tmp_path, mesh42):
    """The only copy of a slice fails its CRC: that step is rejected, the older one used."""
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        mgr.save(1, make_state(mesh42, 1))
        mgr.save(2, make_state(mesh42, 2))
        mgr.wait_until_finished()
        w2 = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + 2
        corrupt(tmp_path / "l" / "00000002", w2[16:32, 0:16])
        out = mgr.restore()
        assert_tree_equal(out, make_state(mesh42, 1))
        rep = mgr.last_report
        assert (rep.tier, rep.step) == ("local", 1)
        assert (
            rep.rejected[0].step == 2 and "no verified copy of w[16:32,0:16]" in rep.rejected[0].why
        )
        bad = rep.bad_copies[0]
        assert (bad.process, bad.leaf, bad.index) == (0, "w", "16:32,0:16") and "CRC32C" in bad.why


def test_remote_tier_when_newer_or_local_gone(tmp_path, mesh42):
    o = opts(local_interval_steps=2, remote_every=3)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        for step in range(1, 4):
            mgr.save(step, make_state(mesh42, step))
        mgr.wait_until_finished()  # both tiers' writers
        assert mgr.local_steps() == [2] and mgr.remote.all_steps() == [3]
        assert_tree_equal(mgr.restore(), make_state(mesh42, 3))
        assert mgr.last_report.tier == "remote" and mgr.last_report.step == 3
        assert mgr.last_report.rejected == ((2, "the remote tier has a newer step 3"),)
        assert mgr.last_report.rejected[0].why.startswith("the remote tier")  # named fields
        assert_tree_equal(mgr.restore(step=2), make_state(mesh42, 2))
        assert mgr.last_report.tier == "local"
    shutil.rmtree(tmp_path / "l")
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        assert_tree_equal(mgr.restore(), make_state(mesh42, 3))
        assert mgr.last_report.tier == "remote"
    with (
        jaxckpt.EmergencyCheckpointManager(tmp_path / "l2", tmp_path / "r2", o) as mgr,
        pytest.raises(CheckpointNotFoundError, match="no step to restore"),
    ):
        mgr.restore()


def test_remote_tier_on_s3(tmp_path, mesh42, s3_url):
    o = opts(local_interval_steps=1, remote_every=2)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", s3_url, o) as mgr:
        for step in (1, 2):
            mgr.save(step, make_state(mesh42, step))
    shutil.rmtree(tmp_path / "l")
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", s3_url, o) as mgr:
        assert_tree_equal(mgr.restore(), make_state(mesh42, 2))
        assert (mgr.last_report.tier, mgr.last_report.step) == ("remote", 2)


def test_force_saves_both_tiers_and_sync_mode(tmp_path, mesh42):
    o = opts(
        local_interval_steps=10,
        async_save=False,
        remote=jaxckpt.Options(save_interval_steps=10, async_save=False),
    )
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        assert not mgr.save(3, make_state(mesh42, 3))
        assert mgr.save(4, make_state(mesh42, 4), force=True)
        assert mgr.local_steps() == [4] and mgr.remote.all_steps() == [4]
        assert mgr.should_save(20) == (True, True)


def test_bad_leaves_raise_in_save_and_write_nothing(tmp_path, mesh42):
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        for bad in (object(), np.array(["a", "b"])):
            with pytest.raises(UnsupportedLeafError, match="leaf 'bad'"):
                mgr.save(1, {"ok": make_state(mesh42, 1)["w"], "bad": bad})
        mgr.wait_until_finished()
        assert mgr.local_steps() == [] and listing(tmp_path / "l") == []


def test_a_deleted_array_raises_in_save_naming_it_and_writes_nothing(tmp_path, mesh42):
    gone = make_state(mesh42, 1)["w"]
    gone.delete()
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        with pytest.raises(DeletedArrayError, match="leaf 'gone'.*deleted or donated"):
            mgr.save(1, {"ok": make_state(mesh42, 1)["w"], "gone": gone})
        mgr.wait_until_finished()
        assert mgr.local_steps() == [] and listing(tmp_path / "l") == []
        empty = jax.numpy.zeros((0, 3))
        empty.delete()  # no bytes to lose: saved as it is
        assert mgr.save(2, {"ok": make_state(mesh42, 1)["w"], "empty": empty})
        mgr.wait_until_finished()
        assert mgr.local_steps() == [2]


def test_numpy_leaves_are_snapshots_in_native_order(tmp_path, mesh42):
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    state = {"be": big_endian, "n": np.arange(4.0), "w": make_state(mesh42, 2)["w"]}
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts()) as mgr:
        mgr.save(2, state)
        state["n"][:] = -1  # changed after save returned: the saved step keeps the old values
        mgr.wait_until_finished()
        out = mgr.restore()
    np.testing.assert_array_equal(out["be"], np.arange(6).reshape(2, 3))
    assert out["be"].dtype == np.dtype("int32")
    np.testing.assert_array_equal(out["n"], np.arange(4.0))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(state["w"]))


def test_pack_unpack_roundtrip():
    slices = {
        SliceKey("a", ((0, 2), (0, 3))): np.arange(6, dtype=np.float32).reshape(2, 3),
        SliceKey("b", ((4, 5),)): np.array([7], jax.numpy.bfloat16),
        SliceKey("c", ()): np.array(3, np.int64),
    }
    origins = dict.fromkeys(slices, 2)
    got, got_origins = wire.unpack(wire.pack(slices, origins))
    assert got_origins == origins
    for k, v in slices.items():
        assert got[k].dtype == v.dtype and got[k].tobytes() == v.tobytes()
    assert wire.unpack(wire.pack({}, {})) == ({}, {})


def test_options(tmp_path):
    with pytest.raises(OptionsError, match="replication"):
        jaxckpt.EmergencyOptions(replication=-1)
    with pytest.raises(OptionsError, match="local_interval_steps"):
        jaxckpt.EmergencyOptions(local_interval_steps=0)
    o = jaxckpt.EmergencyOptions.from_file(CONFIG)
    assert o.local_interval_steps < o.remote.save_interval_steps and o.replication >= 1
    assert o.remote.timeout_s == 300.0 and o.remote.max_interval_steps == 100_000
    bad = tmp_path / "bad.toml"
    bad.write_text("local_every = 3\n")
    with pytest.raises(OptionsError, match="unknown"):
        jaxckpt.EmergencyOptions.from_file(bad)
    # the remote tier is an Options: a [remote] table changes the keys it names, checked as
    # an Options file's are
    bad.write_text("local_interval_steps = 5\n[remote]\nchunk_bytes = 4096\n")
    o = jaxckpt.EmergencyOptions.from_file(bad)
    assert (o.remote.chunk_bytes, o.remote.save_interval_steps, o.remote.max_to_keep) == (
        4096,
        1000,
        3,
    )
    bad.write_text("[remote]\nremote_interval_steps = 5\n")
    with pytest.raises(OptionsError, match=r"\[remote\].*unknown.*remote_interval_steps"):
        jaxckpt.EmergencyOptions.from_file(bad)
    with pytest.raises(OptionsError, match="remote must be a jaxckpt.Options"):
        jaxckpt.EmergencyOptions(remote={"save_interval_steps": 5})
    with pytest.raises(TypeError):  # the remote interval is no second positional field
        jaxckpt.EmergencyOptions(1, 100)


def test_continuous_on_both_tiers(tmp_path, mesh42):
    """Each tier saves the first step after its last save committed; the options refuse a
    continuous tier without async saves, naming the field."""
    remote = jaxckpt.Options(save_interval_steps="continuous", max_to_keep=3)
    o = opts(local_interval_steps="continuous", remote=remote)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        assert mgr.should_save(1) == (True, True)  # nothing saved yet
        assert mgr.save(1, make_state(mesh42, 1))
        mgr.wait_until_finished()
        assert mgr.should_save(2) == (True, True)
        assert mgr.save(2, make_state(mesh42, 2))
        mgr.wait_until_finished()
        assert mgr.local_steps() == [1, 2] and mgr.remote.all_steps() == [1, 2]
    with pytest.raises(OptionsError, match="local_interval_steps='continuous' needs async"):
        jaxckpt.EmergencyOptions(local_interval_steps="continuous", async_save=False)
    with pytest.raises(OptionsError, match="local_interval_steps must be .* 'continuous'"):
        jaxckpt.EmergencyOptions(local_interval_steps="always")


def test_every_remote_option_reaches_the_remote_manager(tmp_path, mesh42, monkeypatch, caplog):
    """``EmergencyOptions.remote`` is the remote tier's manager's ``Options``, whole (less its
    run log: the emergency manager logs both tiers): ``chunk_bytes`` bounds the remote
    step's chunks and ``read_budget_bytes`` its restores, which no copied field passed."""
    from jaxckpt._src import manager as manager_lib
    from jaxckpt._src.manifest import read_manifest

    remote = jaxckpt.Options(
        save_interval_steps=2, max_to_keep=1, chunk_bytes=1024, read_budget_bytes=4096
    )
    o = opts(remote=remote, local_interval_steps=2)
    budgets = []

    def restore(*args, **kw):
        budgets.append(kw.get("read_budget_bytes"))
        return real(*args, **kw)

    real = manager_lib.restore
    monkeypatch.setattr(manager_lib, "restore", restore)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        assert mgr.remote.options == dataclasses.replace(remote, run_log=False)
        for step in (2, 4):
            mgr.save(step, make_state(mesh42, step))
        mgr.wait_until_finished()
        assert mgr.remote.all_steps() == [4]  # its max_to_keep
        w = {r.name: r for r in read_manifest(mgr.remote.step_path(4)).leaves}["w"]
        assert w.chunk_shape is not None and np.prod(w.chunk_shape) * 4 <= 1024
    shutil.rmtree(tmp_path / "l")
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        assert_tree_equal(mgr.restore(), make_state(mesh42, 4))
        assert mgr.last_report.tier == "remote" and budgets == [4096]
    # an Options() alone would save the remote tier at every step: said when it starts
    with jaxckpt.EmergencyCheckpointManager(
        tmp_path / "l", tmp_path / "r3", opts(local_interval_steps=10, remote=jaxckpt.Options())
    ):
        assert "more often than the local tier's 10" in caplog.text


# --- multi-process -----------------------------------------------------------------------


def run(n, mode, root, *args, env=None, ids=None, check=True):
    e = {"JAXCKPT_TEST_REPL": "1", **(env or {})}
    res = multiproc.run(
        LOOP, n, devices_per_process=8 // n, args=[mode, str(root), *map(str, args)], env=e,
        process_ids=ids, timeout_s=60,
    )  # fmt: skip
    return res.check() if check else res


def reports(res):
    out = []
    for text in res.outputs:
        line = next(ln for ln in text.splitlines() if ln.startswith("REPORT "))
        out.append(json.loads(line[len("REPORT ") :]))
    return out


def steps(d):
    return listing(d)


@pytest.mark.slow
def test_local_restart_and_retention_of_both_tiers(tmp_path):
    env = {"JAXCKPT_TEST_REPL": "0", "JAXCKPT_TEST_REMOTE": "2"}
    run(2, "save", tmp_path, 5, env=env)
    for h in ("host0", "host1"):
        assert steps(tmp_path / h) == ["00000004", "00000005"]  # local_max_to_keep=2
    assert steps(tmp_path / "remote") == ["00000002", "00000004"]  # the remote max_to_keep=2
    reps = reports(run(2, "restore", tmp_path, "local", 5, env=env))
    assert all(r["from_peers"] == [] and r["saved_process_count"] == 2 for r in reps)


@pytest.mark.slow
def test_replaced_host_restores_from_peer_copies(tmp_path):
    run(2, "save", tmp_path, 3)
    shutil.rmtree(tmp_path / "host1")  # a new machine, empty local disk
    r0, r1 = reports(run(2, "restore", tmp_path, "local", 3))
    # big's slices: process 0 maps its own two from its disk; process 1 gets its from peers
    assert (r0["mapped"], r1["mapped"]) == (2, 0)
    assert r0["from_peers"] == []
    # process 1's rows of w come from process 0, which held process 1's peer copy
    w = [p for p in r1["from_peers"] if p[0] == "w"]
    assert sorted(p[1] for p in w) == ["32:48,0:16", "32:48,16:32", "48:64,0:16", "48:64,16:32"]
    assert all(p[2:] == [0, 1] for p in w)


@pytest.mark.slow
def test_readme_resume_recipe_on_a_replaced_host(tmp_path):
    """``if mgr.latest_step() is not None: mgr.restore()``, literally: the replaced host
    (empty disk, empty remote) gets the agreed step and its data from its peer."""
    run(2, "save", tmp_path, 3)
    shutil.rmtree(tmp_path / "host1")
    r0, r1 = reports(run(2, "recipe", tmp_path))
    assert (r0["tier"], r0["step"]) == (r1["tier"], r1["step"]) == ("local", 3)
    assert r0["from_peers"] == [] and r1["from_peers"]
    shutil.rmtree(tmp_path / "host0")  # nothing anywhere: both processes start fresh
    shutil.rmtree(tmp_path / "host1")
    res = run(2, "recipe", tmp_path)
    assert all("REPORT null" in out for out in res.outputs), res.outputs


@pytest.mark.slow
def test_replaced_host_with_permuted_process_ids(tmp_path):
    run(4, "save", tmp_path, 3)
    shutil.rmtree(tmp_path / "host2")
    # rank r comes back as process ids[r] on the machine (local directory) host<r>
    ids = [2, 0, 3, 1]
    hosts = [ids.index(p) for p in range(4)]
    res = run(
        4, "restore", tmp_path, "local", 3, ids=ids, env={"JAXCKPT_TEST_HOSTS": json.dumps(hosts)}
    )
    reps = reports(res)
    assert all((r["tier"], r["step"]) == ("local", 3) for r in reps)
    # the slices process 2 (on host2) wrote came from host3's peer copy
    assert any(p[0] == "w" and p[3] == 2 for r in reps for p in r["from_peers"])


def test_losing_a_whole_machine_restores_from_copies_on_the_other(tmp_path):
    # 4 processes on 2 simulated machines, numbered machine by machine: the peer copies must
    # cross machines (shift 2), or losing machine m1 would lose processes 2 and 3 for good
    env = {"JAXCKPT_TEST_MACHINES": json.dumps(["m0", "m0", "m1", "m1"])}
    run(4, "save", tmp_path, 3, env=env)
    doc = json.loads((tmp_path / "host0" / "00000003" / "local.json").read_text())
    assert doc["sends_to"] == [2] and doc["receives_from"] == [2], doc["sends_to"]
    assert doc["hosts"] == ["m0", "m0", "m1", "m1"]
    for h in ("host2", "host3"):
        shutil.rmtree(tmp_path / h)
    reps = reports(run(4, "restore", tmp_path, "local", 3, env=env))
    assert reps[0]["from_peers"] == [] and reps[1]["from_peers"] == []
    assert reps[2]["from_peers"] and reps[3]["from_peers"]
    used = [(h, w) for r in reps[2:] for _, _, h, w in r["from_peers"]]
    assert {h for h, _ in used} <= {0, 1}  # read from machine m0's disks
    assert {2, 3} <= {w for _, w in used}  # including the shards m1's processes wrote


@pytest.mark.slow
def test_all_local_directories_wiped_uses_newest_remote_step(tmp_path):
    run(2, "save", tmp_path, 5, env={"JAXCKPT_TEST_REMOTE": "2"})
    for h in ("host0", "host1"):
        shutil.rmtree(tmp_path / h)
    reps = reports(run(2, "restore", tmp_path, "remote", 4))
    assert all(r["rejected"] == [] for r in reps)


@pytest.mark.slow
def test_corrupt_local_chunk_is_rejected_and_restored_from_the_peer_copy(tmp_path):
    run(2, "save", tmp_path, 3)
    w3 = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) + 3
    corrupt(tmp_path / "host0" / "00000003", w3[0:16, 0:16])
    r0, r1 = reports(run(2, "restore", tmp_path, "local", 3))
    assert [b[:3] for b in r0["bad_copies"]] == [[0, "w", "0:16,0:16"]]
    assert "CRC32C" in r0["bad_copies"][0][3]
    assert ["w", "0:16,0:16", 1, 0] in r0["from_peers"]  # process 1's copy, verified


@pytest.mark.slow
def test_remote_newer_than_every_complete_local_step(tmp_path):
    env = {"JAXCKPT_TEST_LOCAL": "2", "JAXCKPT_TEST_REMOTE": "3", "JAXCKPT_TEST_REPL": "0"}
    run(2, "save", tmp_path, 3, env=env)
    reps = reports(run(2, "restore", tmp_path, "remote", 3, env=env))
    assert reps[0]["rejected"] == [[2, "the remote tier has a newer step 3"]]


@pytest.mark.slow
def test_process_killed_during_local_save(tmp_path):
    env = {"JAXCKPT_TEST_REPL": "0", "JAXCKPT_TEST_KILL_PID": "1", "JAXCKPT_TEST_KILL_STEP": "3"}
    env["JAXCKPT_SHUTDOWN_TIMEOUT"] = "1"  # the survivor's wait for the dead process at exit
    res = run(2, "save", tmp_path, 3, env=env, check=False)
    assert res.returncodes[1] == -signal.SIGKILL, res.outputs[1]
    assert any(".tmp-" in n for n in steps(tmp_path / "host1"))
    assert "00000003" in steps(tmp_path / "host0")  # process 0 committed its own copy
    reps = reports(run(2, "restore", tmp_path, "local", 2, env={"JAXCKPT_TEST_REPL": "0"}))
    assert reps[0]["rejected"][0][0] == 3 and "held by none" in reps[0]["rejected"][0][1]
    assert steps(tmp_path / "host1") == ["00000001", "00000002"]  # leftover removed


@pytest.mark.slow
def test_restart_with_fewer_processes(tmp_path):
    run(4, "save", tmp_path, 3, env={"JAXCKPT_TEST_REMOTE": "2"})
    # hosts 0 and 2 survive: host0 holds p0 and (peer copy) p3, host2 holds p2 and p1
    reps = reports(run(2, "restore", tmp_path, "local", 3, env={"JAXCKPT_TEST_HOSTS": "[0, 2]"}))
    assert all(r["saved_process_count"] == 4 and r["process_count"] == 2 for r in reps)
    assert {p[3] for r in reps for p in r["from_peers"] if p[0] == "w"} == {1, 3}
    # hosts 0 and 1 hold p0, p3, p1 only: p2's rows are lost locally -> the remote step
    reps = reports(run(2, "restore", tmp_path, "remote", 2, env={"JAXCKPT_TEST_HOSTS": "[0, 1]"}))
    assert reps[0]["rejected"][0][0] == 3 and "held by none" in reps[0]["rejected"][0][1]


@pytest.mark.slow
def test_resilient_training_example(tmp_path):
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(HERE), "examples", "resilient_training.py")
    res = subprocess.run(
        [sys.executable, script, "--processes", "2", "--dir", str(tmp_path / "run"), "--steps", "12",
         "--kill-at", "10"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert '"resumed_step": 8, "tier": "local", "state_equal": true' in res.stdout
    assert "[p1] resumed from the local tier at step 8" in res.stdout
    # the replaced host's data-iterator position came from process 0's peer copy
    p1 = next(ln for ln in res.stdout.splitlines() if ln.startswith("[p1] resumed"))
    assert "iterator position from process 0" in p1, p1
