"""``restore``: reading a committed checkpoint onto the devices and shardings asked for.

A restore goes: the manifest (``readers.any_manifest``: jaxckpt's, or an Orbax checkpoint's)
-> one ``Want`` per leaf (``wants``) -> leaves that devices on several hosts need are read
once with a finer sharding and moved afterwards (``read_once``) -> each leaf's slices, one
per distinct device index, are read under a byte budget (``inflight.InFlight``) while two
threads copy them onto their devices (``placement.Placement``; CPU devices adopt a leaf's
slices together, no thread needed) -> the tree (``result``).
A local checkpoint's slices made of whole uncompressed chunks are read with ``preadv``
straight into their buffers (``direct``); TensorStore reads the others.
(Named ``restoring`` so that ``jaxckpt.restore`` stays the function, unshadowed.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..errors import OptionsError, StorageError
from . import gc_pause, multihost, read_once
from .boxes import Index, extent, volume, whole
from .io import arrays, chunk_plan, direct, mapped, residency
from .io.inflight import InFlight, default_budget
from .leaf_plan import Want, result, wants, whole_on_host
from .manifest import LeafRecord, Manifest
from .monitoring import Stopwatch
from .orbax import checkpoint as orbax
from .placement import Placement, on_cpu
from .readers import any_manifest
from .sharding import saved_writers
from .storage import Location, location

READ_ONCE_TIMEOUT_S = 600.0  # the one key-value round of a job's first shared restore


def restore(
    path: str | os.PathLike,
    target: Any = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
    read_budget_bytes: int | None = None,
) -> Any:
    """Reads the checkpoint at ``path`` onto the devices and shardings asked for; ``path``
    may also hold a checkpoint written by orbax-checkpoint (docs/ORBAX.md).

    ``target`` is a pytree whose leaves are ``jax.ShapeDtypeStruct`` (with ``.sharding``),
    ``jax.Array`` (its sharding, dtype and shape), ``jax.sharding.Sharding`` or NumPy arrays;
    the result has its structure, may name fewer leaves than were saved, and casts to its
    dtypes. With ``mesh`` and no target, each leaf's saved PartitionSpec is bound to
    ``mesh`` (with a target, so is each ``ShapeDtypeStruct`` leaf without a sharding; a
    NumPy target leaf means a NumPy result). With neither, leaves come back on their saved
    mesh rebuilt over the current devices when the device count allows, else as NumPy arrays.

    ``read_budget_bytes`` bounds the host memory of slices read but not yet on their devices
    (default: 64 MiB per reader thread, at least 128 MiB; 512 MiB on 16 cores or more, see
    ``inflight.default_budget``); reads within it run concurrently, so a larger budget can
    restore faster. Peak host memory is about the result plus the budget, plus as much again
    at most for chunks that several slices need a part of (read once, kept for all of them).

    >>> state = jaxckpt.restore("/ckpt/step_100", target=abstract_state)
    """
    loc = location(path)
    if read_budget_bytes is not None and read_budget_bytes < 1:
        raise OptionsError(
            f"{loc.url}: read_budget_bytes={read_budget_bytes!r}; pass None or a positive size"
        )
    fig = Stopwatch("restore", loc.url)
    with gc_pause.paused():  # hundreds of collections over every live object otherwise
        with fig.phase("plan"):
            source, manifest = any_manifest(loc)
            planned = wants(manifest.leaves, manifest.meshes, target, mesh, loc)
            reading, moves = _read_shardings(loc, planned)
        with fig.phase("read"):  # and onto the devices: the two overlap
            budget = read_budget_bytes or default_budget(direct.reader_threads())
            values = _read_all(loc, reading, budget, manifest, source, fig)
        with fig.phase("move"):
            moved = read_once.move([values[i] for i in moves], list(moves.values()))
        for i, v in zip(moves, moved, strict=True):
            values[i] = v
        fig.done()
        return result(target, planned, values)


def _read_shardings(
    loc: Location, planned: list[Want]
) -> tuple[list[Want], dict[int, jax.sharding.Sharding]]:
    """The leaves as read: those that devices on several hosts need (or several processes,
    from an object store) with a finer sharding (``read_once``); and the sharding each of
    those is moved to afterwards, by position."""
    moves: dict[int, jax.sharding.Sharding] = {}
    reading = list(planned)
    shared = [
        i
        for i, w in enumerate(planned)
        if w.record.kind == "array"
        and w.sharding is not None
        and read_once.movable(w.dtype or w.record.data_dtype)
        and read_once.shared_across_processes(w.sharding, tuple(w.record.shape))
    ]
    hosts: tuple[str, ...] = ()
    if shared and loc.is_local:  # processes of one host share its page cache
        hosts = tuple(multihost.process_hosts(READ_ONCE_TIMEOUT_S))
    elif shared:  # an object store: no cache is shared, every process reads for itself
        hosts = tuple(f"process {p}" for p in range(multihost.process_count()))
    for i in shared:
        w, rec = planned[i], planned[i].record
        assert w.sharding is not None and rec.chunk_shape is not None  # (shared: both are)
        rs = read_once.read_sharding(w.sharding, tuple(rec.shape), tuple(rec.chunk_shape), hosts)
        if rs is not None:
            moves[i], reading[i] = w.sharding, dataclasses.replace(w, sharding=rs)
    return reading, moves


def _read_all(
    loc: Location,
    reading: list[Want],
    budget: int,
    manifest: Manifest,
    source: orbax.OrbaxCheckpoint | None,
    fig: Stopwatch,
) -> list[Any]:
    """Every leaf, each distinct slice this process needs read once, at most ``budget``
    bytes read but not yet on a device; two threads place them."""
    ctx = arrays.new_context()
    opener: Callable[[str], Any]
    if source is None:
        db = arrays.database_dir(loc, None)
        opener = functools.partial(arrays.open_leaf, db, ctx=ctx)
    else:  # an Orbax checkpoint: its own layout, the same reads
        db, opener = source.item, source.opener(ctx)
    stores = {
        w.record.name: arrays.Opening(opener, w.record.name) for w in reading if w.record.nbytes
    }
    reader = _Reader(db, manifest.meshes)
    finishers = [_plan_leaf(w, stores.get(w.record.name), reader) for w in reading]
    plans = _direct_plan(db, reader.requests) if source is None and direct.enabled(loc) else {}
    for i, r in enumerate(reader.requests):  # TensorStore opens what it is to read, at once
        if i not in plans:
            r.store_fut.start()
    maps = _mapped(db, reader.requests, plans)
    planned = [(r, plans[i]) for i, r in enumerate(reader.requests) if i in plans]
    on_disk = residency.from_disk([sr for _, sr in planned])  # None: can't tell
    cold = on_disk is True
    fills = [
        b for i, r in enumerate(reader.requests) if i in plans and i not in maps
        for b in r.buffers(plans[i])
    ] if cold else []  # fmt: skip
    # no thread outlives the restore; the direct reads' threads stop after their users'
    with (
        _populating(fills),
        contextlib.closing(
            direct.Reader(
                keep_bytes=min(direct.KEEP_BYTES, budget),
                prefetch=on_disk is not False,
                maps=source is None and mapped.enabled(db.url),
            )
        ) as direct_reader,
        contextlib.closing(InFlight[Any](budget, threads=_place_threads(reading))) as reads,
    ):
        for i, request in enumerate(reader.requests):
            reader.issue(reads, request, plans.get(i), direct_reader, i in maps)
        reads.drain()
        fig.bytes += reads.total
    arrays.release_free_memory()
    return [f() for f in finishers]


@contextlib.contextmanager
def _populating(regions: list[np.ndarray]) -> Iterator[None]:
    """While the block reads from the disk, a thread faults in the fresh buffers the direct
    reads fill (``regions``, in the order they are read; ``arrays.populate``) ahead of the
    reads, on a core the reads leave idle as they wait: a cold 1 GB restore onto 8 CPU
    devices here, median 0.80 against 0.86 s (10 alternating pairs of fresh processes). Not
    from the page cache: there the reads keep every core busy, and the pages cost the same
    faulted by either thread."""
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


def _mapped(
    db: Location, requests: list[_Request], plans: dict[Hashable, chunk_plan.SliceRead]
) -> set[int]:
    """The planned requests whose slices become mappings of their chunks (``mapped``): onto
    CPU devices (read into the leaf's own buffer, ``into``, with no conversion after) from
    a local filesystem, while the process has room for the mappings (``mapped.choose``;
    it asks for ``buffers``, views of a few us each, only of the slices it can map)."""
    if not plans:
        return set()

    def usable(i: int, sr: chunk_plan.SliceRead) -> bool:
        return bool(requests[i].buffers(sr))

    wanted = (
        (i, sr, len(r.copies)) for i, r in enumerate(requests) if (sr := plans.get(i)) is not None
    )
    return mapped.choose(db.url, wanted, usable)


def _place_threads(reading: list[Want]) -> int:
    """Threads that put read slices onto devices: none where every leaf goes to CPU devices
    (``Placement`` only sets a slice aside there, and a hand-over to a thread cost more);
    else 2, or 1 on a host of 2 cores or fewer (there the readers need the cores: 1
    restored a few % faster)."""
    if on_cpu(d for w in reading if w.sharding is not None for d in w.sharding.device_set):
        return 0
    return 1 if (os.cpu_count() or 1) <= 2 else 2


def _direct_plan(db: Location, requests: list[_Request]) -> dict[Hashable, chunk_plan.SliceRead]:
    """The requests (by position) that the direct path reads (``chunk_plan.plan_slices``: each
    leaf's layout from its ``zarr.json`` in the B-tree walk, as jaxckpt stores it; a
    TensorStore open costs more, 2000 leaves: ~0.1 ms each)."""
    return chunk_plan.plan_slices(
        db,
        (
            (i, r.rec, whole(r.rec.shape) if r.index is None else r.index, r.store_fut.result)
            for i, r in enumerate(requests)
        ),
    )


def _plan_leaf(w: Want, store_fut: Any, reader: _Reader) -> Callable[[], Any]:
    """Queues the reads of one leaf; returns what gives its value once they are done."""
    rec = w.record
    if not rec.has_array:
        value = rec.value
        return lambda: value
    shape = tuple(rec.shape)
    saved = rec.data_dtype
    want_dtype = w.dtype or saved

    def convert(data: np.ndarray) -> np.ndarray:
        if data.dtype != saved:
            data = data.view(saved)
        return data if data.dtype == want_dtype else data.astype(want_dtype)

    if rec.kind == "prng_key" or w.sharding is None:
        # Whole leaf on the host (NumPy results; PRNG keys are small and re-wrapped).
        holder: dict[str, np.ndarray] = {}

        def keep(data: np.ndarray, replicas: Sequence[np.ndarray] | None = None) -> None:
            holder["v"] = convert(data)

        if store_fut is None:
            holder["v"] = np.zeros(shape, saved)
        else:
            reader.add(store_fut, rec, None, keep)

        return lambda: whole_on_host(w, holder["v"])

    out = Placement(w.sharding, shape, want_dtype)
    viewed = np.dtype(want_dtype) == saved  # convert gives a view of the bytes read: no cast

    def place(index: Index, data: np.ndarray, replicas: Sequence[np.ndarray] | None) -> None:
        value = convert(data)
        out.put(index, value, [convert(r) for r in replicas] if viewed and replicas else None)

    for index in out.indices:
        if store_fut is None or not volume(index):
            out.put(index, np.zeros(extent(index), want_dtype))
        else:  # read straight into the array's own memory where it has some (CPU devices)
            into, copies = out.host_buffer(index), out.replica_buffers(index)
            reader.add(store_fut, rec, index, functools.partial(place, index), into, copies)
    return out.array


def _fits(into: np.ndarray | None, dtype: np.dtype, saved: np.dtype) -> np.ndarray | None:
    """``into`` as a buffer a read of ``dtype`` fills with no conversion after: itself, or,
    where ``into`` is of the ``saved`` dtype and ``dtype`` is the unsigned carrier of its
    bytes (a dtype zarr lacks), its view as ``dtype``; else None."""
    if into is None or into.dtype == dtype:
        return into
    if into.dtype == saved and dtype.itemsize == saved.itemsize:
        return into.view(dtype)
    return None


@dataclass(frozen=True)
class _Request:
    """One slice to read (``index`` None: the whole leaf) and what to hand its data to."""

    store_fut: Any
    rec: LeafRecord
    index: Index | None
    consume: Callable[[np.ndarray, Sequence[np.ndarray] | None], None]  # (data, replicas)
    into: np.ndarray | None = None  # where to read it (``_fits``); else fresh memory
    copies: list[np.ndarray] = dataclasses.field(default_factory=list)  # and fill, if it can

    def buffers(self, plan: chunk_plan.SliceRead) -> list[np.ndarray]:
        """The memory the direct read ``plan`` fills: ``into`` (viewed as the dtype read,
        ``_fits``) and ``copies``; none where it reads into fresh memory."""
        into = _fits(self.into, plan.dtype, self.rec.data_dtype)
        return [] if into is None else [into, *(c.view(into.dtype) for c in self.copies)]


@dataclass(frozen=True)
class _Reader:
    """The reads of one checkpoint's leaves, collected first (``add``), then started in
    order under a byte budget (``issue``); an error names the leaf, the chunk's data file
    and byte range, and the process that wrote it."""

    db: Location
    meshes: list[dict]
    requests: list[_Request] = dataclasses.field(default_factory=list)

    def add(
        self,
        store_fut: Any,
        rec: LeafRecord,
        index: Index | None,
        consume: Callable[[np.ndarray, Sequence[np.ndarray] | None], None],
        into: np.ndarray | None = None,
        copies: list[np.ndarray] | None = None,
    ) -> None:
        """Asks for ``index`` of ``rec`` (None: all of it), to hand to ``consume``; read
        into ``into`` where its dtype is the one read, and then, where the direct path reads
        it, into ``copies`` too (``consume``'s second argument: the replicas' buffers that
        hold the same bytes, or None)."""
        self.requests.append(_Request(store_fut, rec, index, consume, into, copies or []))

    def issue(
        self,
        reads: InFlight[Any],
        r: _Request,
        plan: chunk_plan.SliceRead | None,
        direct_reader: direct.Reader,
        mapping: bool = False,
    ) -> None:
        """Starts ``r``'s read (directly when ``plan`` says how; ``mapping``: as mappings
        of its chunk, one per copy, ``direct.Reader.map``) once it fits the budget."""
        rec, index = r.rec, r.index
        size: int = math.prod(rec.shape)
        nbytes = rec.nbytes if index is None else volume(index) * (rec.nbytes // max(1, size))

        fill = r.buffers(plan) if plan is not None and not mapping else []
        into, copies = (fill[0], fill[1:]) if fill else (None, [])

        def start() -> Any:
            if plan is not None and mapping:
                return direct_reader.map(plan, len(r.copies))
            if plan is not None:
                return direct_reader.start(plan, into, copies)
            try:
                store = r.store_fut.result()
                if index is None:
                    return store.read()
                dtype = store.dtype.numpy_dtype
                return arrays.read_slice(store, index, _fits(r.into, dtype, rec.data_dtype))
            except Exception as e:
                raise self.error(e, rec) from e

        def use(fut: Any) -> None:
            try:
                data = fut.result()
            except Exception as e:
                raise self.error(e, rec) from e
            if mapping:
                r.consume(data[0], data[1:])
            else:
                r.consume(data, copies or None)

        reads.add(nbytes, start, use)

    def error(self, e: Exception, rec: LeafRecord) -> Exception:
        if isinstance(e, direct.Corrupt):
            return arrays.checksum_error(rec.name, e.key, self.where(rec, e.key, e.at), str(e))
        if isinstance(e, StorageError):  # the direct path's own (a truncated file)
            return StorageError(f"leaf {rec.name!r}: {e}")
        return arrays.read_error(
            e, leaf=rec.name, db=self.db, writers=functools.partial(self.where, rec)
        )

    def where(self, rec: LeafRecord, key: str, at: arrays.ChunkBytes | None = None) -> str:
        """Where chunk ``key`` lives: its data file and byte range, and its writer."""
        where = saved_writers(rec, self.meshes)
        coords = key.rsplit("/c/", 1)[-1].split("/") if "/c/" in key else []
        try:
            proc = where.get(tuple(int(c) for c in coords))
        except ValueError:
            proc = None
        at = at or arrays.locate(self.db, key)  # the data file and byte range, from the B-tree
        by = "" if proc is None else f", written by process {proc}"
        if at is not None:
            return f"{at}{by}"
        if proc is None:
            return f"the OCDBT database under {self.db.url}"
        return f"the OCDBT data files of process {proc} under {self.db.url}"
