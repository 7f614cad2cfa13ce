"""Chunks of a local checkpoint as the memory of the CPU arrays restored from them.

A restore that reads a chunk into fresh memory pays for that memory twice: the kernel
zeroes each fresh page as it is first touched, then the read copies the chunk over it from
the page cache: most of a warm restore (docs/MEASURED.md). Where a slice is one whole chunk,
stored raw and ``layout.ADOPT_ALIGN``-aligned in its data file, or whole chunks back to back
on page boundaries (``ocdbt_write`` aligns those of ``layout.SMALL_CHUNK_BYTES`` or more),
on a local filesystem, the restore maps those stretches of the files instead (several
chunks: each at its place in one reservation; ``MAP_PRIVATE``: copy on write), faults it in with
``MADV_POPULATE_READ`` (an I/O error comes back as an error, not as a SIGBUS), checks its
CRC32C over the mapping, and CPU devices adopt the mapping as the array's memory: the page
cache's pages themselves, nothing zeroed, nothing copied. Each
replica of a slice is a mapping of its own: a donation that writes one copy writes private
pages, never the file and never the other copies. A mapping is unmapped when the last
array using it is gone.

What it means for the caller (as with safetensors' loads into torch, which map too):
- the arrays' pages belong to the page cache: under memory pressure the kernel may drop
  them and read them again from the file later (bytes not checked again), instead of
  swapping; a replica's pages come in as it is first touched;
- a mapping keeps its whole data file: a step deleted while arrays restored from it live
  (retention) keeps those files' blocks on the disk (their memory, on tmpfs) until the
  last such array is gone;
- jaxckpt never writes a committed step's files; anything that rewrote one in place would
  change such arrays, and a file truncated, or a page the disk can no longer read, stops
  the process with SIGBUS when a dropped page is touched again (during the restore such
  errors raise ``StorageError``).
``JAXCKPT_MAP=0`` turns it off (then every chunk is read into fresh memory). Both a
restore and the emergency tier's reads of its local copies map (``choose``). (The chunks a
slice needs only a part of are read, not mapped: ``scatter`` copies each piece out of the
cache, which cost less than faulting in mappings of them, docs/MEASURED.md.)
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from . import linux
from .chunk_plan import SliceRead
from .layout import ADOPT_ALIGN, SMALL_CHUNK_BYTES

K = TypeVar("K", bound=Hashable)


def enabled(path: str) -> bool:
    """Whether a restore from ``path`` may map its chunks: the switch is not 0, the kernel
    populates mappings without SIGBUS, and ``path`` is on a local filesystem."""
    if not linux.switched_on(linux.MAP) or not _kernel():
        return False
    return linux.filesystem(path) in linux.MAP_FILESYSTEMS


def suitable(sr: SliceRead) -> bool:
    """Whether slice ``sr`` can be mappings of its file, of ``SMALL_CHUNK_BYTES`` or more: one
    whole chunk starting on an ``ADOPT_ALIGN`` boundary, or whole chunks back to back in the
    slice, each starting on a page boundary and each but the last a whole number of pages
    (each mapped at its place, ``chunks``); all out of line."""
    size = math.prod(sr.shape) * sr.dtype.itemsize
    if sr.parts or not sr.chunks or size < SMALL_CHUNK_BYTES:
        return False
    chunks = sorted(sr.chunks, key=lambda c: c.offset)
    align = ADOPT_ALIGN if len(chunks) == 1 else mmap.PAGESIZE
    at = 0
    for i, c in enumerate(chunks):
        if c.offset != at or c.at.inline or c.at.start % align:
            return False
        if i < len(chunks) - 1 and c.nbytes % mmap.PAGESIZE:
            return False
        at += c.nbytes
    return at == size


def choose(
    path: str,
    wanted: Iterable[tuple[K, SliceRead, int]],
    usable: Callable[[K, SliceRead], bool] | None = None,
) -> set[K]:
    """The keys of ``wanted`` (key, slice, its replicas: copies mapped besides the first)
    whose slices become mappings of the files under ``path``: where mapping is ``enabled``,
    each ``suitable`` slice that the caller finds ``usable`` too (asked only of suitable
    ones) in turn, while the process has ``room`` for its mappings (one per chunk and
    copy)."""
    if not enabled(path):
        return set()
    fits = [
        (k, (1 + n) * len(sr.chunks))
        for k, sr, n in wanted
        if suitable(sr) and (usable is None or usable(k, sr))
    ]
    left = room() if fits else 0
    out: set[K] = set()
    for k, n in fits:
        if n <= left:
            out.add(k)
            left -= n
    return out


def room() -> int:
    """How many mappings a restore may make now: half of ``vm.max_map_count`` less those
    the process has (each is a line of ``/proc/self/maps``); 0 where that can't be told."""
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            have = sum(1 for _ in f)
    except (OSError, ValueError):
        return 0
    return max(0, limit // 2 - have)


def region(fd: int, start: int, nbytes: int, populate: bool = True) -> np.ndarray:
    """Bytes ``start`` to ``start + nbytes`` of the file ``fd`` as a private, writable
    mapping (flat uint8, at ``start``'s offset from a page boundary), faulted in now where
    ``populate`` (else as it is touched: a replica of a mapping checked already). Raises
    OSError where the kernel can't map or read them (past the file's end, an I/O error)."""
    floor = start - start % mmap.PAGESIZE
    length = start + nbytes - floor
    addr = _call(linux.mmap, None, length, _RW, mmap.MAP_PRIVATE, fd, floor)
    if addr is None or addr == linux.MAP_FAILED:
        raise linux.os_error(f"mmap of bytes {start}-{start + nbytes - 1}")
    if populate and _call(linux.madvise, addr, length, linux.MADV_POPULATE_READ) != 0:
        err = linux.os_error(f"reading bytes {start}-{start + nbytes - 1}")
        _call(linux.munmap, addr, length)
        raise err
    return _owned(addr, length, start - floor, nbytes)


def chunks(parts: Sequence[tuple[int, int, int]], populate: bool = True) -> np.ndarray:
    """The chunks ``parts`` (file ``fd``, ``start``, ``nbytes``: each starting on a page
    boundary, each but the last a whole number of pages) back to back in one stretch of
    memory (flat uint8): a reservation with each chunk mapped at its place (``MAP_FIXED``,
    private), faulted in where ``populate``. Raises OSError as ``region`` does."""
    total = sum(n for _, _, n in parts)
    length = -(-total // mmap.PAGESIZE) * mmap.PAGESIZE
    base = _call(linux.mmap, None, length, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base is None or base == linux.MAP_FAILED:  # (PROT_NONE: a reservation)
        raise linux.os_error(f"reserving {length} bytes")
    try:
        at = 0
        for fd, start, nbytes in parts:
            size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            flags = mmap.MAP_PRIVATE | linux.MAP_FIXED
            got = _call(linux.mmap, base + at, size, _RW, flags, fd, start)
            if got != base + at:
                raise linux.os_error(f"mmap of bytes {start}-{start + nbytes - 1}")
            if populate and _call(linux.madvise, got, nbytes, linux.MADV_POPULATE_READ) != 0:
                raise linux.os_error(f"reading bytes {start}-{start + nbytes - 1}")
            at += size
    except BaseException:
        _call(linux.munmap, base, length)
        raise
    return _owned(base, length, 0, total)


def _owned(addr: int, length: int, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` from ``offset`` of the mapping at ``addr``, as an array that unmaps all
    ``length`` bytes of it when the last array using them is gone."""
    memory = (ctypes.c_uint8 * length).from_address(addr)
    weakref.finalize(
        memory, _call, linux.munmap, addr, length
    ).atexit = False  # (jax may hold it still)
    return np.frombuffer(memoryview(memory), np.uint8, count=nbytes, offset=offset)


def _call(fn: Callable[..., Any] | None, *args: Any) -> Any:
    """``fn(*args)``: a binding ``_kernel`` found (so never None here)."""
    assert fn is not None
    return fn(*args)


_RW = mmap.PROT_READ | mmap.PROT_WRITE


@functools.cache
def _kernel() -> bool:
    """Whether this kernel maps files and populates mappings (``MADV_POPULATE_READ``)."""
    if None in (linux.mmap, linux.munmap, linux.madvise) or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        view = ctypes.c_char.from_buffer(probe)
        ok = (
            _call(linux.madvise, ctypes.addressof(view), mmap.PAGESIZE, linux.MADV_POPULATE_READ)
            == 0
        )
        del view
        return ok
    finally:
        probe.close()
