"""I/O measured from outside the code under test: the OS's counters for this process,
TensorStore's own file kvstore counter, dropping a checkpoint's files from the page cache,
and which memory is a mapping of which file (``/proc/self/maps``)."""

import contextlib
import os
from collections.abc import Iterator


def io() -> dict:
    """This process's /proc/self/io counters (rchar, wchar, read_bytes, write_bytes, ...)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def ts_file_bytes_read(driver: str = "file") -> int:
    """Bytes TensorStore's ``driver`` kvstore (file, s3, gcs) has read in this process."""
    import tensorstore as ts

    found = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{driver}/bytes_read")
    return found[0]["values"][0]["value"] if found else 0


def drop_page_cache(path: str) -> None:
    """Evicts every file under ``path`` from the page cache (they are clean after fsync)."""
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cached_bytes(path: str) -> int:
    """Bytes of the files under ``path`` that are in the page cache now (``mincore`` of a
    read-only mapping: mapping a file brings none of it in)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            size = os.path.getsize(os.path.join(root, name))
            if not size:
                continue
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), f"mmap of {name} failed")
                pages = -(-size // mmap.PAGESIZE)
                vec = ctypes.create_string_buffer(pages)
                try:
                    if libc.mincore(addr, size, vec) != 0:
                        raise OSError(ctypes.get_errno(), f"mincore of {name} failed")
                finally:
                    libc.munmap(addr, size)
                total += sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
            finally:
                os.close(fd)
    return total


def resident_bytes(address: int, nbytes: int) -> int:
    """Bytes of this process's memory from ``address`` on (page-aligned) that are resident
    (``mincore``): pages never touched are not."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages = -(-nbytes // mmap.PAGESIZE)
    vec = ctypes.create_string_buffer(pages)
    if libc.mincore(address, nbytes, vec) != 0:
        raise OSError(ctypes.get_errno(), f"mincore at {address:#x} failed")
    return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE


def file_of(address: int) -> str | None:
    """The file mapped at ``address`` in this process (``/proc/self/maps``), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else None
    return None


def mapped_from(out, root) -> list[bool]:
    """For each shard of ``out``: whether its memory is a mapping of a file under ``root``."""
    return [
        (file_of(s.data.unsafe_buffer_pointer()) or "").startswith(str(root))
        for s in out.addressable_shards
    ]


@contextlib.contextmanager
def counting_maps() -> Iterator[list[int]]:
    """Counts the slices the direct reader maps (``direct.Reader.map``) while inside: the
    list's one item."""
    from jaxckpt._src.io import direct

    count = [0]
    real = direct.Reader._map

    def counting(self, *args):  # noqa: ANN001, ANN202
        count[0] += 1
        return real(self, *args)

    direct.Reader._map = counting
    try:
        yield count
    finally:
        direct.Reader._map = real
