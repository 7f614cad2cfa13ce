"""What of a checkpoint's data files the page cache holds, for the direct reads
(``direct``): whether a restore will wait for the disk (``from_disk``), and which blocks
of a file to advise ``WILLNEED`` (``new_blocks``, ``cached``). Probes only: none reads a
file's bytes for the restore, and an error here is left to the read, which names it."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence

import numpy as np

from . import arrays, linux
from .chunk_plan import SliceRead

ADVICE_BYTES = 1 << 20  # prefetch advice goes by blocks of this many bytes, each once


def new_blocks(
    where: Sequence[arrays.ChunkBytes], seen: dict[str, set[int]], block: int = ADVICE_BYTES
) -> list[tuple[str, int, int]]:
    """The stretches of whole ``block``s (file, start, stop) that hold bytes of ``where``
    and are not in ``seen`` yet (which now holds them), runs of consecutive blocks merged."""
    out: list[tuple[str, int, int]] = []
    for at in sorted(where, key=lambda at: (at.file, at.start)):
        done = seen.setdefault(at.file, set())
        for k in range(at.start // block, (at.stop - 1) // block + 1):
            if k in done:
                continue
            done.add(k)
            if out and out[-1][0] == at.file and out[-1][2] == k * block:
                out[-1] = (at.file, out[-1][1], (k + 1) * block)
            else:
                out.append((at.file, k * block, (k + 1) * block))
    return out


SAMPLES = 8  # slices whose first chunk ``from_disk`` probes


def from_disk(plans: Sequence[SliceRead]) -> bool | None:
    """Whether the reads of ``plans`` (in the order they are issued) will wait for the disk:
    the first and last bytes of the first chunk of up to ``SAMPLES`` slices spread over
    them, the first and the last included, are not all in the page cache (``_resident``: it
    starts no readahead, which would hide from the reader's prefetch the stretches around
    the probed bytes); None where some can't be told and none was found missing."""
    if not plans:
        return False
    picked = [*plans[:: max(1, len(plans) // SAMPLES)], plans[-1]]
    probes = {(at.file, at.start) for sr in picked for at in _first(sr)}
    probes |= {(at.file, at.stop - 1) for sr in picked for at in _first(sr)}
    found = [_resident(file, offset) for file, offset in sorted(probes)]
    return True if False in found else None if None in found else False


def _resident(path: str, offset: int) -> bool | None:
    """Whether the page of file ``path`` holding byte ``offset`` is in the page cache
    (``mincore`` over a one-page mapping of it; no read); None where that can't be told."""
    fn = linux.mincore
    if fn is None:
        return None
    page = offset - offset % mmap.PAGESIZE
    try:
        with open(path, "rb") as f:
            size = min(mmap.PAGESIZE, os.fstat(f.fileno()).st_size - page)  # (a file's last)
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ, offset=page) as m:
                view = np.frombuffer(m, np.uint8)
                vec = bytearray(1)
                ok = fn(view.ctypes.data, size, (ctypes.c_char * 1).from_buffer(vec)) == 0
                del view  # (before the mapping closes)
    except (OSError, ValueError):  # the read raises, naming it; a page past the end
        return None
    return bool(vec[0] & 1) if ok else None


def _first(sr: SliceRead) -> list[arrays.ChunkBytes]:
    return [c.at for c in sr.chunks[:1]] + [p.at for p in sr.parts[:1]]


def cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` is in the page cache (``_probe``); False where that
    cannot be told."""
    return _probe(fd, offset) is True


def _probe(fd: int, offset: int) -> bool | None:
    """Whether the byte at ``offset`` is in the page cache: a 1-byte read that fails rather
    than wait for the disk (``RWF_NOWAIT``; a miss starts the kernel's readahead of a few
    pages); None where that cannot be told."""
    nowait = getattr(os, "RWF_NOWAIT", None)
    if nowait is None:
        return None
    try:
        return os.preadv(fd, [bytearray(1)], offset, nowait) == 1
    except BlockingIOError:  # EAGAIN: not cached
        return False
    except OSError:  # EOPNOTSUPP: a file system that can't tell
        return None
