"""Reads in flight under a byte budget: the one reader of restore, safetensors and verify.

A caller adds reads in the order it wants them used. ``add`` first waits until the new
read fits in the budget (using the oldest reads meanwhile), then starts it; each read is
used in order, on the calling thread or on a few worker threads, so reading the next slices
overlaps copying the last ones onto their devices. Host memory stays about ``budget``
whatever the size of the checkpoint.

>>> reads = InFlight(budget=64 << 20)
>>> for box in boxes:
...     reads.add(nbytes(box), lambda box=box: store[box].read(), lambda f: use(f.result()))
>>> reads.drain()

A ``Watch`` bounds the waits: a read that makes no progress for ``Stall.seconds`` is handed
to its use as one whose result raises ``ReadStalledError`` (naming the process, what it
reads and how long it waited), and it is cancelled; see ``Watch``.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from ...errors import ReadStalledError, StorageError

READ_BUDGET_BYTES = 128 << 20  # host memory for slices read but not yet used (the least)
BUDGET_PER_THREAD = 64 << 20
STALL_TIMEOUT_S = 300.0  # a read that makes no progress this long is named and given up
POLL_S = 1.0  # a watched wait looks for progress this often (at most)


def default_budget(threads: int) -> int:
    """A restore's read budget when none is given: 64 MiB for each thread reading, at least
    ``READ_BUDGET_BYTES`` (2 threads, hosts of up to 5 cores). More threads need more reads
    in flight to stay busy (docs/MEASURED.md)."""
    return max(READ_BUDGET_BYTES, threads * BUDGET_PER_THREAD)


@dataclass(frozen=True)
class Stall:
    """How long a read may make no progress (``seconds``) before it is given up, and who
    reads (``who``: the process and its host, named first in the error)."""

    seconds: float = STALL_TIMEOUT_S
    who: str = field(default_factory=lambda: f"pid {os.getpid()}")


Describe = Callable[[], str]  # what a read reads, for its error (called only on a stall)


class Raises:
    """A read that failed as it started, or was given up (a ReadStalledError): ``result``
    raises its error, named already (a handle like the others)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self, timeout: float | None = None) -> Any:
        raise self.error

    def done(self) -> bool:
        return True


class Watch:
    """The progress of one reader's reads, so that a stalled read is named, not waited on.

    Progress is: a read started or finished; a call that may block in the kernel returned
    (``enter``/``leave`` around each ``preadv`` and each fault-in of a mapping, on the direct
    reader's threads, which so name the exact file and bytes of a stall); or ``probe()``
    changed (bytes read that no handle shows: TensorStore's counters, ``arrays.bytes_read``).
    ``wait`` hands a read back once it is done, or, after ``Stall.seconds`` without any
    progress, cancelled and as ``Raises`` (its error). ``stop`` ends it as its reader closes."""

    def __init__(self, stall: Stall, probe: Callable[[], int] | None = None) -> None:
        self.stall = stall
        self._probe = probe
        self._seen = probe() if probe is not None else 0
        self._last = time.monotonic()
        self._blocked: dict[int, tuple[str, int, int, float]] = {}  # thread: file, bytes, since
        self._stopped = False

    def progress(self) -> None:
        self._last = time.monotonic()

    def enter(self, file: str, start: int, stop: int) -> None:
        """This thread starts a call that may block reading bytes ``start`` to ``stop`` of
        ``file``; raises StorageError once the watch is stopped (its reads are given up)."""
        me = threading.get_ident()  # (no lock: each step is atomic, and ``stop`` checks after)
        self._blocked[me] = (file, start, stop, time.monotonic())
        if self._stopped:
            del self._blocked[me]
            raise StorageError(f"the read of {file} was given up (the restore failed)")

    def leave(self) -> None:
        """This thread's call (``enter``) returned: progress."""
        self._blocked.pop(threading.get_ident(), None)
        self._last = time.monotonic()

    def idle(self) -> float:
        """Seconds since the last progress."""
        if self._probe is not None and (seen := self._probe()) != self._seen:
            self._seen = seen
            self.progress()
        return time.monotonic() - self._last

    def wait(self, handle: Any, what: Describe, *, cancel: bool = True) -> Any:
        """``handle`` (``result(timeout)``, ``done()``) once it is done; or, where no read
        progressed for ``Stall.seconds`` meanwhile, ``Raises`` (``handle`` cancelled where
        ``cancel`` and it can be: TensorStore's reads; the direct reader's threads stop when
        it closes)."""
        step = min(POLL_S, self.stall.seconds / 4)
        while True:
            try:
                handle.result(timeout=step)
            except TimeoutError:
                if not handle.done():
                    idle = self.idle()
                    if idle < self.stall.seconds:
                        continue
                    if cancel:
                        _cancel(handle)
                    return Raises(self.error(what, idle))
            except Exception:
                pass  # done, failed: its use raises the error
            self.progress()
            return handle

    def error(self, what: Describe, idle: float) -> ReadStalledError:
        """The error of a stall: who, the call blocked longest (the file and bytes) or else
        ``what()``, and for how long."""
        now = time.monotonic()
        blocked = sorted(list(self._blocked.values()), key=lambda b: b[3])
        if blocked:
            file, a, b, since = blocked[0]
            where = (
                f"a read of {file} (bytes {a}-{b - 1}) has been blocked in the kernel for "
                f"{now - since:.1f}s, reading {what()}"
            )
        else:
            where = f"no answer came for {what()}"
        return ReadStalledError(
            f"{self.stall.who}: {where}; no read progressed for {idle:.1f}s "
            f"(stall_timeout_s={self.stall.seconds:g}), so the reads were given up. The "
            "storage under that file stalls (a hung mount or disk, an object store or proxy "
            "that holds back its answer): check it from this host, then restart the job"
        )

    def stop(self) -> bool:
        """Lets no new blocking call start and waits up to ``Stall.seconds`` for those in
        progress to return: False where one is blocked past that (its thread is left
        behind: a read stuck in the kernel cannot be interrupted)."""
        self._stopped = True
        while True:
            since = min((b[3] for b in list(self._blocked.values())), default=None)
            if since is None:
                return True
            if time.monotonic() - since >= self.stall.seconds:
                return False
            time.sleep(0.01)


