"""The run log (jaxckpt/_src/goodput/runlog.py): real files, real object store, real SIGKILLs."""

import json
import logging
import os
import random
import subprocess
import sys
import time

import pytest

from jaxckpt import errors
from jaxckpt._src import steps
from jaxckpt._src.goodput.runlog import LOG_VERSION, RunLog, previous_step, read
from jaxckpt._src.storage import location

WORKER = os.path.join(os.path.dirname(__file__), "workers", "runlog_append.py")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _file(d) -> str:
    return os.path.join(d, "runlog", "process-0.jsonl")


def test_every_event_kind_round_trips(tmp_path):
    clock = Clock()
    log = RunLog([location(tmp_path)], 0, heartbeat_s=30, job="job-a", clock=clock)
    log.append("start", processes=2, previous_step=None, tiers=["local", "remote"])
    log.heartbeat(1)  # too soon after start: nothing written
    clock.t += 30
    log.heartbeat(2)
    clock.t += 1
    log.append("save", 2, tier="local", blocking_s=0.5, write_s=1.5, bytes=1 << 20)
    log.append("restore", 2, tier="peer", seconds=3.0, sources={"peer": 4})
    log.append("cancel", 2, tier="remote", seconds=0.1)
    log.append("interval", 2, tier="remote", steps=50, predicted_ettr=0.9, step_s=1.0,
               save_s=2.0, restart_s=60.0, mtbf_s=3600.0)  # fmt: skip
    clock.t += 1
    log.close(7)
    log.close(8)  # a second close writes nothing
    log.append("step", 9)  # nor an append after close
    got = read(tmp_path)
    assert got.skipped == 0 and got.path == location(tmp_path).join("runlog").url
    kinds = [(e.event, e.step, e.t) for e in got.events]
    assert kinds == [("start", None, 1000.0), ("step", 2, 1030.0), ("save", 2, 1031.0),
                     ("restore", 2, 1031.0), ("cancel", 2, 1031.0), ("interval", 2, 1031.0),
                     ("end", 7, 1032.0)]  # fmt: skip
    assert {e.job for e in got.events} == {"job-a"} and {e.process for e in got.events} == {0}
    by = {e.event: dict(e.fields) for e in got.events}
    assert by["start"] == {"processes": 2, "previous_step": None, "tiers": ["local", "remote"]}
    assert by["save"] == {"tier": "local", "blocking_s": 0.5, "write_s": 1.5, "bytes": 1 << 20}
    assert by["restore"] == {"tier": "peer", "seconds": 3.0, "sources": {"peer": 4}}
    assert by["interval"]["steps"] == 50 and by["interval"]["mtbf_s"] == 3600.0
    with open(_file(tmp_path), "rb") as f:
        lines = f.read().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(ln)["v"] == LOG_VERSION for ln in lines[:-1])
    assert previous_step(got.events) == 7  # the end's step, not the restore's
    assert previous_step(got.events[:1]) is None


def _two_events(d, job="job-a"):
    clock = Clock()
    log = RunLog([location(d)], 0, job=job, clock=clock)
    log.append("start", processes=1, previous_step=None, tiers=["dir"])
    clock.t += 5
    log.append("step", 10)
    return log


def test_torn_last_line_is_skipped_and_counted(tmp_path):
    _two_events(tmp_path)
    with open(_file(tmp_path), "ab") as f:
        f.write(b'{"v": 1, "t": 1010.0, "event": "sa')  # killed in the middle of a write
    got = read(tmp_path)
    assert [e.event for e in got.events] == ["start", "step"] and got.skipped == 1


def test_a_new_job_after_a_torn_line_reads_both_jobs(tmp_path):
    _two_events(tmp_path)
    with open(_file(tmp_path), "ab") as f:
        f.write(b'{"v": 1, "t": 1010.0, "event": "sa')
    log = RunLog([location(tmp_path)], 0, job="job-b", clock=Clock(2000.0))
    log.append("start", processes=1, previous_step=10, tiers=["dir"])
    got = read(tmp_path)
    assert [(e.job, e.event) for e in got.events] == [
        ("job-a", "start"), ("job-a", "step"), ("job-b", "start")]  # fmt: skip
    assert got.skipped == 1 and got.events[-1].fields["previous_step"] == 10


