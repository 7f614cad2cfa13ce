"""Chunks of a local checkpoint as the memory of the CPU arrays restored from them.

A restore that reads a chunk into fresh memory pays for that memory twice: the kernel
zeroes each fresh page as it is first touched, then the read copies the chunk over it from
the page cache. Here that was most of a warm restore: 1 GB of 6 MB chunks in the page cache,
two threads, each chunk read and checked: 2.3 GB/s into fresh memory, 10 GB/s into memory
used before. Where a slice is one whole chunk, stored raw and 64-byte aligned in
its data file, or whole chunks back to back on page boundaries (``ocdbt_write`` aligns those
of 256 KiB or more), on a local filesystem, the restore maps those stretches of the files
instead (several chunks: each at its place in one reservation) (``MAP_PRIVATE``: copy on write), faults it in with
``MADV_POPULATE_READ`` (an I/O error comes back as an error, not as a SIGBUS), checks its
CRC32C over the mapping, and CPU devices adopt the mapping as the array's memory: the page
cache's pages themselves, nothing zeroed, nothing copied (17-20 GB/s in that probe). Each
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
restore and the emergency tier's reads of its local copies map (``choose``). Where the
files may be mapped (``enabled``), the direct reader also checks and copies the chunks a
slice needs only a part of from a mapping of their file (``region``, ``fault_in``,
``let_go``), not from a copy of them.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from . import arrays, page_cache
from .chunk_plan import SliceRead

ENV = "JAXCKPT_MAP"
MIN_BYTES = 256 << 10
"""Slices smaller than this are read: the direct reader reads runs of small ones in one
``preadv``, and each mapping is one more of the process's ``vm.max_map_count``."""
ALIGN = 64  # XLA's CPU client adopts a buffer as it is only from such an address
FILESYSTEMS = frozenset({"ext4", "xfs", "btrfs", "tmpfs"})
"""Local ones: their pages can't go stale under another host's writes (NFS, Lustre, FUSE:
read instead)."""
_MADV_POPULATE_READ = 22  # Linux 5.14+
_MADV_DONTNEED = 4
K = TypeVar("K", bound=Hashable)


def enabled(path: str) -> bool:
    """Whether a restore from ``path`` may map its chunks: the switch is not 0, the kernel
    populates mappings without SIGBUS, and ``path`` is on a local filesystem."""
    if os.environ.get(ENV, "1").strip() == "0" or not _kernel():
        return False
    return page_cache.filesystem(path) in FILESYSTEMS


def suitable(sr: SliceRead) -> bool:
    """Whether slice ``sr`` can be mappings of its file, of ``MIN_BYTES`` or more: one
    whole chunk starting on an ``ALIGN`` boundary, or whole chunks back to back in the
    slice, each starting on a page boundary and each but the last a whole number of pages
    (each mapped at its place, ``chunks``); all out of line."""
    size = math.prod(sr.shape) * sr.dtype.itemsize
    if sr.parts or not sr.chunks or size < MIN_BYTES:
        return False
    chunks = sorted(sr.chunks, key=lambda c: c.offset)
    align = ALIGN if len(chunks) == 1 else mmap.PAGESIZE
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
    addr = _mmap(None, length, _RW, mmap.MAP_PRIVATE, fd, floor)
    if addr is None or addr == _MAP_FAILED:
        raise _os_error(f"mmap of bytes {start}-{start + nbytes - 1}")
    if populate and _madvise(addr, length, _MADV_POPULATE_READ) != 0:
        err = _os_error(f"reading bytes {start}-{start + nbytes - 1}")
        _munmap(addr, length)
        raise err
    return _owned(addr, length, start - floor, nbytes)


def fault_in(view: np.ndarray) -> None:
    """The pages of ``view`` (part of a ``region``) faulted in now (``MADV_POPULATE_READ``);
    raises OSError where the kernel can't read them (an I/O error, past the file's end)."""
    addr = view.ctypes.data
    floor = addr - addr % mmap.PAGESIZE
    if _madvise(floor, addr + view.nbytes - floor, _MADV_POPULATE_READ) != 0:
        raise _os_error(f"reading {view.nbytes} bytes")


