"""Preemption notices: a signal handler that records the notice, and the step at which every
process of the job saves and stops.

Every cloud, SLURM and Kubernetes announce a preemption with SIGTERM and kill the job some
seconds later (about 30 on GKE, 120 on AWS spot). A manager's ``reached_preemption(step)``
installs :class:`Watch` on its first call (so a job that never asks keeps the default
SIGTERM, which ends it), chaining any Python handler the user or a framework installed, and
puts the previous handler back on ``close``.

With one process the notice is the answer: ``reached(step)`` is True from the first step
after the signal. With several, the process that got the signal announces it through the
``jax.distributed`` key-value store (the managers use it anyway; JAX's own preemption service
is not needed and may be off); a watcher thread in every process sees the announcement.
Process 0 relays a notice to every process (so a notice costs O(processes) key-value calls
however many processes got the signal). Each process then publishes the step it is at,
process 0 publishes the largest (``multihost.decided``, at most ``timeout_s``), and all stop
there: every process answers True at that same step, and
no process has passed it (each published the step it was at). Without a notice a call costs
two flag reads: no key-value traffic per step.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

from . import multihost
from .storage import Location

log = logging.getLogger("jaxckpt")

# a watcher thread's wait for another process's notice: one key-value call this often per
# process (it returns as soon as its key is set: a notice, or its own close)
_POLL_S = 300.0


_made: dict[str, int] = {}  # watches made per name, in this process
_live: set[Watch] = set()  # watches with a watcher thread, not closed
_hooked = False  # whether _close_all is registered with atexit


def _close_all() -> None:
    """Stops the watcher threads of managers never closed, before jax.distributed's own
    exit hook shuts its client down: registered with the first watcher, so after that hook
    (jax.distributed is initialized by then), and run before it."""
    for watch in list(_live):
        watch.close()


def name_for(directory: Location) -> str:
    """The key-value prefix of the preemption watch of a manager of ``directory``: the same
    on every process (the shared directory), and unlike any other manager's."""
    return f"jaxckpt/preemption/{hashlib.sha256(directory.url.encode()).hexdigest()[:12]}"


class Watch:
    """Watches for a preemption notice (``signals``) and agrees on the step to stop at.

    ``name`` must be the same on every process (``multihost.unique_name``)."""

    def __init__(self, name: str, signals: Sequence[int], timeout_s: float) -> None:
        # a new name for each watch of one directory in a job (the same on every process:
        # they make the same calls), so none sees an earlier watch's keys
        _made[name] = n = _made.get(name, 0) + 1
        name = f"{name}/{n}"
        self.name, self.signals, self.timeout_s = name, tuple(signals), timeout_s
        self.noticed: int | None = None  # the signal this process got
        self._remote = threading.Event()  # another process announced one
        self._announced = False
        self._waking, self._woken = threading.Lock(), False  # process 0: woke everyone
        self._stop_at: int | None = None
        self._previous: dict[int, Any] = {}
        self._closed = threading.Event()
        self._watcher: threading.Thread | None = None
        self._install()
        if multihost.process_count() > 1:
            self._watcher = threading.Thread(
                target=self._watch, name="jaxckpt-preemption", daemon=True
            )
            global _hooked
            if not _hooked:
                atexit.register(_close_all)
                _hooked = True
            self._watcher.start()
            _live.add(self)

    # --- the notice ----------------------------------------------------------------------

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "jaxckpt: reached_preemption() first called off the main thread: no handler "
                "for %s installed (Python allows them on the main thread only); only other "
                "processes' notices are seen",
                self._names(),
            )
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)

    def _names(self) -> str:
        return ", ".join(signal.Signals(s).name for s in self.signals)

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.noticed is None:
            self.noticed = signum
        previous = self._previous.get(signum)
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)  # chained: the user's or a framework's own handler

    def notify(self, signum: int = signal.SIGTERM) -> None:
        """Records a notice as the handler would (a scheduler's API, tests)."""
        if self.noticed is None:
            self.noticed = signum

    def _wake_key(self, process: int) -> str:
        """The key process ``process``'s watcher waits on: ``notice`` or ``closed``."""
        return f"{self.name}/wake/{process}"

    def _watch(self) -> None:
        client = multihost.client()
        key = self._wake_key(multihost.process_index())
        while not self._closed.is_set():
            try:
                why = client.blocking_key_value_get(key, int(_POLL_S * 1000))
            except Exception:  # DEADLINE_EXCEEDED: no notice yet (or the service went away)
                continue
            if why == "notice":
                if multihost.process_index() == 0:
                    self._wake_everyone(client)
                self._remote.set()
            return

    def _announce(self, client: Any) -> None:
        """Tells every process of this process's notice: process 0 wakes every watcher;
        another process wakes process 0's, which does (one key-value call each, however
        many processes got the signal: O(processes) in all)."""
        if multihost.process_index() == 0:
            self._wake_everyone(client)
        else:
            client.key_value_set(self._wake_key(0), "notice", True)

    def _wake_everyone(self, client: Any) -> None:
        with self._waking:
            if self._woken:
                return
            self._woken = True
        for p in range(1, multihost.process_count()):
            client.key_value_set(self._wake_key(p), "notice", True)

    @property
    def stopping(self) -> bool:
        """Whether the step to stop at is known (``reached`` answered after a notice)."""
        return self._stop_at is not None

    # --- the step ------------------------------------------------------------------------

    def reached(self, step: int) -> bool:
        """True at the step every process stops at (see the module); False before it."""
        if self._stop_at is not None:
            return step >= self._stop_at
        if self.noticed is None and not self._remote.is_set():
            return False
        if multihost.process_count() == 1:
            self._stop_at = step
            log.warning("jaxckpt: preemption notice (%s): stopping at step %d", self._names(), step)
            return True
        if self.noticed is not None and not self._announced:
            self._announce(multihost.client())
            self._announced = True
        # every process publishes the step it is at; all stop at the largest
        self._stop_at = int(
            multihost.decided(
                f"{self.name}/at",
                str(step),
                lambda steps: str(max(int(s) for s in steps)),
                self.timeout_s,
                what="preemption notice: the step every process stops at",
            )
        )
        log.warning(
            "jaxckpt: preemption notice (%s): every process stops at step %d",
            signal.Signals(self.noticed).name if self.noticed else "from another process",
            self._stop_at,
        )
        return step >= self._stop_at

    # --- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Puts the previous handlers back (where they are still ours) and stops watching."""
        if self._closed.is_set():
            return
        self._closed.set()
        _live.discard(self)
        if self._watcher is not None and self._watcher.is_alive():
            # its key-value wait must end before jax.distributed shuts down (else an abort)
            try:
                multihost.client().key_value_set(
                    self._wake_key(multihost.process_index()), "closed", True
                )
                self._watcher.join(timeout=5.0)
            except Exception as e:  # the service is gone: so is the wait
                log.info("jaxckpt: stopping the preemption watcher: %s", e)
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._previous.items():
                if signal.getsignal(sig) == self._handler:
                    # None: a handler installed outside Python (JAX's C++ notifier), which
                    # cannot be put back; the default at least ends the process again
                    signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
