"""Reads in flight under a byte budget (jaxckpt/_src/io/inflight.py): the budget holds, reads
are used in the order added, errors surface in order, and the default budget; the watch
names a read that stalls (with real TensorStore futures and a thread blocked in a real
``read``), and progress keeps a slow one alive."""

import itertools
import os
import threading
import time
from concurrent.futures import Future

import pytest
import tensorstore as ts

from jaxckpt._src.io.inflight import (
    READ_BUDGET_BYTES,
    InFlight,
    Raises,
    Stall,
    Watch,
    default_budget,
)
from jaxckpt.errors import ReadStalledError, StorageError


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


WHO = "process 7 of 8 (host h7)"


@pytest.mark.parametrize("threads", [0, 2])
def test_a_stalled_read_is_handed_to_its_use_named_and_cancelled(threads):
    """Three TensorStore reads, the middle one never answered: it reaches its use as
    ``Raises`` after the bound, naming the process and what it read, and is cancelled; the
    others are used as they are."""
    promises = [ts.Promise.new() for _ in range(3)]
    promises[0][0].set_result("a")
    promises[2][0].set_result("c")
    got: dict[int, object] = {}

    def use(i):
        def take(handle):
            try:
                got[i] = handle.result()
            except ReadStalledError as e:
                got[i] = e

        return take

    reads = InFlight(budget=100, threads=threads, watch=Watch(Stall(0.3, WHO)))
    started = time.monotonic()
    try:
        for i, (_, fut) in enumerate(promises):
            reads.add(1, lambda fut=fut: fut, use(i), lambda i=i: f"s3://b/x/d/{i} (chunk {i})")
        reads.drain()
    finally:
        reads.close()
    took = time.monotonic() - started
    assert got[0] == "a" and got[2] == "c"
    error = got[1]
    assert isinstance(error, ReadStalledError) and isinstance(error, StorageError)
    assert str(error).startswith(f"{WHO}: no answer came for s3://b/x/d/1 (chunk 1)"), error
    assert "stall_timeout_s=0.3" in str(error)
    assert promises[1][1].cancelled()
    assert 0.3 <= took < 5, took


def test_progress_keeps_a_slow_read_alive():
    """A read slower than the bound is waited for while anything progresses: a watched
    call returning (a ``preadv`` of another read), or the probe's count changing
    (TensorStore's bytes read)."""
    slow: Future[str] = Future()
    watch = Watch(Stall(0.3, WHO))
    stop = threading.Event()

    def busy():  # another read's calls, returning one after another
        while not stop.is_set():
            watch.enter("/data/d/other", 0, 4096)
            time.sleep(0.02)
            watch.leave()

    threading.Timer(1.0, slow.set_result, ["done"]).start()
    thread = threading.Thread(target=busy)
    thread.start()
    try:
        assert watch.wait(slow, lambda: "slow") is slow
    finally:
        stop.set()
        thread.join()
    counted: Future[str] = Future()
    threading.Timer(1.0, counted.set_result, ["done"]).start()
    probed = Watch(Stall(0.3, WHO), probe=itertools.count().__next__)
    assert probed.wait(counted, lambda: "counted") is counted
    quiet: Future[str] = Future()
    assert isinstance(Watch(Stall(0.3, WHO)).wait(quiet, lambda: "quiet"), Raises)


def test_a_thread_blocked_in_the_kernel_is_named_and_left_behind():
    """A thread blocked in a real ``read`` (a pipe nobody writes) inside ``enter``: the
    stall names its file and bytes, ``stop`` gives it up after the bound (its reader then
    closes without it), and no new watched call starts once stopped."""
    r, w = os.pipe()
    watch = Watch(Stall(0.3, WHO))
    done: Future[bytes] = Future()

    def read():
        watch.enter("/data/d/abc", 4096, 8192)
        try:
            done.set_result(os.read(r, 1))
        finally:
            watch.leave()

    thread = threading.Thread(target=read)
    thread.start()
    try:
        handed = watch.wait(done, lambda: "leaf 'w' slice 0:8")
        assert isinstance(handed, Raises)
        with pytest.raises(ReadStalledError) as caught:
            handed.result()
        text = str(caught.value)
        assert text.startswith(f"{WHO}: a read of /data/d/abc (bytes 4096-8191) has been blocked")
        assert "reading leaf 'w' slice 0:8" in text
        assert watch.stop() is False  # stuck past the bound: left behind
        with pytest.raises(StorageError, match="given up"):
            watch.enter("/data/d/abc", 0, 1)
    finally:
        os.write(w, b"x")
        thread.join()
        os.close(r)
        os.close(w)
    assert done.result() == b"x" and watch.stop() is True  # nothing blocked any more
