"""``paused()``: Python's cyclic garbage collector off while a restore runs, or a save the
caller waits for (``save``; a manager's blocking part, and its synchronous writes).

A restore allocates some hundred container objects per leaf (records, plans, futures, jax's
own), and every 700 allocations CPython runs a collection; the older generations' passes walk
every live object of the process (jax alone keeps ~150k). A restore or a save of thousands
of leaves runs hundreds or dozens of them, and is that much slower (docs/MEASURED.md).
Reference counting still frees everything that is not in a cycle; the collector's state is
put back afterwards. A manager's background write keeps the collector: it runs beside
training.

The collector is the process's: other threads run without it until the restore ends (cyclic
garbage they make waits until then), and a ``gc.disable()`` another thread makes meanwhile
is undone when the last restore ends.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_holders = 0  # calls inside paused(), on any thread
_was_enabled = False  # the collector's state when the first of them came in


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """The collector off until the last concurrent ``paused()`` exits, then as it was."""
    global _holders, _was_enabled
    entered = False
    try:
        with _lock:
            if _holders == 0:
                _was_enabled = gc.isenabled()
                gc.disable()
            _holders, entered = _holders + 1, True
        yield
    finally:
        if entered:
            with _lock:
                _holders -= 1
                if _holders == 0 and _was_enabled:
                    gc.enable()