def test_unknown_fields_and_kinds_are_ignored_newer_versions_skipped(tmp_path, caplog):
    _two_events(tmp_path)
    future = [
        {"v": 1, "t": 1006.0, "event": "save", "job": "j", "process": 0, "step": 11,
         "tier": "dir", "a_future_field": [1, 2]},
        {"v": 1, "t": 1007.0, "event": "a_future_kind", "job": "j", "process": 0, "step": None},
        {"v": LOG_VERSION + 1, "t": 1008.0, "event": "step", "job": "j", "process": 0, "step": 12},
    ]  # fmt: skip
    with open(_file(tmp_path), "a") as f:
        f.writelines(json.dumps(doc) + "\n" for doc in future)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        got = read(tmp_path)
    assert [e.event for e in got.events] == ["start", "step", "save", "a_future_kind"]
    assert got.events[2].fields["a_future_field"] == [1, 2]
    assert got.skipped == 1 and "newer run log version" in got.notes[0]
    assert "newer run log version" in caplog.text


def test_garbled_lines_in_the_middle_are_skipped_and_counted(tmp_path):
    clock = Clock()
    log = RunLog([location(tmp_path)], 0, job="j", clock=clock)
    log.append("start", processes=1, previous_step=None, tiers=["dir"])
    good = dict(v=1, t=1.0, event="step", job="j", process=0, step=1)
    with open(_file(tmp_path), "ab") as f:
        for bad in (b"\xff\xfe garbage", b"[1, 2]", b"{}", json.dumps(good | {"process": 1}),
                    json.dumps(good | {"step": "1"}), json.dumps(good | {"t": "NaN"}),
                    json.dumps(good | {"t": float("inf")}), json.dumps(good | {"v": True}),
                    b"[" * 100_000, json.dumps(good | {"t": 10**400}),
                    json.dumps(good | {"step": 10**400}), json.dumps(good | {"step": -1})):  # fmt: skip
            f.write((bad if isinstance(bad, bytes) else bad.encode()) + b"\n")
    clock.t += 1
    log.close(3)
    got = read(tmp_path)
    assert [e.event for e in got.events] == ["start", "end"] and got.skipped == 12


def test_each_log_is_a_job_of_its_own(tmp_path):
    """Two managers of one process (restore with one, train with the next) are two jobs:
    the first one's end does not make the second look clean."""
    first = RunLog([location(tmp_path)], 0)
    first.append("start", processes=1, previous_step=None, tiers=["dir"])
    first.close(5)
    second = RunLog([location(tmp_path)], 0)
    second.append("start", processes=1, previous_step=5, tiers=["dir"])
    second.append("step", 9)  # then killed: no end
    assert first.job != second.job
    jobs = {e.job: e.event for e in read(tmp_path).events}
    assert jobs == {first.job: "end", second.job: "step"}


def test_sigkilled_writer_loses_at_most_its_last_line(tmp_path):
    """A real process appends in a tight loop and is SIGKILLed at random moments, reopened
    each time: every event it reported appended is read back; at most one torn line a kill."""
    rng = random.Random(22)
    acked: dict[str, list[int]] = {}
    kills = 3
    for trial in range(kills):
        ack = tmp_path / f"ack{trial}"
        with open(ack, "w") as out:
            proc = subprocess.Popen([sys.executable, WORKER, str(tmp_path / "run")], stdout=out)
        try:
            deadline = time.monotonic() + 60
            while ack.read_text().count("\n") < 2:  # its job id and a first event
                assert proc.poll() is None, f"trial {trial}: the worker exited {proc.returncode}"
                assert time.monotonic() < deadline, f"trial {trial}: the worker never appended"
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.2))
        finally:
            proc.kill()
            proc.wait()
        lines = ack.read_text().split("\n")[:-1]  # a last line without "\n" was cut by the kill
        acked[lines[0].split()[1]] = [int(s) for s in lines[1:]]
    got = read(tmp_path / "run")
    assert got.skipped <= kills
    for job, reported in acked.items():
        logged = [e.step for e in got.events if e.job == job]
        assert logged[: len(reported)] == reported, f"job {job}: an acknowledged event is lost"
        assert logged == list(range(len(logged))), f"job {job}: events out of order"
        assert len(logged) <= len(reported) + 1  # at most the one written before its ack
    assert len({e.job for e in got.events}) == kills


