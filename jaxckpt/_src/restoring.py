"""``restore``: reading a committed checkpoint onto the devices and shardings asked for.

A restore goes: the manifest (``readers.any_manifest``: jaxckpt's, or an Orbax checkpoint's)
-> one ``Want`` per leaf (``wants``) -> leaves that devices on several hosts need are read
once with a finer sharding and moved afterwards (``read_once``) -> each leaf's slices, one
per distinct device index, are read under a byte budget (``inflight.InFlight``) while two
threads copy them onto their devices (``placement.Placement``; CPU devices adopt a leaf's
slices together, no thread needed; an accelerator's slices are read into the process's
reused host ring, ``ring``, and copied onto it from there) -> the tree (``result``).
The reads themselves are the storage engine's (``io.slices.read``, the one way slices are
read, the emergency tier's too).
(Named ``restoring`` so that ``jaxckpt.restore`` stays the function, unshadowed.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ..errors import OptionsError
from . import gc_pause, multihost, read_once, ring
from .boxes import Index, extent, volume, whole
from .io import arrays, direct, slices
from .io.inflight import STALL_TIMEOUT_S, Stall, default_budget
from .leaf_plan import Want, result, wants, whole_on_host
from .manifest import LeafRecord, Manifest
from .monitoring import Stopwatch
from .orbax import checkpoint as orbax
from .placement import Placement, adopts
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
    timeout_s: float = 600.0,
    stall_timeout_s: float = STALL_TIMEOUT_S,
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
    restore faster. Peak host memory is about the result plus the budget (a chunk that
    several slices need a part of is read once for those in its group, never kept).
    Onto accelerators the slices are read into a host ring of the budget's size, page-locked
    and kept for the life of the process so that later restores reuse it (docs/GPU.md).

    ``stall_timeout_s``: a read that makes no progress this long (a hung mount, an object
    store that holds back an answer) fails the restore with ``ReadStalledError`` naming
    this process, its host, the file or object and how long it waited. In a job of several
    processes, each waits for the others after its reads, at most ``timeout_s``; a
    process whose reads failed tells them, so they fail at once with a CoordinationError
    naming it (and a process that never arrives is named at ``timeout_s``).

    >>> state = jaxckpt.restore("/ckpt/step_100", target=abstract_state)
    """
    loc = location(path)
    if read_budget_bytes is not None and read_budget_bytes < 1:
        raise OptionsError(
            f"{loc.url}: read_budget_bytes={read_budget_bytes!r}; pass None or a positive size"
        )
    if not (timeout_s > 0 and stall_timeout_s > 0):
        raise OptionsError(
            f"{loc.url}: timeout_s={timeout_s!r}, stall_timeout_s={stall_timeout_s!r}; both "
            "must be positive numbers of seconds"
        )
    fig = Stopwatch("restore", loc.url)
    with gc_pause.paused():  # hundreds of collections over every live object otherwise
        with fig.phase("plan"):
            source, manifest = any_manifest(loc)
            planned = wants(manifest.leaves, manifest.meshes, target, mesh, loc)
            reading, moves = _read_shardings(loc, planned)
        stall, group = Stall(stall_timeout_s, _who()), _group(planned)
        name = _barrier_name(group)
        # and onto the devices (the two overlap); then wait for the others (a failure here
        # is told to them: they fail at once, naming this process)
        with (
            fig.phase("read"),
            multihost.together(name, timeout_s, what=loc.url, processes=group, then=THEN),
        ):
            values = _read_all(loc, reading, read_budget_bytes, manifest, source, fig, stall)
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
    budget: int | None,
    manifest: Manifest,
    source: orbax.OrbaxCheckpoint | None,
    fig: Stopwatch,
    stall: Stall,
) -> list[Any]:
    """Every leaf, each distinct slice this process needs read once (``slices.read``), at
    most ``budget`` bytes read but not yet on a device (None: the front door's default);
    two threads place them."""
    ctx = arrays.new_context()
    opener: Callable[[str], Any]
    if source is None:
        db = arrays.database_dir(loc, None)
        opener = functools.partial(arrays.open_leaf, db, ctx=ctx)
    else:  # an Orbax checkpoint: its own layout, the same reads
        db, opener = source.item, source.opener(ctx)
    budget = budget or default_budget(direct.reader_threads())
    devices = {d for w in reading if w.sharding is not None for d in w.sharding.device_set}
    with ring.for_restore(budget, devices) as host:
        requests: list[slices.Request] = []
        finishers = [_plan_leaf(w, requests, host) for w in reading]
        fig.bytes += slices.read(
            db,
            requests,
            opener,
            budget=budget,
            use_threads=0 if adopts(devices) else _place_threads(),
            direct_ok=source is None,
            writer=functools.partial(_writer, manifest.meshes),
            stall=stall,
        )
        return [f() for f in finishers]


