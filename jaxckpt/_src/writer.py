"""One persistent background thread that runs save jobs one at a time, for the managers.

A job's failure is kept and raised in the caller's thread at the next ``raise_error``,
``wait`` or ``close`` (never lost, never raised twice). ``close`` waits for the job in
flight, stops the thread, and reports a job it could not wait for; at interpreter exit
every live writer is closed that way.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ..errors import BackgroundSaveError

log = logging.getLogger("jaxckpt")
_live: weakref.WeakSet[Writer] = weakref.WeakSet()


class Writer:
    """Runs ``fn(*args)`` jobs on a daemon thread named ``name``, at most one at a time."""

    def __init__(self, name: str, timeout_s: float):
        self.name, self.timeout_s = name, timeout_s
        self._error: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        _live.add(self)

    def submit(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Runs ``fn(*args)`` in the background; ``what`` names the job in its error."""
        self._idle.clear()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._queue.put((what, fn, args))

    def run_now(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        """Runs the job in this thread, with the same error handling, and raises its error."""
        self._run(what, fn, args)
        self.raise_error()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self._run(*item)
            finally:
                item = None  # drop the job's data (host copies) before going idle
                self._idle.set()

    def _run(self, what: str, fn: Callable[..., Any], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as e:  # kept and re-raised in the caller's thread
            self._error = BackgroundSaveError(f"{what} failed: {e}")
            self._error.__cause__ = e

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _wait_idle(self) -> bool:
        """Waits for the job in flight. Its own waits (barriers, key-value rounds) are bounded
        by the same ``timeout_s`` but started after ours, and their errors say more (which
        process never arrived): so give it a second ``timeout_s`` to fail on its own."""
        return self._idle.wait(self.timeout_s) or self._idle.wait(self.timeout_s)

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
        """Waits for the job in flight, stops the thread, raises a pending error."""
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
