"""Reads in flight under a byte budget (jaxckpt/_src/io/inflight.py): the budget holds, reads
are used in the order added, errors surface in order, and the default budget."""

import threading

import pytest

from jaxckpt._src.io.inflight import READ_BUDGET_BYTES, InFlight, default_budget


class Ledger:
    """Bytes started but not yet used, and the most there ever were."""

    def __init__(self):
        self.held = self.peak = 0
        self.used: list[int] = []
        self.lock = threading.Lock()

    def start(self, i: int, nbytes: int):
        def go():
            with self.lock:
                self.held += nbytes
                self.peak = max(self.peak, self.held)
            return (i, nbytes)

        return go

    def use(self, handle):
        i, nbytes = handle
        with self.lock:
            self.used.append(i)
            self.held -= nbytes


@pytest.mark.parametrize("threads", [0, 2])
def test_the_budget_holds_and_reads_are_used_in_order(threads):
    ledger = Ledger()
    sizes = [30, 50, 20, 70, 10, 40, 60, 5]
    reads = InFlight(budget=100, threads=threads)
    try:
        for i, n in enumerate(sizes):
            reads.add(n, ledger.start(i, n), ledger.use)
            assert ledger.held <= 100
        reads.drain()
    finally:
        reads.close()
    assert ledger.peak <= 100
    assert ledger.held == 0 and reads.total == sum(sizes)
    if threads == 0:
        assert ledger.used == list(range(len(sizes)))  # on the caller's thread, in order
    else:
        assert sorted(ledger.used) == list(range(len(sizes)))


def test_worker_threads_use_each_read_without_waiting_for_the_caller():
    """With worker threads, a read's use starts as soon as the read is added, well within
    the budget and before ``drain``: the caller does not hand uses over one at a time (a
    round trip of threads per read, most of a restore of many small slices)."""
    used = [threading.Event() for _ in range(3)]
    reads = InFlight(budget=1 << 30, threads=1)
    try:
        for i in range(len(used)):
            reads.add(1, lambda i=i: i, lambda i: used[i].set())
        assert all(ev.wait(timeout=10) for ev in used)  # no drain yet
        reads.drain()
    finally:
        reads.close()


def test_a_read_larger_than_the_budget_runs_alone():
    ledger = Ledger()
    reads = InFlight(budget=10)
    for i, n in enumerate([4, 25, 4]):
        reads.add(n, ledger.start(i, n), ledger.use)
        assert ledger.held in (4, 25)  # the big one waits for the first, and is waited for
    reads.drain()
    assert ledger.used == [0, 1, 2] and ledger.peak == 25


def test_errors_raise_where_they_belong():
    reads = InFlight(budget=100)

    def broken():
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        reads.add(10, broken, lambda h: None)

    def bad_use(handle):
        raise ValueError(f"bad {handle}")

    reads.add(10, lambda: "a", bad_use)
    with pytest.raises(ValueError, match="bad a"):
        reads.drain()


def test_the_default_budget_grows_with_the_reader_threads():
    assert default_budget(1) == default_budget(2) == READ_BUDGET_BYTES == 128 << 20
    assert default_budget(8) == 512 << 20
    assert default_budget(3) == READ_BUDGET_BYTES * 3 // 2
