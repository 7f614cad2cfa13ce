"""Per-process values (data-iterator positions) saved with a step, in both managers."""

import json
import os
import random
import shutil

import multiproc
import numpy as np
import pytest
from conftest import assert_tree_equal, listing

import jaxckpt
from jaxckpt import errors

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "workers", "grain_train.py")
STEPS = 12


def small():
    return {"w": np.arange(6, dtype=np.float32)}


@pytest.mark.parametrize(
    "value",
    [
        {"next_index": 12, "epoch": 0, "name": "shard-0"},  # what grain's get_state() returns
        b"\x00\x01opaque iterator state",
        [1, 2.5, None, "x"],
        {"rng": np.arange(4, dtype=np.uint32), "offset": np.int64(9), "f": np.float16(1.5)},
    ],
    ids=["json", "bytes", "list", "numpy"],
)
def test_values_round_trip(tmp_path, value):
    jaxckpt.save(tmp_path / "c", small(), per_process=value)
    got = jaxckpt.per_process(tmp_path / "c")
    assert_tree_equal(got, value)
    if isinstance(value, dict) and "rng" in value:
        assert got["rng"].dtype == np.uint32 and isinstance(got["offset"], np.int64)
    assert jaxckpt.per_process(tmp_path / "c", all=True)[0] is not None
    assert sorted(os.listdir(tmp_path / "c" / "per_process")) == ["00000.json"]
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    assert manifest["per_process"] == [0]
    assert manifest["format_version"] == list(jaxckpt.FORMAT_VERSION)


def test_a_grain_dataloader_resumes_from_its_saved_bytes(tmp_path):
    """grain.DataLoader's iterator state is bytes: saved per process, it resumes the loader
    at the same record."""
    import grain

    def loader():
        sampler = grain.samplers.IndexSampler(
            num_records=100, shuffle=True, seed=3, num_epochs=1,
            shard_options=grain.sharding.NoSharding(),
        )  # fmt: skip
        src = grain.sources.RangeDataSource(0, 100, 1)
        return grain.DataLoader(data_source=src, sampler=sampler, worker_count=0)

    it = iter(loader())
    seen = [next(it) for _ in range(5)]
    jaxckpt.save(tmp_path / "c", small(), per_process=it.get_state())
    rest = [next(it) for _ in range(5)]
    state = jaxckpt.per_process(tmp_path / "c")
    assert isinstance(state, bytes)
    resumed = iter(loader())
    resumed.set_state(state)
    assert [next(resumed) for _ in range(5)] == rest and rest[0] not in seen


def test_none_saves_no_record(tmp_path):
    jaxckpt.save(tmp_path / "c", small())
    assert jaxckpt.per_process(tmp_path / "c") is None
    assert not os.path.exists(tmp_path / "c" / "per_process")


@pytest.mark.parametrize("bad", [object(), {"it": object()}, {"a": np.array(["s"])}])
def test_bad_value_is_refused_before_anything_is_written(tmp_path, bad):
    with pytest.raises(errors.UnsupportedLeafError, match=r"process 0.*(object|<U1)"):
        jaxckpt.save(tmp_path / "c", small(), per_process=bad)
    assert not os.path.exists(tmp_path / "c")
    with jaxckpt.CheckpointManager(tmp_path / "m") as mgr:
        with pytest.raises(errors.UnsupportedLeafError, match="process 0"):
            mgr.save(1, small(), per_process=bad)
        assert mgr.all_steps() == [] and listing(tmp_path / "m") == []
    opts = jaxckpt.EmergencyOptions(local_interval_steps=1)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts) as mgr:
        with pytest.raises(errors.UnsupportedLeafError, match="process 0"):
            mgr.save(1, small(), per_process=bad)
        assert mgr.all_steps() == [] and listing(tmp_path / "l") == []


def test_a_damaged_record_is_never_returned(tmp_path):
    jaxckpt.save(tmp_path / "c", small(), per_process={"next_index": 5})
    f = tmp_path / "c" / "per_process" / "00000.json"
    f.write_text(f.read_text().replace('"next_index": 5', '"next_index": 6'))
    with pytest.raises(errors.ChecksumError, match="process 0.*checksum"):
        jaxckpt.per_process(tmp_path / "c")
    f.unlink()
    with pytest.raises(errors.ChecksumError, match="missing"):
        jaxckpt.per_process(tmp_path / "c")


def test_manager_snapshots_the_value_at_save_and_reads_the_restored_step(tmp_path):
    state = {"next_index": 1}
    with jaxckpt.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, small(), per_process=state)
        state["next_index"] = 99  # changed while the async write may still run
        mgr.save(2, small(), per_process={"next_index": 2})
        mgr.wait_until_finished()
        assert mgr.per_process() == {"next_index": 2}  # newest
        mgr.restore(1)
        assert mgr.per_process() == {"next_index": 1}  # the restored step
        assert mgr.per_process(2) == {"next_index": 2}


def test_emergency_manager_keeps_it_in_both_tiers(tmp_path):
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1, remote=jaxckpt.Options(save_interval_steps=2)
    )
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, small(), per_process={"next_index": step})
        mgr.wait_until_finished()
        mgr.restore()
        assert (mgr.last_report.tier, mgr.last_report.step) == ("local", 3)
        assert mgr.per_process() == {"next_index": 3}
        assert mgr.last_report.per_process_from == 0
        assert mgr.per_process(2) == {"next_index": 2}  # the remote tier's step
        with pytest.raises(errors.CheckpointNotFoundError, match="local step 1.*restore"):
            mgr.per_process(1)  # a local step not restored
    doc = json.loads((tmp_path / "l" / "00000003" / "local.json").read_text())
    assert doc["per_process"]["0"]["value"] == {"next_index": 3}


