"""Keeping a save's files out of the page cache: O_DIRECT where it may (``direct_io``), or
``drop_page_cache=True``.

A save writes gigabytes its host will not read again soon; through the page cache they
evict what training does read (the dataset's files) and, where fresh memory is slow to
hand out (a VM's balloon), they slow the save itself. Where jaxckpt writes the files itself
(``ocdbt_write``) it opens them O_DIRECT, by default on a disk filesystem (``direct_io``).
TensorStore writes through the cache: with ``drop_page_cache`` (or ``direct_io=True``),
while it writes a local directory, a thread asks the kernel every couple of milliseconds to
drop the pages of every file under it: ``posix_fadvise(DONTNEED)`` starts the write-back of
dirty pages and drops the clean ones, so the cache holds only what was written since the
last pass and what the disk has not taken yet (measured by ``bench/compare.py
--drop-page-cache-gb 2``). Nothing is lost: the save still fsyncs before it commits; a
later read of the step comes from the disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator

from . import linux

log = logging.getLogger("jaxckpt")

PERIOD_S = 0.002
"""Between two passes over the directory's files."""


class _Dropper:
    """The thread that drops the pages of the files under ``root`` until stopped."""

    def __init__(self, root: str, period_s: float) -> None:
        self.root, self.period_s = root, period_s
        self._fds: dict[tuple[int, int], int] = {}  # by (device, inode): files get renamed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxckpt-drop-cache", daemon=True)

    def drop_once(self) -> None:
        seen: set[tuple[int, int]] = set()
        for directory, _, files in os.walk(self.root):
            for name in files:
                try:  # a file renamed over or removed since listed: nothing to drop
                    st = os.stat(os.path.join(directory, name))
                    key = (st.st_dev, st.st_ino)
                    if key not in self._fds:
                        self._fds[key] = os.open(os.path.join(directory, name), os.O_RDONLY)
                except OSError:
                    continue
                seen.add(key)
                os.posix_fadvise(self._fds[key], 0, 0, os.POSIX_FADV_DONTNEED)
        for key in set(self._fds) - seen:  # gone (renamed over, deleted): let it go
            os.close(self._fds.pop(key))

    def _loop(self) -> None:
        try:
            while not self._stop.wait(self.period_s):
                self.drop_once()
        except OSError as e:  # never fails the save: the pages just stay cached
            log.warning("jaxckpt: stopped dropping the page cache of %s: %s", self.root, e)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        try:
            self.drop_once()
        except OSError as e:
            log.warning("jaxckpt: could not drop the page cache of %s: %s", self.root, e)
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@contextlib.contextmanager
def dropping(root: str, enabled: bool = True, period_s: float = PERIOD_S) -> Iterator[None]:
    """While the block writes files under the local directory ``root``, keeps their pages
    out of the page cache (see the module's docstring); a no-op unless ``enabled`` and the
    OS has ``posix_fadvise`` (Linux). For example
    ``with dropping(db.url, opts.drop_page_cache): arrays.write(db, writes)``.
    """
    if not enabled or not hasattr(os, "posix_fadvise"):
        yield
        return
    dropper = _Dropper(root, period_s)
    dropper.start()
    try:
        yield
    finally:
        dropper.stop()


def direct_io(path: str, asked: bool | None) -> bool:
    """Whether a save writes its local files under ``path`` with O_DIRECT: as ``asked``, or,
    None, where ``path`` lies on one of ``linux.DIRECT_IO_FILESYSTEMS``."""
    if asked is not None:
        return asked
    return linux.filesystem(path) in linux.DIRECT_IO_FILESYSTEMS
