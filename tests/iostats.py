"""I/O measured from outside the code under test: the OS's counters for this process,
TensorStore's own file kvstore counter, and dropping a checkpoint's files from the page cache."""

import os


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
