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
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

READ_BUDGET_BYTES = 128 << 20  # host memory for slices read but not yet used (the least)
BUDGET_PER_THREAD = 64 << 20


def default_budget(threads: int) -> int:
    """A restore's read budget when none is given: 64 MiB for each thread reading, at least
    ``READ_BUDGET_BYTES`` (2 threads, hosts of up to 5 cores). More threads need more reads
    in flight to stay busy (docs/MEASURED.md)."""
    return max(READ_BUDGET_BYTES, threads * BUDGET_PER_THREAD)


H = TypeVar("H")  # what starting a read returns: a future, a handle


class InFlight(Generic[H]):
    """At most ``budget`` bytes read but not yet used (a single read larger than the budget
    still runs, alone). ``threads``: use reads on that many worker threads (0: the caller's)."""

    def __init__(self, budget: int = READ_BUDGET_BYTES, *, threads: int = 0) -> None:
        self.budget = budget
        self.total = 0  # bytes of every read started, for the figures
        self._held = 0
        self._started: collections.deque[tuple[int, H, Callable[[H], None]]] = collections.deque()
        self._using: collections.deque[tuple[Future[None], int]] = collections.deque()
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="jaxckpt-read") if threads else None
        )

    def add(self, nbytes: int, start: Callable[[], H], use: Callable[[H], None]) -> None:
        """Starts a read of ``nbytes`` (``start()``, once it fits) and queues ``use`` of
        what it returned: on the worker threads at once (a use waits there for its read),
        else on this thread when the budget or ``drain`` needs it. Errors of ``start``
        raise here; those of ``use`` here or in ``drain``, in order."""
        while self._held + nbytes > self.budget and (self._started or self._using):
            self._advance()
        handle = start()
        if self._pool is None:
            self._started.append((nbytes, handle, use))
        else:  # (handing uses over one at a time cost a round trip of threads per read)
            self._using.append((self._pool.submit(use, handle), nbytes))
        self._held += nbytes
        self.total += nbytes

    def drain(self) -> None:
        """Uses every read started."""
        while self._started or self._using:
            self._advance()

    def close(self) -> None:
        """Stops the worker threads (after an error too: none outlives the caller)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _advance(self) -> None:
        """Uses the oldest read on this thread, or waits for the oldest use on a worker."""
        if self._started:
            nbytes, handle, use = self._started.popleft()
            use(handle)
        else:
            done, nbytes = self._using.popleft()
            done.result()
        self._held -= nbytes