def test_object_store_rewrites_the_jobs_object_and_merges_jobs(s3_url):
    store = location(s3_url)
    clock = Clock()
    a = RunLog([store], 0, heartbeat_s=1, job="job-a", clock=clock)
    a.append("start", processes=1, previous_step=None, tiers=["dir"])
    clock.t += 1
    a.heartbeat(1)
    assert store.join("runlog").list_children() == []  # heartbeats alone write nothing
    clock.t += 1
    a.append("save", 1, tier="dir", blocking_s=0.1, write_s=0.2, bytes=10)
    objects = store.join("runlog").list_children()
    assert objects == ["process-0.job-a.jsonl"]
    assert [e.event for e in read(s3_url).events] == ["start", "step", "save"]
    clock.t += 1
    a.heartbeat(2)  # written with the next rewrite
    b = RunLog([store], 0, job="job-b", clock=Clock(clock.t + 0.5))
    b.append("start", processes=1, previous_step=2, tiers=["dir"])
    b.append("restore", 1, tier="dir", seconds=0.3, sources={})
    clock.t += 1
    a.close(2)
    got = read(s3_url)
    assert store.join("runlog").list_children() == [
        "process-0.job-a.jsonl", "process-0.job-b.jsonl"]  # fmt: skip
    assert [(e.job, e.event) for e in got.events] == [
        ("job-a", "start"), ("job-a", "step"), ("job-a", "save"), ("job-a", "step"),
        ("job-b", "start"), ("job-b", "restore"), ("job-a", "end")]  # fmt: skip
    assert got.skipped == 0


def test_no_log_is_an_error_naming_the_path(tmp_path):
    with pytest.raises(errors.RunLogError, match=f"{tmp_path}/runlog: no run log of process 0"):
        read(tmp_path)
    RunLog([location(tmp_path)], 3, job="j").append("step", 1)
    with pytest.raises(errors.RunLogError, match=r"pass process= one of \[3\]"):
        read(tmp_path)
    open(_file(tmp_path), "w").close()  # an empty log
    with pytest.raises(errors.RunLogError, match="holds no readable event"):
        read(tmp_path)


def test_a_reader_does_not_follow_a_link_out_of_runlog(tmp_path):
    outside = tmp_path / "elsewhere.jsonl"
    outside.write_text(json.dumps(dict(v=1, t=1.0, event="step", job="j", process=0, step=1)))
    (tmp_path / "run" / "runlog").mkdir(parents=True)
    os.symlink(outside, _file(tmp_path / "run"))
    with pytest.raises(errors.RunLogError, match="cannot read the run log"):
        read(tmp_path / "run")


def test_a_failed_write_never_raises_and_warns_once(tmp_path, caplog):
    (tmp_path / "runlog").write_text("a file where the log's directory would be")
    log = RunLog([location(tmp_path)], 0)
    with caplog.at_level(logging.WARNING, logger="jaxckpt"):
        log.append("start", processes=1, previous_step=None, tiers=["dir"])
        log.append("save", 1, tier="dir", blocking_s=0.1, write_s=0.1, bytes=1)
        log.close(1)
    assert caplog.text.count("cannot write the run log") == 1


def test_step_listing_and_cleaning_leave_the_run_log_alone(tmp_path):
    _two_events(tmp_path)
    d = location(tmp_path)
    assert steps.committed(d) == [] and steps.clean_leftovers(d, grace_s=0) == []
    assert os.path.exists(_file(tmp_path))