def test_on_s3(s3_url):
    """Object stores have no rename: the record is written in place, before COMMITTED."""
    with jaxckpt.CheckpointManager(s3_url) as mgr:
        mgr.save(1, small(), per_process=b"position")
        mgr.wait_until_finished()
    with jaxckpt.CheckpointManager(s3_url) as mgr:
        mgr.restore(target=small())
        assert mgr.per_process() == b"position"
        assert jaxckpt.per_process(f"{s3_url}/00000001") == b"position"


# --- multi-process: a Grain pipeline per process, SIGKILL, resume ---------------------------


def _train(mode, root, *, kill_at=None):
    args = [mode, str(root), str(STEPS)] + ([str(kill_at)] if kill_at else [])
    res = multiproc.run(WORKER, 2, devices_per_process=4, args=args, timeout_s=120)
    if kill_at is None:
        return res.check()
    # each process SIGKILLs itself; one may go first and take the coordinator with it, so
    # the other can also die of that
    assert all(rc != 0 for rc in res.returncodes), (res.returncodes, res.outputs)
    return res


def _seen(root, pid):
    return [json.loads(x) for x in (root / f"seen{pid}.jsonl").read_text().splitlines()]


def _resumed(res):
    out = []
    for text in res.outputs:
        line = next(ln for ln in text.splitlines() if ln.startswith("RESUMED "))
        _, step, source = line.split(" ", 2)
        out.append((int(step), json.loads(source)))
    return out


def _digests(res):
    return [next(ln for ln in t.splitlines() if ln.startswith("DIGEST ")) for t in res.outputs]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    root = tmp_path_factory.mktemp("straight")
    res = _train("manager", root)
    return root, _digests(res)


def _check_resumed_run_equals_straight(straight, root, resumed, kill_at):
    """Each process's batches: the killed run's up to the step it resumed from (later ones
    were trained on but never committed), then the resumed run's: the straight run's."""
    sroot, _ = straight
    for pid in (0, 1):
        lines = _seen(root, pid)
        killed, after = lines[:kill_at], lines[kill_at:]
        assert [e["step"] for e in killed] == list(range(kill_at))
        at = resumed[pid][0]
        assert [e["step"] for e in after] == list(range(at, STEPS))
        got = [e["ids"] for e in killed if e["step"] < at] + [e["ids"] for e in after]
        want = [e["ids"] for e in _seen(sroot, pid)]
        assert got == want, f"process {pid}: batches differ from the straight run"


@pytest.mark.slow
def test_manager_resume_after_sigkill_replays_the_same_batches(straight, tmp_path):
    kill_at = random.Random(15).randrange(3, STEPS - 2)
    _train("manager", tmp_path, kill_at=kill_at)
    res = _train("manager", tmp_path)
    resumed = _resumed(res)
    assert resumed[0][0] == resumed[1][0] and resumed[0][0] in (kill_at - 1, kill_at)
    _check_resumed_run_equals_straight(straight, tmp_path, resumed, kill_at)
    assert _digests(res) == straight[1]  # bit-identical parameters
    # saved by 2 processes, read by this one-process job: matched by index is refused
    step = tmp_path / "ckpt" / f"{STEPS:08d}"
    with pytest.raises(errors.ProcessCountChangedError, match="saved by 2 processes.*has 1"):
        jaxckpt.per_process(step)
    both = jaxckpt.per_process(step, all=True)
    assert len(both) == 2 and all(isinstance(v, dict) and v for v in both)
    assert jaxckpt.per_process(step, process=1) == both[1]
    with jaxckpt.CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(errors.ProcessCountChangedError, match="all=True"):
            mgr.per_process()
        assert mgr.per_process(all=True) == both


@pytest.mark.slow
def test_emergency_resume_with_a_wiped_host_takes_the_position_from_the_peer(straight, tmp_path):
    kill_at = random.Random(16).randrange(3, STEPS - 2)
    _train("emergency", tmp_path, kill_at=kill_at)
    shutil.rmtree(tmp_path / "host1")  # a replaced host: its local disk is empty
    res = _train("emergency", tmp_path)
    resumed = _resumed(res)
    assert resumed[0][0] == resumed[1][0] and resumed[0][0] in (kill_at - 1, kill_at)
    assert resumed[1][1] == ["local", 0]  # process 1's iterator position came from process 0
    assert resumed[0][1] == ["local", 0]
    _check_resumed_run_equals_straight(straight, tmp_path, resumed, kill_at)
    assert _digests(res) == straight[1]


@pytest.mark.parametrize(
    "forge, why",
    [
        (lambda a: a.update(shape=[1_000_000]), "must hold 1000000"),
        (lambda a: a.pop("path"), "path is missing"),
        (lambda a: a.update(path=[["i", 10**11]]), "sequence index above"),
        (lambda a: a.update(dtype="O"), "not a numeric dtype"),
        (lambda a: a.update(data="%%%"), "must be base64"),
    ],
    ids=["shape", "no-path", "huge-index", "object-dtype", "not-base64"],
)
def test_a_forged_record_is_refused_naming_the_file(tmp_path, forge, why):
    """The checksum sits in the same file, so a record rewritten with a matching one passes
    it: every field of its arrays is checked too, and a bad one names the file and field."""
    from jaxckpt._src import per_process as pp

    jaxckpt.save(tmp_path / "c", small(), per_process={"pos": np.arange(3)})
    f = tmp_path / "c" / "per_process" / "00000.json"
    doc = json.loads(f.read_text())
    forge(doc["value"][0])
    doc["sha256"] = pp._digest(doc["value"])
    f.write_text(json.dumps(doc))
    with pytest.raises(errors.CheckpointError, match=f"process 0's per-process record.*{why}"):
        jaxckpt.per_process(tmp_path / "c")
