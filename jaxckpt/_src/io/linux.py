"""What the engine asks of the kernel beyond ``os``: every ``ctypes`` binding, the
filesystems each fast path trusts, and the ``JAXCKPT_*`` switches that turn a path off.

The calls are Linux's. Where the C library lacks one (another OS, an old libc) its binding
is None and the path that needs it is not taken: every caller checks.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
from collections.abc import Callable
from typing import Any

# --- switches: "0" turns a path off (for benchmarks and debugging) -----------------------------

DIRECT_READ = "JAXCKPT_DIRECT_READ"
"""Restores read every chunk through TensorStore (``direct.Reader`` off)."""
DIRECT_WRITE = "JAXCKPT_DIRECT_WRITE"
"""Saves write every database through TensorStore (``ocdbt_write``'s own writer off)."""
MAP = "JAXCKPT_MAP"
"""No chunk becomes the memory of a restored array (``mapped`` off)."""
RING = "JAXCKPT_RING"
"""Restores onto accelerators read into fresh host memory, not the reused ring (``ring``)."""
ADOPT = "JAXCKPT_ADOPT"
"""CPU devices adopt no host buffer: each slice is copied onto its device from where it was
read, as onto an accelerator (the path a GPU restore takes, run on CPU devices)."""


def switched_on(name: str) -> bool:
    """Whether the path that the environment variable ``name`` switches is on (not "0")."""
    return os.environ.get(name, "1").strip() != "0"


# --- filesystems -------------------------------------------------------------------------------

MAP_FILESYSTEMS = frozenset({"ext4", "xfs", "btrfs", "tmpfs"})
"""Where chunks may be mapped: local ones, whose pages can't go stale under another host's
writes (NFS, Lustre, FUSE: read instead)."""
DIRECT_IO_FILESYSTEMS = frozenset({"ext4", "xfs", "btrfs"})
"""Disk filesystems whose O_DIRECT writes a save uses by default (``direct_io=None``): the
bytes go to the disk without filling the page cache. Not tmpfs (memory: nothing to keep
out), not network or FUSE filesystems: there O_DIRECT is refused or makes each write a
round trip."""


def filesystem(path: str) -> str | None:
    """The type of the filesystem ``path`` (or, not made yet, its nearest existing parent)
    lies on, from ``/proc/self/mountinfo``; None where that can't be read (not Linux)."""
    real = os.path.realpath(path)
    while not os.path.exists(real) and os.path.dirname(real) != real:
        real = os.path.dirname(real)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return mount_type(f.read(), real)
    except OSError:
        return None


def mount_type(mountinfo: str, real: str) -> str | None:
    """The filesystem type of the mount that holds the absolute, resolved path ``real``:
    the one with the longest mount point above it (the last mounted, of equal ones), from
    the text of a ``/proc/<pid>/mountinfo`` (``proc(5)``: the mount point is the 5th field,
    the type the first after the ``-``)."""
    best: tuple[int, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-", 6) if "-" in fields[6:] else len(fields)
        if sep + 1 >= len(fields):
            continue  # not a mount line
        point, fstype = _unescape(fields[4]), fields[sep + 1]
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= best[0]):
            best = (len(point), fstype)
    return None if best is None else best[1]


def _unescape(field: str) -> str:
    """A mountinfo path field with its octal escapes (``\\040`` for a space) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


# --- the C library -----------------------------------------------------------------------------


@functools.cache
def libc(name: str, restype: Any, *argtypes: Any) -> Callable[..., Any] | None:
    """The C library's function ``name`` (errno kept, its types set), or None where it has
    none."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


_VOID, _SIZE, _INT = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
mmap = libc("mmap", _VOID, _VOID, _SIZE, _INT, _INT, _INT, ctypes.c_long)
munmap = libc("munmap", _INT, _VOID, _SIZE)
madvise = libc("madvise", _INT, _VOID, _SIZE, _INT)
mincore = libc("mincore", _INT, _VOID, _SIZE, ctypes.c_char_p)
sync_file_range = libc("sync_file_range", _INT, _INT, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
malloc_trim = libc("malloc_trim", _INT, _SIZE)

MAP_FAILED = ctypes.c_void_p(-1).value
MAP_FIXED = 0x10  # every architecture
MADV_DONTNEED = 4
MADV_POPULATE_READ = 22  # 5.14+: fault pages in; an I/O error comes back, not a SIGBUS
MADV_POPULATE_WRITE = 23  # 5.14+: fault pages in writable without writing them
SYNC_FILE_RANGE_WRITE = 2  # start writing the range's dirty pages
SYNC_FILE_RANGE_WAIT_ALL = 7  # ... and wait for them, and for earlier writes of the range


def os_error(what: str) -> OSError:
    """The OSError of the last failed call of this thread (its errno), saying ``what``."""
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")
