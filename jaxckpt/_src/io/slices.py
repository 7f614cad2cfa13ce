"""The one way a checkpoint's slices are read: ``read`` (both restores call it).

Given the slices wanted (``Request``: a leaf, a global index, where its bytes may go and
what takes them), ``read`` plans them (``chunk_plan.plan_slices``: one B-tree walk; the
slices made of whole uncompressed chunks of a local database are read by ``direct.Reader``
with ``preadv``, those of a few MiB and those that need parts of chunks several a task:
``_groups``), lets the slices that may be mapped become mappings of their chunks
(``mapped.choose``), probes whether the files are in the page cache (``residency``: a cold
read gets prefetch advice and its fresh buffers faulted in ahead by a thread), and reads
every slice under one byte budget (``inflight.InFlight``); TensorStore reads the rest. Each
chunk's CRC32C is checked, whichever path reads it. An error names the leaf, the chunk, its
data file and byte range and (where the caller knows it) the process that wrote it, in one
wording: the caller chooses whether it raises or counts the slice as failed.

One ``inflight.Watch`` bounds every wait, whichever path reads: where no read progresses for
``Stall.seconds`` (the direct reads' ``preadv`` calls and fault-ins of mappings, watched one
by one; TensorStore's reads through its byte counters and their futures), the slice waited
for fails with ``ReadStalledError``, naming the process, the file or object and how long
(a direct read: the file and bytes its thread is blocked on; TensorStore's: the data files
of its chunks, where the B-tree tells within ``LOCATE_S``), and TensorStore's reads are
cancelled; a thread blocked in the kernel is left behind (nothing can interrupt it).
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ...errors import ReadStalledError, StorageError
from ..boxes import Index, chunks_in, extent, to_text, volume
from ..storage import Location
from . import arrays, chunk_plan, crc, direct, mapped, residency, spans
from .inflight import Describe, InFlight, Raises, Stall, Watch, default_budget
from .layout import SMALL_CHUNK_BYTES

if TYPE_CHECKING:
    from ..manifest import LeafRecord

Consume = Callable[[np.ndarray, Sequence[np.ndarray] | None], None]
"""Takes a slice's bytes (in the dtype read) and its replicas' (the same bytes in the
``copies`` of its request, or mappings of their own), or None where there are none."""


@dataclass(frozen=True)
class Request:
    """One slice to read: ``index`` of leaf ``leaf``, handed to ``consume``.

    ``into``: a C-contiguous buffer of the slice's shape to read it into, of the dtype read
    or the leaf's own (``fits``); else fresh memory. ``copies``: buffers like ``into`` that
    the direct path fills with the same bytes as it reads (replicas on CPU devices).
    ``maps``: None, or the slice may become private mappings of its chunks (``mapped``),
    itself and ``maps`` replicas, each a mapping of its own. ``key``: the caller's name for
    it, handed back with a failure. ``stage``: where there is no ``into``, asked for one as
    the read starts (its bytes, uint8: a slot of a ring of reused host memory, ``ring``),
    None: fresh memory."""

    leaf: LeafRecord
    index: Index
    consume: Consume
    into: np.ndarray | None = None
    copies: Sequence[np.ndarray] = ()
    maps: int | None = None
    key: Hashable = None
    stage: Callable[[int], np.ndarray | None] | None = None

    @functools.cached_property
    def nbytes(self) -> int:
        size = math.prod(self.leaf.shape)
        return volume(self.index) * (self.leaf.nbytes // max(1, size))

    def buffers(self, dtype: np.dtype) -> list[np.ndarray]:
        """The memory a read of ``dtype`` fills: ``into`` and ``copies`` viewed as ``dtype``
        (``fits``); none where it reads into fresh memory."""
        into = fits(self.into, extent(self.index), dtype, self.leaf.data_dtype)
        return [] if into is None else [into, *(c.view(into.dtype) for c in self.copies)]

    def staged(self, dtype: np.dtype) -> np.ndarray | None:
        """A buffer from ``stage`` for a read of ``dtype`` (the slice's shape), or None."""
        if self.stage is None or self.into is not None:
            return None
        shape = extent(self.index)
        slot = self.stage(math.prod(shape) * dtype.itemsize)
        return None if slot is None else slot.view(dtype).reshape(shape)


def fits(
    into: np.ndarray | None, shape: tuple[int, ...], dtype: np.dtype, saved: np.dtype
) -> np.ndarray | None:
    """``into`` as a buffer that a read of ``shape`` and ``dtype`` fills with no conversion
    after: itself, or, where it is of the ``saved`` dtype and ``dtype`` is the unsigned
    carrier of its bytes (a dtype zarr lacks), its view as ``dtype``; None where it is
    missing, C-discontiguous or of another shape or dtype."""
    if into is None or into.shape != shape or not into.flags.c_contiguous:
        return None
    if into.dtype == dtype:
        return into
    if into.dtype == saved and dtype.itemsize == saved.itemsize:
        return into.view(dtype)
    return None


Failed = Callable[[Request, Exception], None]
Writer = Callable[["LeafRecord", tuple[int, ...]], "int | None"]
LOCATE_S = 10.0  # a stalled TensorStore read's data files: the B-tree asked this long at most
LOCATE_KEYS = 16  # chunks of a stalled slice located (its first ones)


def read(
    db: Location,
    requests: Sequence[Request],
    open_leaf: Callable[[str], Any],
    *,
    budget: int | None = None,
    use_threads: int = 0,
    direct_ok: bool = True,
    writer: Writer | None = None,
    failed: Failed | None = None,
    stall: Stall | None = None,
) -> int:
    """Reads every request of the OCDBT database ``db`` and hands it to its ``consume``;
    returns the bytes read.

    ``open_leaf(name)`` starts opening a leaf's TensorStore (a future), only for the leaves
    the direct path does not read whole. ``budget``: at most this many bytes read but not
    yet consumed (default ``inflight.default_budget``); ``use_threads``: consume on that
    many threads (0: on this one). ``direct_ok``: the database is in jaxckpt's own layout
    (an Orbax checkpoint's is read by TensorStore alone). ``writer(leaf, chunk coords)``:
    the process that wrote a chunk, for errors. ``failed``: takes each slice whose read
    failed (with the error), and the others are read on; None: the first error raises.
    ``stall``: a read that makes no progress this long fails with ``ReadStalledError``
    naming ``stall.who`` (default: ``Stall()``, ``inflight.STALL_TIMEOUT_S``).
    """
    budget = budget or default_budget(direct.reader_threads())
    stores = {r.leaf.name: arrays.Opening(open_leaf, r.leaf.name) for r in requests}
    name = _Names(db, writer)
    plans = _plans(db, requests, stores, direct_ok, strict=failed is None)
    for i, r in enumerate(requests):  # TensorStore opens what it is to read, at once
        if i not in plans:
            stores[r.leaf.name].start()
    maps = _mapped(db, requests, plans)
    order = sorted(plans)  # as they are issued
    on_disk = residency.from_disk([plans[i] for i in order])  # None: can't tell
    fills = [
        b for i in order if i not in maps for b in requests[i].buffers(plans[i].dtype)
    ] if on_disk is True else []  # fmt: skip
    watch = Watch(stall or Stall(), probe=arrays.bytes_read)  # (its clock starts here)
    # no thread outlives the read; the direct reads' threads stop after their users'
    with (
        _populating(fills),
        contextlib.closing(direct.Reader(prefetch=on_disk is not False, watch=watch)) as reader,
        contextlib.closing(InFlight[Any](budget, threads=use_threads, watch=watch)) as reads,
    ):
        limit = min(GROUP_BYTES, budget // 4)  # (several groups in flight: every thread busy)
        for group, alone in _groups(requests, plans, maps, limit, budget):
            if alone is None:
                _issue_group(reads, [(requests[i], plans[i]) for i in group], reader, name, failed)
                continue
            r, p = requests[alone], plans.get(alone)
            _issue(reads, r, p, alone in maps, reader, stores[r.leaf.name], name, failed)
        reads.drain()
        total = reads.total
    arrays.release_free_memory()
    return total


def _plans(
    db: Location,
    requests: Sequence[Request],
    stores: dict[str, arrays.Opening],
    direct_ok: bool,
    strict: bool,
) -> dict[int, chunk_plan.SliceRead]:
    """The requests (by position) the direct path reads (``chunk_plan.plan_slices``: each
    leaf's layout from its ``zarr.json`` in the B-tree walk, as jaxckpt stores it).
    A B-tree naming a file outside the database raises StorageError where ``strict``; else
    TensorStore reads those slices, and fails each one by itself."""
    if not (direct_ok and direct.enabled(db)):
        return {}
    try:
        got = chunk_plan.plan_slices(
            db, ((i, r.leaf, r.index, stores[r.leaf.name].result) for i, r in enumerate(requests))
        )
    except StorageError:
        if strict:
            raise
        return {}
    return {i: sr for i, sr in got.items() if isinstance(i, int)}


def _mapped(
    db: Location, requests: Sequence[Request], plans: dict[int, chunk_plan.SliceRead]
) -> set[int]:
    """The planned requests whose slices become mappings of their chunks (``mapped.choose``,
    while the process has room for them): those that allow it (``maps``) and read into no
    buffer, or into one that takes the bytes as they are (``fits``)."""

    def usable(i: int, sr: chunk_plan.SliceRead) -> bool:
        r = requests[i]
        return r.into is None or bool(r.buffers(sr.dtype))

    wanted = (
        (i, sr, requests[i].maps or 0) for i, sr in plans.items() if requests[i].maps is not None
    )
    return mapped.choose(db.url, wanted, usable)


GROUP_BYTES = spans.SPLIT_BYTES  # slices read as one task, under one entry of the budget
"""(At most a quarter of the read budget.)"""


def _groups(
    requests: Sequence[Request],
    plans: dict[int, chunk_plan.SliceRead],
    maps: set[int],
    limit: int,
    cap: int,
) -> Iterator[tuple[list[int], int | None]]:
    """The requests in order, by position: (group, None) for consecutive ones the direct
    reader reads together (``direct.Reader.start_group``), about ``limit`` bytes in all:
    slices of whole chunks, neither mapped nor small (the reader batches those itself),
    and slices that need parts of chunks (never mapped: ``mapped.suitable``), a group going
    on past ``limit``, up to ``cap`` (the read budget), while the next slice needs a chunk it
    reads (each group reads its chunks once: a chunk is read again only by another group).
    Such a group may hold the whole budget, the next read waiting until it is used: reading
    a chunk again costs more (four slices of 30 MiB sharing their chunks, in groups of half
    a 128 MiB budget, read every chunk twice: docs/MEASURED.md). Where a group must end,
    the slices at its end that need the very chunks the next slice needs (the other columns
    of the same rows) go on with it, not split from it, unless they are the whole group or
    would take it past ``cap``. ([], i) for every other request alone."""
    group: list[int] = []
    sizes: list[int] = []
    needs: list[frozenset[str]] = []  # (each member's chunks, for the end of a group)
    keys: set[str] = set()
    size = 0
    for i, r in enumerate(requests):
        sr, n = plans.get(i), r.nbytes
        mine = frozenset(p.key for p in sr.parts) if sr is not None else frozenset()
        if sr is not None and sr.parts:  # (``Reader.start`` reads one alone as a group too)
            ok, shares = True, not mine.isdisjoint(keys)
        else:
            ok = sr is not None and i not in maps and SMALL_CHUNK_BYTES < n <= limit
            shares = False
        if not ok:
            if group:
                yield group, None
                group, sizes, needs, keys, size = [], [], [], set(), 0
            yield [], i
            continue
        if group and size + n > limit and not (shares and size + n <= cap):
            same, moved = 0, n  # the members at the end that need exactly its chunks
            while mine and same < len(group) and needs[-1 - same] == mine:
                moved += sizes[-1 - same]
                same += 1
            cut = len(group) - same if same < len(group) and moved <= cap else len(group)
            yield group[:cut], None
            group, sizes, needs = group[cut:], sizes[cut:], needs[cut:]
            keys, size = set(mine) if group else set(), sum(sizes)
        group.append(i)
        sizes.append(n)
        size += n
        needs.append(mine)
        keys.update(mine)
    if group:
        yield group, None


def _issue_group(
    reads: InFlight[Any],
    group: list[tuple[Request, chunk_plan.SliceRead]],
    reader: direct.Reader,
    name: _Names,
    failed: Failed | None,
) -> None:
    """Starts the reads of ``group`` (``_groups``) together once they fit the budget;
    each slice is handed to its ``consume``, or fails by itself, as ``_issue``'s."""
    fills = [r.buffers(plan.dtype) for r, plan in group]

    def what() -> str:  # (a stall's error only)
        r = group[0][0]
        files = sorted(
            {c.at.file for _, plan in group for c in plan.chunks}
            | {p.at.file for _, plan in group for p in plan.parts}
        )
        return (
            f"leaf {r.leaf.name!r} slice {to_text(r.index)} and the {len(group) - 1} slices "
            f"read with it in {', '.join(files)}"
        )

    early: dict[int, Exception] = {}  # slices whose buffer could not be had: their errors

    def start() -> Any:
        items = []
        for k, ((r, plan), fill) in enumerate(zip(group, fills, strict=True)):
            try:
                items.append((plan, fill[0] if fill else r.staged(plan.dtype), fill[1:]))
            except Exception as e:  # (only that slice fails)
                early[k] = e
        try:
            return reader.start_group(items)
        except Exception as e:  # every slice: named for each in ``use``
            return Raises(e)

    def use(fut: Any) -> None:
        try:
            got: list[Any] = fut.result()
        except Exception as e:  # the whole group (a stall's error is named already), but a
            for k, (r, _) in enumerate(group):  # slice whose buffer failed fails with that
                own = early.get(k, e)
                _fail(r, own if isinstance(own, ReadStalledError) else name.error(own, r.leaf),
                      failed)  # fmt: skip
            return
        read = iter(got)
        for k, ((r, _), fill) in enumerate(zip(group, fills, strict=True)):
            data = early[k] if k in early else next(read)
            if isinstance(data, Exception):
                _fail(r, name.error(data, r.leaf), failed)
            else:
                r.consume(data, fill[1:] or None)

    reads.add(sum(r.nbytes for r, _ in group), start, use, what)


def _fail(r: Request, err: Exception, failed: Failed | None) -> None:
    """A slice whose read failed with ``err`` (named): raised, or handed to ``failed``."""
    if failed is None:
        raise err
    failed(r, err)


def _issue(
    reads: InFlight[Any],
    r: Request,
    plan: chunk_plan.SliceRead | None,
    mapping: bool,
    reader: direct.Reader,
    store: arrays.Opening,
    name: _Names,
    failed: Failed | None,
) -> None:
    """Starts ``r``'s read once it fits the budget: as mappings (``mapping``), by the direct
    reader where ``plan`` says how, else by TensorStore."""
    fill = r.buffers(plan.dtype) if plan is not None and not mapping else []
    into, copies = (fill[0], fill[1:]) if fill else (None, [])

    def what() -> str:  # (a stall's error only)
        head = f"leaf {r.leaf.name!r} slice {to_text(r.index)}"
        if plan is None:
            return f"{head} in {name.objects(r.leaf, r.index)}"
        files = sorted({c.at.file for c in plan.chunks} | {p.at.file for p in plan.parts})
        return f"{head} in {', '.join(files)}"

    def start() -> Any:
        try:
            if plan is not None and mapping:
                return reader.map(plan, r.maps or 0)
            if plan is not None:
                return reader.start(plan, into if fill else r.staged(plan.dtype), copies)
            opening = store.start()
            if reads.watch is not None:  # (the open is shared by the leaf's reads: kept)
                opening = reads.watch.wait(opening, _opening(r, name), cancel=False)
            ts_store = opening.result()
            dtype = ts_store.dtype.numpy_dtype
            got = fits(r.into, extent(r.index), dtype, r.leaf.data_dtype)
            return arrays.read_slice(ts_store, r.index, got if got is not None else r.staged(dtype))
        except Exception as e:
            return Raises(e if isinstance(e, ReadStalledError) else name.error(e, r.leaf))

    def use(fut: Any) -> None:
        try:
            data = fut.result()
        except Exception as e:
            _fail(r, e if isinstance(fut, Raises) else name.error(e, r.leaf), failed)
            return
        if mapping:
            r.consume(data[0], data[1:])
        else:
            r.consume(data, copies or None)

    reads.add(r.nbytes, start, use, what)


def _opening(r: Request, name: _Names) -> Describe:
    return lambda: f"leaf {r.leaf.name!r}'s zarr.json in the OCDBT database under {name.db.url}"


@dataclass(frozen=True)
class _Names:
    """Errors of one database's reads, one wording whichever path read the chunk."""

    db: Location
    writer: Writer | None

    def error(self, e: Exception, rec: LeafRecord) -> Exception:
        """``e`` as the error that names leaf ``rec``, its chunk and where it lives (its
        ``__cause__``: ``e``)."""
        out = self._named(e, rec)
        out.__cause__ = e
        return out

    def _named(self, e: Exception, rec: LeafRecord) -> Exception:
        if isinstance(e, crc.Corrupt):
            return arrays.checksum_error(rec.name, e.key, self.where(rec, e.key, e.at), str(e))
        if isinstance(e, StorageError):  # the direct path's own (a truncated file)
            return StorageError(f"leaf {rec.name!r}: {e}")
        return arrays.read_error(
            e, leaf=rec.name, db=self.db, writers=lambda key: self.where(rec, key)
        )

    def objects(self, rec: LeafRecord, index: Index) -> str:
        """The data files (objects) holding the chunks of slice ``index`` of ``rec`` (its
        first ``LOCATE_KEYS``), as far as the B-tree tells within ``LOCATE_S``; else the
        database."""
        keys: set[str] = set()
        if rec.chunk_shape is not None and len(rec.chunk_shape) == len(index):
            for coords in chunks_in(index, rec.chunk_shape):
                keys.add(f"{rec.name}/c/" + "/".join(str(c) for c in coords))
                if len(keys) >= LOCATE_KEYS:
                    break
        found = arrays.locate_within(self.db, keys, LOCATE_S) if keys else {}
        if not found:
            return f"the OCDBT database under {self.db.url}"
        by_file: dict[str, list[str]] = {}
        for key, at in sorted(found.items()):
            by_file.setdefault(at.file, []).append(f"{key!r} at bytes {at.start}-{at.stop - 1}")
        return "; ".join(f"{f} (chunk {', '.join(ks)})" for f, ks in by_file.items())

    def where(self, rec: LeafRecord, key: str, at: arrays.ChunkBytes | None = None) -> str:
        """Where chunk ``key`` lives: its data file and byte range, and its writer."""
        coords = key.rsplit("/c/", 1)[-1].split("/") if "/c/" in key else []
        proc = None
        if self.writer is not None:
            with contextlib.suppress(ValueError):
                proc = self.writer(rec, tuple(int(c) for c in coords))
        at = at or arrays.locate(self.db, key)  # the data file and byte range, from the B-tree
        by = "" if proc is None else f", written by process {proc}"
        if at is not None:
            return f"{at}{by}"
        if proc is None:
            return f"the OCDBT database under {self.db.url}"
        return f"the OCDBT data files of process {proc} under {self.db.url}"


@contextlib.contextmanager
def _populating(regions: list[np.ndarray]) -> Iterator[None]:
    """While the block reads from the disk, a thread faults in the fresh buffers the direct
    reads fill (``regions``, in the order they are read; ``arrays.populate``) ahead of the
    reads, on a core the reads leave idle as they wait (docs/MEASURED.md). Not from the
    page cache: there the reads keep every core busy, and the pages cost the same faulted
    by either thread."""
    if not regions:
        yield
        return
    stop = threading.Event()

    def run() -> None:
        for region in regions:
            if not arrays.populate(region, stop.is_set) or stop.is_set():
                return

    thread = threading.Thread(target=run, name="jaxckpt-populate", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
