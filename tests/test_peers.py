"""Peer copies device to device (``peers.send_shards``), in real multi-process jobs."""

import json
import os

import multiproc
import pytest

from jaxckpt._src.emergency import peers

WORKER = os.path.join(os.path.dirname(__file__), "workers", "peers_send.py")


def test_peer_shifts_put_copies_on_other_hosts():
    # two processes per host, numbered host by host: shift 1 would keep p0's copy on host a
    assert peers.peer_shifts(["a", "a", "b", "b"], 1) == ((2,), [])
    assert peers.peer_shifts(["a", "b", "a", "b"], 1) == ((1,), [])
    assert peers.peer_shifts(["a", "a", "b", "b", "c", "c"], 2) == ((2, 3), [])
    # more copies than other hosts allow: the rest go where they must, and say so
    assert peers.peer_shifts(["a", "a", "b", "b"], 3) == ((2, 1, 3), [0, 1, 2, 3])
    assert peers.peer_shifts(["h"] * 3, 1) == ((1,), [0, 1, 2])  # one machine: no choice
    assert peers.peer_shifts(["a"], 1) == ((), [])


def received(n: int, shifts: str) -> list[dict]:
    res = multiproc.run(WORKER, n, devices_per_process=8 // n, args=[shifts], timeout_s=90)
    res.check()
    return [
        json.loads(line[3:])
        for text in res.outputs
        for line in text.splitlines()
        if line.startswith("OK ")
    ]


def test_owned_shards_reach_the_next_process_once():
    out = received(2, "1")
    assert len(out) == 2
    for o in out:
        # w: 2 of 4 row blocks x 2 columns held by the other process; d and g: its 2 row
        # blocks, sent once although 2 devices hold each (g through the flat-mesh path);
        # b, r: every process holds them, nothing moves.
        assert o["received"] == {"w": 4, "b": 0, "r": 0, "d": 2, "t": 4, "g": 2}, o
        assert o["as_rows"] == ["sub"]


@pytest.mark.slow
def test_two_shifts_on_four_processes():
    out = received(4, "1,2")
    assert len(out) == 4
    for o in out:
        # (4, 2) mesh over 4 processes: each holds one row block of w (2 columns) and of d
        # (one copy of it); from two senders: twice that
        assert o["received"]["w"] == 4 and o["received"]["d"] == 2, o
        assert o["received"]["b"] == 0 and o["received"]["r"] == 0, o