def let_go(views: Sequence[np.ndarray]) -> None:
    """The pages of ``views`` (parts of ``region``s never written) unmapped from this
    process (``MADV_DONTNEED``; still in the page cache, faulted in again if touched), one
    call for each stretch of adjacent or overlapping ones: bytes already used stop counting
    in its RSS. A hint: errors are ignored."""
    spans = sorted((v.ctypes.data, v.ctypes.data + v.nbytes) for v in views)
    merged: list[list[int]] = []
    for a, b in spans:
        a -= a % mmap.PAGESIZE
        if merged and a <= merged[-1][1] + mmap.PAGESIZE:  # (a page of zeros between)
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    for a, b in merged:
        _madvise(a, b - a, _MADV_DONTNEED)


def chunks(parts: Sequence[tuple[int, int, int]], populate: bool = True) -> np.ndarray:
    """The chunks ``parts`` (file ``fd``, ``start``, ``nbytes``: each starting on a page
    boundary, each but the last a whole number of pages) back to back in one stretch of
    memory (flat uint8): a reservation with each chunk mapped at its place (``MAP_FIXED``,
    private), faulted in where ``populate``. Raises OSError as ``region`` does."""
    total = sum(n for _, _, n in parts)
    length = -(-total // mmap.PAGESIZE) * mmap.PAGESIZE
    base = _mmap(None, length, 0, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # PROT_NONE
    if base is None or base == _MAP_FAILED:
        raise _os_error(f"reserving {length} bytes")
    try:
        at = 0
        for fd, start, nbytes in parts:
            size = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
            got = _mmap(base + at, size, _RW, mmap.MAP_PRIVATE | _MAP_FIXED, fd, start)
            if got != base + at:
                raise _os_error(f"mmap of bytes {start}-{start + nbytes - 1}")
            if populate and _madvise(got, nbytes, _MADV_POPULATE_READ) != 0:
                raise _os_error(f"reading bytes {start}-{start + nbytes - 1}")
            at += size
    except BaseException:
        _munmap(base, length)
        raise
    return _owned(base, length, 0, total)


def _owned(addr: int, length: int, offset: int, nbytes: int) -> np.ndarray:
    """``nbytes`` from ``offset`` of the mapping at ``addr``, as an array that unmaps all
    ``length`` bytes of it when the last array using them is gone."""
    memory = (ctypes.c_uint8 * length).from_address(addr)
    weakref.finalize(memory, _munmap, addr, length).atexit = False  # (jax may hold it still)
    return np.frombuffer(memoryview(memory), np.uint8, count=nbytes, offset=offset)


def _libc(name: str, restype: type, *argtypes: type) -> Any:
    fn: Any = arrays.libc(name, *argtypes)
    if fn is not None:
        fn.restype = restype
    return fn


_mmap = _libc(
    "mmap",
    ctypes.c_void_p,
    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
)  # fmt: skip
_munmap = _libc("munmap", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
_madvise = _libc("madvise", ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MAP_FAILED = ctypes.c_void_p(-1).value
_MAP_FIXED = 0x10  # Linux, every architecture
_RW = mmap.PROT_READ | mmap.PROT_WRITE


def _os_error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


@functools.cache
def _kernel() -> bool:
    """Whether this kernel maps files and populates mappings (``MADV_POPULATE_READ``)."""
    if None in (_mmap, _munmap, _madvise) or not hasattr(mmap, "MAP_PRIVATE"):
        return False
    probe = mmap.mmap(-1, mmap.PAGESIZE)
    try:
        view = ctypes.c_char.from_buffer(probe)
        ok = _madvise(ctypes.addressof(view), mmap.PAGESIZE, _MADV_POPULATE_READ) == 0
        del view
        return ok
    finally:
        probe.close()
