"""One persistent background thread that runs save jobs one at a time, for the managers.

A job's failure is kept and raised in the caller's thread at the next ``raise_error``,
``wait`` or ``close`` (never lost, never raised twice). ``close`` waits for the job in
flight, stops the thread, and reports a job it could not wait for; at interpreter exit
every live writer is closed that way.

``cancel`` stops the jobs in flight: each job has a :class:`Cancel` that its commit checks
at phase boundaries and in its waits (:func:`current` finds it on the job's thread), and
that decides once between the commit and a cancel. A cancelled job is not waited for by
``wait`` or ``close`` (it never commits; the next job still runs after it) and its error is
dropped: it was asked for.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ..errors import BackgroundSaveError, SaveCancelledError
from . import multihost

log = logging.getLogger("jaxckpt")
_live: weakref.WeakSet[Writer] = weakref.WeakSet()
_COMMIT = 1 << 30  # what a commit adds to a job's decision counter; a cancel adds 1
_here = threading.local()  # the Cancel of the job this thread runs


class Cancel:
    """Whether one save job is cancelled, decided once: cancelled, or committing.

    ``cancel`` (any thread) and ``claim`` (the job, right before its commit point: the
    rename and the ``COMMITTED`` marker) race under a lock; the first wins and the other
    learns it. In a multi-process save (after ``bind``) the decision is a counter in the
    coordination service that every process's ``cancel`` adds 1 to and process 0's
    ``claim`` adds ``_COMMIT`` to: the claim wins iff it reads exactly ``_COMMIT``. Waits
    call ``poll``, which also reads the counter, so a process stops waiting for a peer that
    cancelled, and its own ``cancel`` is not needed for that.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.asked = False  # this process's cancel() won: the job's error is not reported
        self.follows_cancel = False  # the writer's job before this one was cancelled
        self._state = "open"  # "cancelled" | "committing"
        self._key: str | None = None
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._state == "cancelled"

    def bind(self, key: str) -> None:
        """From now on decide through the counter ``key`` (the same on every process of
        the save, before any of them can claim); a cancel asked earlier is published."""
        with self._lock:
            self._key = key
            if self._state == "cancelled":
                multihost.count(key, 1)

    def cancel(self) -> bool:
        """Cancels the job unless its commit won (False: it commits)."""
        with self._lock:
            if self._state == "open" and self._key is not None:
                won = multihost.count(self._key, 1) < _COMMIT
                self._state = "cancelled" if won else "committing"
            elif self._state == "open":
                self._state = "cancelled"
            self.asked = self._state == "cancelled"
            return self.asked

    def check(self) -> None:
        """Raises SaveCancelledError if this job is cancelled (no key-value call)."""
        if self._state == "cancelled":
            who = "" if self.asked else " by another process of the job"
            raise SaveCancelledError(f"{self.what} was cancelled{who} (cancel())")

    def poll(self) -> None:
        """``check``, and whether a peer cancelled: for waits on other processes."""
        if self._state == "open" and self._key is not None:
            with self._lock:
                value = multihost.count(self._key)
                if self._state == "open" and value:
                    self._state = "cancelled" if value < _COMMIT else "committing"
        self.check()

    def claim(self) -> None:
        """The commit point: raises SaveCancelledError if a cancel won, else no cancel
        can win any more."""
        with self._lock:
            if self._state == "open" and self._key is not None:
                won = multihost.count(self._key, _COMMIT) == _COMMIT
                self._state = "committing" if won else "cancelled"
            elif self._state == "open":
                self._state = "committing"
        self.check()

    def waits_check(self) -> Callable[[], None] | None:
        """What a wait on other processes calls between its slices (``poll``), so that a
        cancel stops it; None: the wait need not be interruptible."""
        return self.poll


class NeverCancelled(Cancel):
    """The :class:`Cancel` of a save no one can cancel (``jaxckpt.save`` outside a
    manager's writer): every check passes, nothing is bound or claimed, and its waits on
    other processes stay the coordination service's own (uninterruptible) barriers."""

    def __init__(self) -> None:
        super().__init__("a save outside a manager")

    def bind(self, key: str) -> None:
        pass

    def cancel(self) -> bool:
        return False

    def check(self) -> None:
        pass

    def poll(self) -> None:
        pass

    def claim(self) -> None:
        pass

    def waits_check(self) -> Callable[[], None] | None:
        return None


NEVER = NeverCancelled()  # it holds no state: one serves every save


def current() -> Cancel | None:
    """The Cancel of the writer's job running on this thread (None outside a job:
    ``jaxckpt.save`` cannot be cancelled)."""
    return getattr(_here, "job", None)