def _cancel(handle: Any) -> None:
    """Cancels a read that can be (TensorStore's futures); the direct reader's own futures
    are cancelled by its ``close``."""
    if not isinstance(handle, Future) and callable(cancel := getattr(handle, "cancel", None)):
        cancel()


H = TypeVar("H")  # what starting a read returns: a future, a handle


class InFlight(Generic[H]):
    """At most ``budget`` bytes read but not yet used (a single read larger than the budget
    still runs, alone). ``threads``: use reads on that many worker threads (0: the caller's).
    ``watch``: bound each wait for a read (handles then have ``result(timeout)`` and
    ``done()``): a read that stalls is handed to its use as ``Raises``."""

    def __init__(
        self, budget: int = READ_BUDGET_BYTES, *, threads: int = 0, watch: Watch | None = None
    ) -> None:
        self.budget = budget
        self.total = 0  # bytes of every read started, for the figures
        self.watch = watch
        self._held = 0
        self._started: collections.deque[tuple[int, H, Callable[[H], None], Describe | None]] = (
            collections.deque()
        )
        self._using: collections.deque[tuple[Future[None], int, H]] = collections.deque()
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="jaxckpt-read") if threads else None
        )

    def add(
        self,
        nbytes: int,
        start: Callable[[], H],
        use: Callable[[H], None],
        what: Describe | None = None,
    ) -> None:
        """Starts a read of ``nbytes`` (``start()``, once it fits) and queues ``use`` of
        what it returned: on the worker threads at once (a use waits there for its read),
        else on this thread when the budget or ``drain`` needs it. Errors of ``start``
        raise here; those of ``use`` here or in ``drain``, in order. ``what()`` names the
        read in a stall's error."""
        while self._held + nbytes > self.budget and (self._started or self._using):
            self._advance()
        handle = start()
        if self.watch is not None:
            self.watch.progress()  # (a read's clock starts as it starts)
        if self._pool is None:
            self._started.append((nbytes, handle, use, what))
        else:  # (handing uses over one at a time cost a round trip of threads per read)
            self._using.append((self._pool.submit(self._use, handle, use, what), nbytes, handle))
        self._held += nbytes
        self.total += nbytes

    def drain(self) -> None:
        """Uses every read started."""
        while self._started or self._using:
            self._advance()

    def close(self) -> None:
        """Cancels the reads not used (after an error) and stops the worker threads (none
        outlives the caller)."""
        for _, handle, *_ in self._started:
            _cancel(handle)
        for *_, handle in self._using:
            _cancel(handle)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _use(self, handle: H, use: Callable[[H], None], what: Describe | None) -> None:
        if self.watch is not None:
            handle = self.watch.wait(handle, what or (lambda: "a read"))
        use(handle)

    def _advance(self) -> None:
        """Uses the oldest read on this thread, or waits for the oldest use on a worker."""
        if self._started:
            nbytes, handle, use, what = self._started.popleft()
            self._use(handle, use, what)
        else:
            done, nbytes, _ = self._using.popleft()
            done.result()
        self._held -= nbytes
