"""Chunks that several slices need a part of (a restore onto another mesh): each read and
checked once for all of them, kept until the last has copied its part, within a byte bound;
past it each slice reads the chunk again. Thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import numpy as np

from .chunk_plan import ChunkPart

KEEP_BYTES = 256 << 20
"""At most this many bytes of chunks kept for the other slices that need a part of them
(read once, checked once); a chunk past it is read again by each."""


class Kept:
    """A chunk read in part by several slices: its checked bytes (or the error its read
    raised), the users still to copy from it, and a lock held while it is read."""

    def __init__(self, users: int, nbytes: int) -> None:
        self.left, self.nbytes = users, nbytes
        self.ready = threading.Lock()
        self.data: np.ndarray | None = None
        self.error: BaseException | None = None


class SharedChunks:
    """The chunks kept for the slices that share them, at most ``keep_bytes`` of them.

    A user of a shared chunk calls ``take`` (which reads it, or waits for the first user's
    read), copies its part, then calls ``done``; a slice whose read failed calls
    ``abandon`` for the shared chunks it will never come for. ``release`` takes a kept
    chunk's view of a file mapping once nobody needs it (buffers are reused instead)."""

    def __init__(self, keep_bytes: int, release: Callable[[np.ndarray], None]) -> None:
        self.keep_bytes = keep_bytes
        self._release = release
        self._lock = threading.Lock()
        self._kept: dict[str, Kept] = {}
        self._bytes = 0
        self._came: dict[str, int] = {}  # the slices that came for each shared chunk so far
        self._spare: list[np.ndarray] = []  # kept chunks' buffers, for the next ones

    @property
    def kept(self) -> dict[str, int]:
        """The chunks kept now: {key: users still to come}."""
        with self._lock:
            return {k: e.left for k, e in self._kept.items()}

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return self._bytes

    @property
    def spare_buffers(self) -> int:
        """Buffers of chunks let go, kept for the next ones."""
        with self._lock:
            return len(self._spare)

    def take(self, p: ChunkPart, read: Callable[[], np.ndarray]) -> tuple[np.ndarray, Kept] | None:
        """Chunk ``p`` read (``read()``) and checked once for the ``p.users`` slices that
        need it: the first to come reads it while the others wait; None where keeping it
        would pass ``keep_bytes`` (each reads it then). Every caller then calls ``done``."""
        with self._lock:
            came = self._came[p.key] = self._came.get(p.key, 0) + 1
            entry = self._kept.get(p.key)
            mine = entry is None
            if mine:
                left = p.users - came + 1  # this slice and those still to come
                if left <= 1 or self._bytes + p.nbytes > self.keep_bytes:
                    return None
                entry = self._kept[p.key] = Kept(left, p.nbytes)
                self._bytes += p.nbytes
                entry.ready.acquire()  # held until the bytes are in and checked
        assert entry is not None
        if mine:
            try:
                data = entry.data = read()
            except BaseException as e:
                entry.error = e
                self.done(p.key, entry)
                raise
            finally:
                entry.ready.release()
            return data, entry
        with entry.ready:  # the first user's read
            pass
        if entry.error is not None:
            self.done(p.key, entry)
            raise entry.error
        assert entry.data is not None
        return entry.data, entry

    def done(self, key: str, entry: Kept) -> None:
        """One user of a kept chunk less; the last one lets it go."""
        gone = None
        with self._lock:
            entry.left -= 1
            if entry.left <= 0 and self._kept.get(key) is entry:
                del self._kept[key]
                self._bytes -= entry.nbytes
                gone, entry.data = entry.data, None
                if gone is not None and gone.base is None:  # a buffer, not a mapping
                    self._spare.append(gone)
                    gone = None
        if gone is not None:
            self._release(gone)

    def abandon(self, parts: Iterable[ChunkPart]) -> None:
        """A slice whose read failed gives up the shared chunks it will never come for:
        counted as come and gone, so that the last of their other users lets them go
        (else a kept chunk waits for it until ``clear``)."""
        for p in parts:
            if p.users < 2:
                continue
            with self._lock:
                self._came[p.key] = self._came.get(p.key, 0) + 1
                entry = self._kept.get(p.key)
            if entry is not None:
                self.done(p.key, entry)

    def being_read(self, key: str) -> bool:
        """Whether another thread is reading chunk ``key`` for the slices that share it."""
        with self._lock:
            entry = self._kept.get(key)
        if entry is None or not entry.ready.acquire(blocking=False):
            return entry is not None
        entry.ready.release()
        return False

    def spare(self, size: int) -> np.ndarray:
        """A buffer of at least ``size`` bytes for a kept chunk: one a released chunk left
        (fresh memory costs a page fault a page), else a new one."""
        with self._lock:
            for i, buf in enumerate(self._spare):
                if len(buf) >= size:
                    return self._spare.pop(i)
            if self._bytes + sum(len(b) for b in self._spare) > self.keep_bytes:
                self._spare.clear()  # (none fits: let the small ones go)
        return np.empty(size, np.uint8)

    def clear(self) -> None:
        with self._lock:
            self._kept.clear()
            self._came.clear()
            self._spare.clear()
            self._bytes = 0
