"""The data files one reader reads: each opened once, prefetch advice given once for each
MiB block. ``close`` lets all of it go."""

from __future__ import annotations

import contextlib
import os
import threading

from ...errors import StorageError
from . import arrays, residency


class Files:
    """The files of one reader; thread-safe."""

    def __init__(self, prefetch: bool = True) -> None:
        """``prefetch``: give the kernel read-ahead advice (``prefetch``); a restore that
        found its files in the page cache (``residency.from_disk``) saves the probes."""
        self.prefetching = prefetch
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self._advised: dict[str, set[int]] = {}  # each file's MiB blocks prefetched
        self._sizes: dict[str, int] = {}  # of the files prefetched from

    def fd(self, path: str) -> int:
        """The open descriptor of ``path`` (opened on first use; StorageError naming it)."""
        with self._lock:
            if path not in self._fds:
                try:
                    self._fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as e:
                    raise StorageError(f"opening the data file {path} failed: {e}") from e
            return self._fds[path]

    def prefetch(self, where: list[arrays.ChunkBytes]) -> None:
        """Asks the kernel to start reading the chunks at ``where`` (``POSIX_FADV_WILLNEED``)
        as their read is issued: the reads in flight (the read budget's worth) then keep
        the disk busy while threads copy and check earlier ones. Advice goes by whole MiB
        blocks of a file, each block once (``residency.new_blocks``), and not where the
        stretch's last byte (or its file's) is in the page cache already (a 1-byte
        ``RWF_NOWAIT`` read, ``residency.cached``): on cached files the advice only walks
        the cache. (Its last byte: the kernel's own readahead, started by earlier reads and
        by such probes, may have brought in the first ones.) A hint only: errors are the
        read's. Figures: docs/MEASURED.md."""
        if not self.prefetching or not hasattr(os, "posix_fadvise"):
            return
        with self._lock:
            stretches = residency.new_blocks(where, self._advised)
        for f, a, b in stretches:
            with contextlib.suppress(OSError, StorageError):  # the read raises, naming it
                fd = self.fd(f)
                if f not in self._sizes:
                    self._sizes[f] = os.fstat(fd).st_size
                if not residency.cached(fd, min(b, self._sizes[f]) - 1):
                    os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
            self._advised.clear()
            self._sizes.clear()
        for fd in fds.values():
            os.close(fd)