class Writer:
    """Runs ``fn(*args)`` jobs on a daemon thread named ``name``, at most one at a time."""

    def __init__(self, name: str, timeout_s: float):
        self.name, self.timeout_s = name, timeout_s
        self._error: BaseException | None = None
        self._jobs: list[Cancel] = []  # submitted and not finished, oldest first
        self._last_cancelled = False
        self._running: Cancel | None = None
        self._changed = threading.Condition()  # a job finished
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        # background jobs: how many started and ended, and how long the last ones ran
        self._started = self._ended = 0
        self.submitted = 0  # background jobs handed over so far: the last one's number
        # (job number, seconds) of the last background jobs that ended without an error
        self.job_seconds: deque[tuple[int, float]] = deque(maxlen=64)
        _live.add(self)

    def activity(self) -> tuple[int, bool]:
        """(background jobs started + ended, whether one runs now): a stretch of time in
        which no background job ran is one that begins with ``False`` and ends with the
        same count."""
        started, ended = self._started, self._ended
        return started + ended, started != ended

    def ended(self) -> int:
        """How many background jobs ended (their numbers are 1 to this: one at a time)."""
        return self._ended

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` in the background; ``what`` names the job in its error."""
        job = self._add(what)
        self.submitted += 1
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((job, fn, args))

    def run_now(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Runs the job in this thread, with the same error handling, and raises its error.
        A cancelled job still running is waited for first (it may write the same files)."""
        self._wait_for(lambda: not self._jobs, 2 * self.timeout_s)
        self._run(self._add(what), fn, args)
        self.raise_error()

    def _add(self, what: str) -> Cancel:
        job = Cancel(what)
        with self._changed:
            job.follows_cancel = self._last_cancelled or any(j.cancelled for j in self._jobs)
            self._jobs.append(job)
        return job

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._started += 1
            since = time.perf_counter()
            if self._run(*item):
                self.job_seconds.append((self._started, time.perf_counter() - since))
            self._ended += 1
            item = None  # drop the job's data (host copies) before going idle

    def _run(self, job: Cancel, fn: Callable[..., Any], args: tuple) -> bool:
        """Runs the job; True if it ended without an error."""
        _here.job = self._running = job
        try:
            fn(*args)
            return True
        except BaseException as e:  # kept and re-raised in the caller's thread
            if job.asked:  # cancelled here: whatever it raised on its way out is expected
                log.info("jaxckpt: %s cancelled (%s)", job.what, e)
            else:
                self._error = BackgroundSaveError(f"{job.what} failed: {e}")
                self._error.__cause__ = e
            return False
        finally:
            _here.job = self._running = None
            with self._changed:
                self._last_cancelled = job.cancelled
                self._jobs.remove(job)
                self._changed.notify_all()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _wait_for(self, done: Callable[[], bool], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(done, timeout_s)

    def _wait_idle(self) -> bool:
        """Waits for the jobs in flight that were not cancelled. Their own waits (barriers,
        key-value rounds) are bounded by the same ``timeout_s`` but started after ours, and
        their errors say more (which process never arrived): so give them a second
        ``timeout_s`` to fail on their own."""
        return self._wait_for(lambda: all(j.cancelled for j in self._jobs), 2 * self.timeout_s)

    def idle_within(self, timeout_s: float) -> bool:
        """Whether the jobs in flight (not cancelled) end within ``timeout_s``."""
        return self._wait_for(lambda: all(j.cancelled for j in self._jobs), timeout_s)

    def cancel(self, timeout_s: float) -> bool:
        """Cancels the jobs in flight and waits up to ``timeout_s`` for the running one to
        stop; True if one was cancelled (it never commits, even if it still runs after this
        returns: TensorStore's writes in flight are not interrupted), False if there was
        none or its commit won (it commits). A job a peer cancelled, ended or not, counts;
        one this process cancelled before does not (nor is it waited for again)."""
        with self._changed:
            jobs = [job for job in self._jobs if not job.asked]  # not cancelled here before
        cancelled = [job for job in jobs if job.cancel()]
        # the one running (a commit that won, too); queued ones stop as they start
        self._wait_for(lambda: self._running not in jobs, timeout_s)
        if isinstance(self._error, BackgroundSaveError) and isinstance(
            self._error.__cause__, SaveCancelledError
        ):  # a peer cancelled the last job before this process asked
            self._error = None
            return True
        return bool(cancelled)

    def wait(self, where: str) -> None:
        """Blocks until the job in flight is done; raises its error, or one on timeout."""
        if not self._wait_idle():
            raise BackgroundSaveError(
                f"{where}: the background save did not finish within 2 x {self.timeout_s:g}s "
                "(Options.timeout_s); it may hang on storage. Check the storage, or raise "
                "timeout_s"
            )
        self.raise_error()

    def close(self, where: str) -> None:
        """Waits for the job in flight, stops the thread, raises a pending error. A
        cancelled job still running is left to end on its daemon thread."""
        try:
            if not self._wait_idle() and self._error is None:
                self._error = BackgroundSaveError(
                    f"{where}: close() gave up after 2 x {self.timeout_s:g}s (Options.timeout_s) "
                    "with a save still writing; that step may not be committed. Raise "
                    "timeout_s or check the storage"
                )
        finally:
            if self._thread is not None:
                self._queue.put(None)
                if not any(job.cancelled for job in self._jobs):
                    self._thread.join(self.timeout_s)
                self._thread = None
            _live.discard(self)
        self.raise_error()


@atexit.register
def _close_all() -> None:
    """At interpreter exit, finish the saves in flight: no half-visible step, no thread."""
    for writer in list(_live):
        try:
            writer.close(writer.name)
        except Exception as e:  # nobody is left to raise it to
            log.error("jaxckpt: %s", e)
