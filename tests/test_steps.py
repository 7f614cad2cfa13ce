"""Step directories, for both tiers: publish, list, delete, clean leftovers."""

import os
import socket
import subprocess
import sys

import pytest

from jaxckpt import errors
from jaxckpt._src import steps
from jaxckpt._src.storage import being_written, hold_owner_lock, location, release_owner_lock


def _dir(loc, name, *, marker=False):
    d = loc.join(name)
    d.makedirs()
    d.write_bytes("data", b"x")
    if marker:
        d.write_bytes("COMMITTED", b"")
    return d


def test_publish_lists_and_deletes(tmp_path):
    root = location(tmp_path)
    _dir(root, "00000003")  # a leftover without its marker: replaced by the publish
    steps.publish(_dir(root, "00000003.tmp-a"), root.join("00000003"))
    assert steps.committed(root) == [3] and not os.path.exists(root.join("00000003.tmp-a").url)
    with pytest.raises(errors.CheckpointExistsError, match="nothing was overwritten"):
        steps.publish(_dir(root, "00000003.tmp-b"), root.join("00000003"))
    steps.publish(root.join("00000003.tmp-b"), root.join("00000003"), replace_committed=True)
    assert steps.committed(root) == [3]
    steps.delete(root.join("00000003"))
    assert steps.committed(root) == [] and not os.path.exists(root.join("00000003").url)


def test_clean_leftovers_spares_a_save_in_progress(tmp_path):
    root = location(tmp_path)
    _dir(root, "00000001", marker=True)
    _dir(root, "00000002")  # unmarked
    _dir(root, "00000003.tmp-x")  # interrupted
    live = _dir(root, "00000004.tmp-y")
    fd = hold_owner_lock(live)  # a save still writing
    try:
        removed = steps.clean_leftovers(root, grace_s=60)
    finally:
        release_owner_lock(fd)
    assert sorted(removed) == ["00000002", "00000003.tmp-x"]
    assert sorted(os.listdir(tmp_path)) == ["00000001", "00000004.tmp-y"]


def test_claim_makes_the_work_directory_already_locked(tmp_path):
    root = location(tmp_path)
    work = root.join("00000005.tmp-abc")
    fd = steps.claim(work)
    try:
        assert being_written(work, 0)  # never visible without its lock
        assert os.listdir(tmp_path) == ["00000005.tmp-abc"]  # the hidden name is gone
        assert steps.clean_leftovers(root, grace_s=60) == []
    finally:
        release_owner_lock(fd)
    assert steps.clean_leftovers(root, grace_s=60) == ["00000005.tmp-abc"]


def test_clean_leftovers_removes_a_claim_killed_before_its_rename(tmp_path):
    """A claim's hidden directory names its host and process: on this host it is removed
    once that process is gone, whatever the moment it died; another host's after a minute."""
    root = location(tmp_path)
    host = socket.gethostname()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a process id that no longer runs
    _dir(root, f".init-{host}-{gone.pid}-a")  # killed before it took its lock
    locked_then_killed = _dir(root, f".init-{host}-{gone.pid}-b")
    locked_then_killed.write_bytes(".owner", f"{host} {gone.pid}".encode())
    _dir(root, f".init-{host}-{os.getpid()}-c")  # this process: a claim in progress
    _dir(root, ".init-elsewhere-7-d")  # another host, young: left alone
    old = _dir(root, ".init-elsewhere-7-e")  # another host, long ago
    os.utime(old.url, (1, 1))
    removed = steps.clean_leftovers(root, grace_s=60)
    assert sorted(removed) == sorted(
        [f".init-{host}-{gone.pid}-a", f".init-{host}-{gone.pid}-b", ".init-elsewhere-7-e"]
    )
    assert sorted(os.listdir(tmp_path)) == sorted(
        [".init-elsewhere-7-d", f".init-{host}-{os.getpid()}-c"]
    )


def test_a_publish_never_replaces_a_directory_another_save_holds(tmp_path):
    """The issue's loss: the second publish used to remove the first save's renamed step
    (before its marker) and its own rename then failed, leaving COMMITTED alone."""
    root = location(tmp_path)
    first = root.join("00000007.tmp-a")
    fd = steps.claim(first)
    first.write_bytes("manifest.json", b"first")
    os.rename(first.url, root.join("00000007").url)  # renamed, marker not yet written
    try:
        second = _dir(root, "00000007.tmp-b")
        with pytest.raises(errors.CheckpointExistsError, match="written by another save"):
            steps.publish(second, root.join("00000007"))
    finally:
        release_owner_lock(fd)
    assert root.join("00000007").read_bytes("manifest.json") == b"first"


def test_racing_saves_of_one_path_never_mix_or_lose_a_reported_save(tmp_path):
    """20 trials of two standalone saves of one path at the same moment (no manager, no
    lease: only the commit protects them): every time one or both fail cleanly, the path
    holds exactly the values of a save that returned, and nothing else is left."""
    import threading

    import numpy as np

    import jaxckpt

    for trial in range(20):
        path = tmp_path / f"{trial}"
        go = threading.Barrier(2)
        outcome: dict[int, object] = {}

        def save(j: int, path=path, go=go, outcome=outcome, trial=trial) -> None:
            values = {"w": np.full((64, 16), j * 1000 + trial, np.float32)}
            go.wait()
            try:
                jaxckpt.save(path, values)
                outcome[j] = "saved"
            except errors.CheckpointExistsError as e:
                outcome[j] = e

        threads = [threading.Thread(target=save, args=(j,)) for j in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        saved = [j for j, o in outcome.items() if o == "saved"]
        assert len(saved) == 1, outcome
        got = jaxckpt.restore(path)["w"]
        assert np.all(got == saved[0] * 1000 + trial)
        assert os.listdir(tmp_path / f"{trial}") and not [
            n for n in os.listdir(tmp_path) if n.startswith(f"{trial}.tmp-")
        ]


def test_scan_tells_committed_steps_from_marked_ones_without_their_file(tmp_path):
    root = location(tmp_path)
    good = _dir(root, "00000001", marker=True)
    good.write_bytes("manifest.json", b"{}")
    _dir(root, "00000002", marker=True)  # COMMITTED, no manifest: an older version's loss
    _dir(root, "00000003")  # unmarked leftover
    assert steps.scan(root, "manifest.json") == steps.Scan(committed=[1], broken=[2])
    assert steps.committed(root) == [1, 2]  # without a required file: the markers alone