THEN = "Nothing was restored; fix what the failed process names, then restart the job"
_restores: collections.Counter[tuple[int, ...]] = collections.Counter()


def _group(planned: list[Want]) -> list[int]:
    """The processes whose devices hold leaves of this restore that span several processes
    (each of them restores too, and waits for the others after its reads); [] where there
    are none, or this process holds none of them."""
    group = {
        d.process_index  # type: ignore[attr-defined]
        for w in planned
        if w.sharding is not None and not w.sharding.is_fully_addressable
        for d in w.sharding.device_set
    }
    return sorted(group) if multihost.process_index() in group else []


def _barrier_name(group: list[int]) -> str:
    """The same name on every process of ``group`` for its n-th restore together."""
    _restores[tuple(group)] += 1
    digest = hashlib.sha256(repr(group).encode()).hexdigest()[:12]
    return f"jaxckpt/restore/{digest}/{_restores[tuple(group)]}"


def _who() -> str:
    """This process, for a stalled read's error."""
    count = multihost.process_count()
    where = f"host {multihost.host_name()}"
    return f"process {multihost.process_index()} of {count} ({where})"


def _writer(meshes: list[dict], rec: LeafRecord, coords: tuple[int, ...]) -> int | None:
    """The process that wrote the chunk at ``coords`` of ``rec`` (for errors)."""
    return saved_writers(rec, meshes).get(coords)


def _place_threads() -> int:
    """Threads that put read slices onto devices that copy them: 2, or 1 on a host of 2
    cores or fewer (there the readers need the cores). (Where every leaf goes to CPU
    devices that adopt its slices, the caller uses none: ``Placement`` only sets a slice
    aside there, and a hand-over to a thread cost more.)"""
    return 1 if (os.cpu_count() or 1) <= 2 else 2


def _plan_leaf(
    w: Want, requests: list[slices.Request], host: ring.Ring | None
) -> Callable[[], Any]:
    """Adds the reads of one leaf to ``requests``; returns what gives its value once they
    are done. ``host``: the ring that slices going to devices that copy them are read into
    (each slot given back once its copy is under way: ``ring.Ring.give_back``)."""
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

        if not rec.nbytes:
            holder["v"] = np.zeros(shape, saved)
        else:
            requests.append(slices.Request(rec, whole(shape), keep))

        return lambda: whole_on_host(w, holder["v"])

    out = Placement(w.sharding, shape, want_dtype)
    viewed = np.dtype(want_dtype) == saved  # convert gives a view of the bytes read: no cast

    def place(index: Index, data: np.ndarray, replicas: Sequence[np.ndarray] | None) -> None:
        value = convert(data)
        given = [convert(r) for r in replicas] if viewed and replicas else None
        if host is None:
            out.put(index, value, given)
        else:  # a slice in the ring: copied out, then its slot reused
            host.give_back(data, out.put(index, value, given, borrowed=host.holds(data)))

    for index in out.indices:
        if not rec.nbytes or not volume(index):
            out.put(index, np.zeros(extent(index), want_dtype))
            continue
        # read straight into the array's own memory where it has some (CPU devices), or
        # as mappings of the chunks that become it
        into, copies = out.host_buffer(index), out.replica_buffers(index)
        maps = None if into is None else len(copies)  # (a buffer only where devices adopt)
        stage = out.stage(index) or (host.take if host is not None and into is None else None)
        requests.append(
            slices.Request(
                rec, index, functools.partial(place, index), into, copies, maps, stage=stage
            )
        )
    return out.array
