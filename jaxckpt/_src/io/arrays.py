"""Shards in and out of TensorStore: zarr v3 arrays, one per leaf, in OCDBT databases.

(A local save of uncompressed leaves is written by ``ocdbt_write`` instead, in the same
format; ``write`` here takes the rest.) Each process writes the shards it owns into its own
OCDBT database under
``<step>/arrays/p<index>/``; after every process finished, process 0 merges them into the
root database ``<step>/arrays/`` (by reference, no data copied). A single process writes the
root database directly. A process writes everything in one non-atomic transaction that
references the source buffers instead of copying them: a step is a few large data files
(about six per process, written in parallel), and a save adds almost no host memory.
The sources must stay unchanged until ``write`` returns (device buffers are immutable;
staged host copies are not reused before the save is done).
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import re
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import tensorstore as ts

from ...errors import ChecksumError, StorageError
from ..boxes import Index
from ..storage import Location
from . import codecs, fingerprint, linux
from .layout import ADOPT_ALIGN

MIN_DATA_FILE_BYTES = 64 << 20
DATA_FILES_PER_PROCESS = 6  # written in parallel (6 beat 1, 4 and 8: docs/MEASURED.md)
OCDBT_CONFIG: dict[str, Any] = {
    "max_inline_value_bytes": 1024,
    "max_decoded_node_bytes": 100_000_000,
    "manifest_kind": "single",
}


@dataclass(frozen=True)
class ArrayWrite:
    """One leaf to write: its zarr metadata and the pieces this process owns."""

    name: str
    metadata: dict
    pieces: Sequence[tuple[Index, Callable[[], np.ndarray]]]
    create: bool  # write zarr.json (one process does)
    nbytes: int


# --- dtypes and metadata -------------------------------------------------------------------


@functools.cache
def _zarr_supports(dtype_name: str) -> bool:
    spec = {"driver": "zarr3", "kvstore": "memory://", "create": True}
    try:
        ts.open({**spec, "metadata": {"shape": [1], "data_type": dtype_name}}).result()
        return True
    except Exception:
        return False


def stored_dtype(dtype: np.dtype) -> str:
    """The zarr data type for ``dtype``; types zarr lacks are stored as unsigned bits."""
    return dtype.name if _zarr_supports(dtype.name) else f"uint{dtype.itemsize * 8}"


def zarr_metadata(
    shape: Sequence[int], data_type: str, chunks: Sequence[int], compression: str | None
) -> dict:
    """A leaf's zarr v3 metadata: raw little-endian bytes, ``compression``'s codec if any
    (``codecs``), then a CRC32C of every chunk."""
    chain: list[dict] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    compressed = codecs.codec(compression, ts.dtype(data_type).numpy_dtype.itemsize)
    if compressed is not None:
        chain.append(compressed)
    chain.append({"name": "crc32c"})
    return {
        "shape": list(shape),
        "data_type": data_type,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": chain,
    }


# --- specs ----------------------------------------------------------------------------------


def database_dir(step: Location, process: int | None) -> Location:
    """The OCDBT database a process writes (None: the merged root database)."""
    arrays = step.join("arrays")
    return arrays if process is None else arrays.join(f"p{process}")


def kvstore_spec(db: Location, data_file_bytes: int = 0) -> dict:
    return {
        "driver": "ocdbt",
        "base": db.kvstore(),
        "config": OCDBT_CONFIG,
        "assume_config": True,
        "target_data_file_size": data_file_bytes,
        "cache_pool": "cache_pool#ocdbt",
    }


def array_spec(db: Location, name: str) -> dict:
    """The TensorStore spec that opens leaf ``name`` (what docs/FORMAT.md describes)."""
    return {"driver": "zarr3", "kvstore": kvstore_spec(db), "path": name + "/"}


def new_context() -> ts.Context:
    # No chunk cache (it would double host memory); a small one for OCDBT B-tree nodes.
    return ts.Context(
        {
            "cache_pool": {"total_bytes_limit": 0},
            "cache_pool#ocdbt": {"total_bytes_limit": 64 << 20},
        }
    )


# --- writing --------------------------------------------------------------------------------


def write(db: Location, writes: Sequence[ArrayWrite], sums: fingerprint.Sums | None = None) -> None:
    """Writes every piece of ``writes`` into the OCDBT database at ``db`` (``sums``: adds
    each piece's fingerprint sum, as ``ocdbt_write.write``)."""
    ctx = new_context()
    total = sum(w.nbytes for w in writes)
    file_bytes = max(MIN_DATA_FILE_BYTES, -(-total // DATA_FILES_PER_PROCESS))
    kv = kvstore_spec(db, file_bytes)  # one spec for every leaf (it reads the environment)
    try:
        txn = ts.Transaction(atomic=False)
        opens = []
        for w in writes:
            spec = {
                "driver": "zarr3",
                "kvstore": kv,
                "path": w.name + "/",
                "metadata": w.metadata,
                # every chunk on disk, zeros too: a missing chunk is then an error, never a
                # silent zero (``jaxckpt verify`` checks that every chunk exists)
                "store_data_equal_to_fill_value": True,
            }
            spec.update(dict(create=True, open=False) if w.create else dict(assume_metadata=True))
            opens.append(ts.open(spec, context=ctx, transaction=txn))
        pending = []
        for w, fut in zip(writes, opens, strict=True):
            store = fut.result()
            for index, get in w.pieces:
                data = get()
                if data.dtype != store.dtype.numpy_dtype:
                    data = data.view(store.dtype.numpy_dtype)
                if sums is not None:
                    sums.add(w.name, data, index, w.metadata["shape"])
                pending.append(
                    store[_slices(index)].write(data, can_reference_source_data_indefinitely=True)
                )
        for written in pending:
            written.result()
        txn.commit_async().result()
    except Exception as e:
        raise StorageError(f"writing arrays into {db.url} failed: {e}") from e
    finally:
        release_free_memory()


def release_free_memory() -> None:
    """Hands memory TensorStore's threads freed back to the OS (glibc keeps it otherwise).

    Those threads allocate in many malloc arenas, so buffers one save or restore freed are
    often not reused by the next and the process's footprint creeps up.
    """
    if linux.malloc_trim is not None:
        linux.malloc_trim(0)


def merge(step: Location, process_count: int) -> None:
    """Links every process's database into the root one (copies references, not data)."""
    ctx = new_context()
    root = ts.KvStore.open(kvstore_spec(database_dir(step, None)), context=ctx).result()
    children = [
        ts.KvStore.open(kvstore_spec(database_dir(step, p)), context=ctx)
        for p in range(process_count)
    ]
    txn = ts.Transaction(atomic=True)
    copies = [c.result().experimental_copy_range_to(root.with_transaction(txn)) for c in children]
    for fut in copies:
        fut.result()
    txn.commit_async().result()


# --- reading --------------------------------------------------------------------------------


def open_leaf(db: Location, name: str, ctx: ts.Context) -> ts.Future:
    return ts.open({**array_spec(db, name), "open": True}, context=ctx, read=True)


class Opening:
    """A leaf's TensorStore, opened when first needed: ``start`` begins the open (once),
    ``result`` waits for it. A leaf the direct path reads whole is never opened."""

    def __init__(self, opener: Callable[[str], Any], name: str) -> None:
        self._opener, self._name = opener, name
        self._future: Any = None
        self._lock = threading.Lock()

    def start(self) -> Any:
        with self._lock:
            if self._future is None:
                self._future = self._opener(self._name)
            return self._future

    def result(self) -> Any:
        return self.start().result()


_CHUNK_KEY = re.compile(r'Error reading "([^"]+)"')


def read_error(
    e: Exception, *, leaf: str, db: Location, writers: Callable[[str], str]
) -> Exception:
    """Turns a TensorStore read failure into a ChecksumError / StorageError naming the leaf."""
    text = str(e)
    match = _CHUNK_KEY.search(text)
    key = match.group(1) if match else "?"
    if "Digest mismatch" in text or "DATA_LOSS" in text or "checksum" in text.lower():
        return checksum_error(leaf, key, writers(key), text)
    return StorageError(f"leaf {leaf!r}: reading from {db.url} failed: {text}")


def checksum_error(leaf: str, key: str, where: str, detail: str) -> ChecksumError:
    """The error of a chunk whose CRC32C does not match, whichever path read it."""
    return ChecksumError(
        f"leaf {leaf!r}: chunk {key!r} failed its CRC32C check; it lives in {where}. "
        f"The data on disk is corrupt: restore another step or re-save. ({detail})"
    )


def _slices(index: Index) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in index)


class _ReadInto:
    """A read into a buffer we own; ``result()`` waits and returns the buffer (at most
    ``timeout`` seconds: TimeoutError), ``done()`` and ``cancel()`` as a future's."""

    def __init__(self, fut: ts.Future | ts.WriteFutures, buf: np.ndarray) -> None:
        self.fut, self.buf = fut, buf

    def result(self, timeout: float | None = None) -> np.ndarray:
        self.fut.result(timeout=timeout)
        return self.buf

    def done(self) -> bool:
        return bool(self.fut.done())

    def cancel(self) -> None:
        self.fut.cancel()


def bytes_read() -> int:
    """Bytes TensorStore's key-value stores have read in this process, every driver
    (file, s3, gcs, http; its ``/tensorstore/kvstore/<driver>/bytes_read`` counters): the
    progress of reads whose futures show none until they are done. 0 where TensorStore
    keeps no such counters."""
    try:
        metrics = ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
    except Exception:  # (an experimental function)
        return 0
    return sum(
        int(v.get("value", 0))
        for m in metrics
        if m.get("name", "").endswith("/bytes_read")
        for v in m.get("values", [])
    )


HUGE_PAGE_MIN_BYTES = 2 << 20  # one huge page on x86-64 and most arm64 kernels
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")  # Linux


def aligned_empty(shape: Sequence[int], dtype: np.dtype, align: int = ADOPT_ALIGN) -> np.ndarray:
    """An uninitialized C-order array whose data starts on an ``align``-byte boundary.

    XLA's CPU client adopts such a buffer as a device buffer without copying it. One of
    ``HUGE_PAGE_MIN_BYTES`` or more is fresh memory in transparent huge pages where the
    kernel offers them (``huge_page_bytes``): a restore fills fresh memory, and faulting it
    in 4 KiB pages (each zeroed by the kernel) cost more than the reads.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes >= HUGE_PAGE_MIN_BYTES and HUGE_PAGES:
        return huge_page_bytes(nbytes).view(dtype).reshape(shape)
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def huge_page_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` of fresh memory (uint8) starting on a huge-page boundary, in an anonymous
    mapping of its own advised for transparent huge pages (``MADV_HUGEPAGE``) that ends
    where the bytes end. The kernel backs only the whole aligned 2 MiB ranges of a mapping
    with huge pages, so a mapping that starts anywhere loses one (a 3 MiB one got none
    here); one that ended past the bytes would get a huge page for the tail, memory no
    array uses. (NumPy advises its own allocations of 4 MiB or more, unaligned.)"""
    region = mmap.mmap(
        -1, nbytes + HUGE_PAGE_MIN_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    )
    probe = np.frombuffer(region, np.uint8, count=1)
    start = -probe.ctypes.data % HUGE_PAGE_MIN_BYTES
    del probe  # (a buffer exported from the mapping stops ``resize``)
    with contextlib.suppress(OSError, ValueError, BufferError, SystemError):
        region.resize(start + nbytes)  # mremap: shrinks the mapping in place
    with contextlib.suppress(OSError):  # a kernel without THP: plain pages
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.uint8, count=nbytes, offset=start)


POPULATE_STEP = 64 << 20  # populated at a time (a caller may stop between steps)


def populate(buf: np.ndarray, stop: Callable[[], bool] = lambda: False) -> bool:
    """Faults in the pages of ``buf``'s memory now (``MADV_POPULATE_WRITE``), step by step
    until ``stop()``, without changing a byte: fresh memory filled later then costs no page
    fault (the kernel zeroes each fresh page as it is first touched). False where the
    kernel can't (not Linux, older than 5.14): nothing done."""
    fn = linux.madvise
    if fn is None or not buf.nbytes:
        return False
    start = buf.ctypes.data - buf.ctypes.data % mmap.PAGESIZE
    end = buf.ctypes.data + buf.nbytes
    for at in range(start, end, POPULATE_STEP):
        if stop():
            return True
        if fn(at, min(POPULATE_STEP, end - at), linux.MADV_POPULATE_WRITE) != 0:
            return False  # EINVAL: a kernel without it
    return True


def buffer_for(into: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The buffer a read of ``shape`` and ``dtype`` fills: ``into``, checked to be exactly
    that and C-contiguous, or a fresh ``aligned_empty`` one."""
    if into is None:
        return aligned_empty(shape, dtype)
    if not (into.flags.c_contiguous and into.shape == tuple(shape) and into.dtype == dtype):
        raise ValueError(f"a {dtype} buffer of shape {tuple(shape)}, C-contiguous, is needed")
    return into


def read_slice(store: ts.TensorStore, index: Index, into: np.ndarray | None = None) -> _ReadInto:
    """Reads ``store[index]`` into ``into`` (C-contiguous, of the slice's shape and the
    store's dtype) or a fresh aligned buffer."""
    buf = buffer_for(into, tuple(b - a for a, b in index), store.dtype.numpy_dtype)
    target = ts.array(buf, copy=False, write=True)
    return _ReadInto(target.write(store[_slices(index)]), buf)


# --- where a chunk's bytes are -------------------------------------------------------------


class ChunkBytes(NamedTuple):
    """Where one OCDBT value's bytes are: ``file`` (a path or URL), bytes ``start`` up to
    ``stop`` (exclusive). ``inline``: the value is stored inside the B-tree node that
    occupies that range (zstd-compressed with its neighbours), not on its own. (A tuple: a
    B-tree walk makes one for every key.)"""

    file: str
    start: int
    stop: int
    inline: bool = False

    def __str__(self) -> str:
        what = "the B-tree node holding it inline, " if self.inline else ""
        return f"{self.file} ({what}bytes {self.start}-{self.stop - 1})"


def chunk_bytes(base: ts.KvStore, db: Location, keys: set[str]) -> dict[str, ChunkBytes]:
    """Where the values of ``keys`` live in the OCDBT database at ``db`` (opened as ``base``,
    its underlying key-value store): the data file and byte range, from the B-tree as
    ``tensorstore.ocdbt.dump`` gives it. Keys the database lacks are left out."""
    wanted = {k.encode() for k in keys}
    return btree(base, db, lambda key: key in wanted)[0]


def btree(
    base: ts.KvStore, db: Location, keep: Callable[[bytes], bool] | None = None
) -> tuple[dict[str, ChunkBytes], dict[str, bytes]]:
    """One walk of the B-tree of the OCDBT database at ``db`` (see ``chunk_bytes``): where
    the value of every key (that ``keep`` takes) lives, and the bytes of those stored inline in
    their node (a leaf's ``zarr.json``, as ``ocdbt_write`` stores it)."""
    manifest = ts.ocdbt.dump(base).result()
    versions = manifest.get("versions") or []
    if not versions or "location" not in versions[-1]["root"]:
        return {}, {}
    root = max(versions, key=lambda v: v["generation_number"])["root"]["location"]
    found: dict[str, ChunkBytes] = {}
    values: dict[str, bytes] = {}
    files: dict[str, str] = {}  # (a few data files hold every key)
    todo = [(root, b"")]
    while todo:
        node_at, prefix = todo.pop()
        node = ts.ocdbt.dump(base, node_at).result()
        if node["height"] > 0:
            for entry in node["entries"]:
                sub = prefix + entry.get("subtree_common_prefix", b"")
                todo.append((entry["location"], sub))
            continue
        for entry in node["entries"]:
            key = prefix + entry["key"]
            if keep is not None and not keep(key):
                continue
            name = key.decode(errors="replace")
            ref = entry.get("indirect_value")
            if ref is not None:
                found[name] = _reference(db, ref, files, False)
                continue
            found[name] = _reference(db, node_at, files, True)
            if isinstance(entry.get("inline_value"), bytes):
                values[name] = entry["inline_value"]
    return found, values


def _reference(db: Location, ref: str, files: dict[str, str], inline: bool) -> ChunkBytes:
    """``kind:base_path:relative_path:offset:length`` (TensorStore's data reference); the
    data file's URL of each ``kind:base_path:relative_path`` is kept in ``files``."""
    head, offset, length = ref.rsplit(":", 2)
    url = files.get(head)
    if url is None:
        _, base_path, relative = head.split(":", 2)
        url = files[head] = db.join(urllib.parse.unquote(base_path + relative)).url
    start = int(offset)
    return ChunkBytes(url, start, start + int(length), inline)


def locate_within(db: Location, keys: set[str], timeout_s: float) -> dict[str, ChunkBytes]:
    """Where the values of ``keys`` live (``chunk_bytes``), as far as the B-tree tells
    within ``timeout_s``: {} where it can't (its own reads stall or fail). An error's
    detail (a stalled read's file): it never raises nor waits longer."""
    found: list[dict[str, ChunkBytes]] = []

    def run() -> None:
        with contextlib.suppress(Exception):
            base = ts.KvStore.open(db.kvstore()).result()
            found.append(chunk_bytes(base, db, keys))

    thread = threading.Thread(target=run, name="jaxckpt-locate", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return found[0] if found else {}


def locate(db: Location, key: str) -> ChunkBytes | None:
    """Where ``key``'s value lives in the OCDBT database at ``db``, or None when the B-tree
    can't tell (an error path's extra detail: it never raises)."""
    try:
        base = ts.KvStore.open(db.kvstore()).result()
        return chunk_bytes(base, db, {key}).get(key)
    except Exception:  # a damaged or unreadable B-tree: the caller names the directory
        return None
