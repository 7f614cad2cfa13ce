"""``restore``: reading a committed checkpoint onto the devices and shardings asked for.

A restore goes: ``read_manifest`` -> one :class:`Want` per leaf (``wants``: the saved record,
the dtype and the sharding it should come back with), from the target (``want_target``) or
from the saved specs (``want_saved``) -> each leaf's slices, one per distinct device index, are read
through a bounded reader (at most ``READ_BUDGET_BYTES`` read but not yet on a device) while
two threads copy them onto their devices -> the arrays are assembled into the tree
(``result``).

``wants``, ``result``, ``Want`` and ``place_key`` are also used to restore from local copies
(:mod:`jaxckpt._src.emergency.restore`, :mod:`jaxckpt._src.emergency.recovery`). (Named ``restoring`` so
that ``jaxckpt.restore`` stays the function, unshadowed.)
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import functools
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..errors import (
    CheckpointNotFoundError,
    LeafNotFoundError,
    OptionsError,
    ShapeMismatchError,
    ShardingError,
)
from . import arrays, multihost, orbax, read_once
from . import tree as tree_lib
from .manifest import COMMIT_FILE, MANIFEST_FILE, LeafRecord, Manifest
from .monitoring import Figures
from .placement import Placement
from .sharding import bind_spec, mesh_by_position, saved_writers
from .storage import Location, location

READ_BUDGET_BYTES = 128 << 20  # host memory for slices read but not yet on device
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

    ``read_budget_bytes`` (default ``READ_BUDGET_BYTES``, 128 MiB) bounds the host memory of
    slices read but not yet on their devices; reads within it run concurrently, so a larger
    budget can restore faster. Peak host memory is about the result plus the budget.

    >>> state = jaxckpt.restore("/ckpt/step_100", target=abstract_state)
    """
    loc = location(path)
    if read_budget_bytes is not None and read_budget_bytes < 1:
        raise OptionsError(
            f"{loc.url}: read_budget_bytes={read_budget_bytes!r}; pass None or a positive size"
        )
    fig = Figures("restore", loc.url)
    with fig.phase("plan"):
        source, manifest = any_manifest(loc)
        planned = wants(manifest.leaves, manifest.meshes, target, mesh, loc)
    budget = read_budget_bytes or READ_BUDGET_BYTES
    values = _read_once(loc, planned, budget, manifest.meshes, fig, source)
    fig.done()
    return result(target, planned, values)


def wants(
    leaves: Sequence[LeafRecord], meshes: list[dict], target: Any, mesh, loc: Location
) -> list[Want]:
    """What each leaf should become: the target's leaves (a ``ShapeDtypeStruct`` without a
    sharding takes its saved spec on ``mesh``), or every saved leaf on its saved spec."""
    try:
        if target is None:
            return [want_saved(rec, meshes, mesh) for rec in leaves]
        by_name = {leaf.name: leaf for leaf in leaves}
        flat = tree_lib.flatten(target)
        out = [want_target(p, t, by_name, loc) for p, t in flat]
        if mesh is None:
            return out
        return [
            want_saved(w.record, meshes, mesh, dtype=w.dtype)
            if isinstance(t, jax.ShapeDtypeStruct) and t.sharding is None
            else w
            for (_, t), w in zip(flat, out, strict=True)
        ]
    except ShardingError as e:  # bind_spec knows the leaf, not the path
        raise ShardingError(f"{loc.url}: {e}") from e


def result(target: Any, planned: list[Want], values: list[Any]) -> Any:
    """The restored tree: the target's structure, or the saved paths without a target."""
    if target is None:
        return tree_lib.unflatten_paths(
            [(w.record.path, v) for w, v in zip(planned, values, strict=True)]
        )
    return tree_lib.unflatten_like(target, values)


def any_manifest(loc: Location) -> tuple[orbax.OrbaxCheckpoint | None, Manifest]:
    """jaxckpt's manifest, or an Orbax checkpoint described as one (``jaxckpt._src.orbax``)."""
    item = orbax.item_dir(loc)
    if item is None:
        return None, read_manifest(loc)
    source = orbax.read(item)
    return source, source.manifest


def read_manifest(path: str | os.PathLike | Location) -> Manifest:
    """The manifest of the committed checkpoint at ``path``."""
    loc = location(path)
    if not loc.exists(COMMIT_FILE):
        why = (
            "its save never finished (no COMMITTED marker)"
            if loc.exists(MANIFEST_FILE) or loc.list_children()
            else "nothing is there"
        )
        raise CheckpointNotFoundError(
            f"{loc.url} is not a committed jaxckpt checkpoint: {why}; pass the directory "
            "that jaxckpt.save wrote, or a manager's step directory"
        )
    text = loc.read_bytes(MANIFEST_FILE)
    if text is None:
        raise CheckpointNotFoundError(f"{loc.url}: COMMITTED but {MANIFEST_FILE} is missing")
    return Manifest.from_json(text, where=f"{loc.url}/{MANIFEST_FILE}")


# --- what each leaf should become ----------------------------------------------------------


@dataclass(frozen=True)
class Want:
    """What one restored leaf should become."""

    record: LeafRecord
    dtype: np.dtype | None  # None: the saved dtype
    sharding: jax.sharding.Sharding | None  # None: a NumPy array


def want_saved(rec: LeafRecord, meshes: list[dict], mesh, dtype=None) -> Want:
    """``rec`` with its saved spec bound to ``mesh`` (default: the saved mesh, if it fits)."""
    if not rec.has_array:
        return Want(rec, None, None)
    sharding = None
    sj = rec.sharding or {}
    if sj.get("type") == "named":
        bound = mesh if mesh is not None else mesh_by_position(meshes[sj["mesh"]])
        if bound is not None:
            sharding = bind_spec(sj["spec"], bound, leaf=rec.name, shape=tuple(rec.shape))
    elif sj.get("type") == "single_device":
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return Want(rec, dtype, sharding)


def want_target(path: list, t: Any, by_name: dict[str, LeafRecord], loc: Location) -> Want:
    """The saved leaf at ``path`` as the target leaf ``t`` asks for (sharding, dtype)."""
    name = tree_lib.path_name(path)
    rec = by_name.get(name)
    if rec is None:
        close = difflib.get_close_matches(name, list(by_name), n=3)
        raise LeafNotFoundError(
            f"{loc.url}: the restore target has leaf {name!r}, which the checkpoint does not "
            f"hold (closest saved leaves: {close or list(by_name)[:3]}); remove it from the "
            "target or restore it from another checkpoint"
        )
    if not rec.has_array:
        return Want(rec, None, None)
    if isinstance(t, jax.sharding.Sharding):
        return Want(rec, None, t)
    if isinstance(t, (jax.ShapeDtypeStruct, jax.Array, np.ndarray)):
        saved_shape = (
            tuple(rec.shape)[: len(t.shape)] if rec.kind == "prng_key" else tuple(rec.shape)
        )
        if tuple(t.shape) != saved_shape:
            raise ShapeMismatchError(
                f"{loc.url}: leaf {name!r} was saved with shape {tuple(rec.shape)} but the "
                f"target asks for {tuple(t.shape)}; fix the target's shape (jaxckpt.metadata "
                "shows the saved one)"
            )
        sharding = None if isinstance(t, np.ndarray) else getattr(t, "sharding", None)
        return Want(rec, np.dtype(t.dtype) if rec.kind != "prng_key" else None, sharding)
    return Want(rec, None, None)


# --- reading slices and placing them on devices --------------------------------------------


def _read_once(
    loc: Location,
    wants: list[Want],
    budget: int,
    meshes: list[dict],
    fig: Figures,
    source: orbax.OrbaxCheckpoint | None,
) -> list[Any]:
    """``_read_all``, with leaves that processes share read once and moved (``read_once``)."""
    moves: dict[int, jax.sharding.Sharding] = {}
    wants = list(wants)
    shared = [
        i
        for i, w in enumerate(wants)
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
        w, rec = wants[i], wants[i].record
        rs = read_once.read_sharding(w.sharding, tuple(rec.shape), tuple(rec.chunk_shape), hosts)
        if rs is not None:
            moves[i], wants[i] = w.sharding, dataclasses.replace(w, sharding=rs)
    with fig.phase("read"):  # and onto the devices: the two overlap
        values = _read_all(loc, wants, budget, meshes, fig, source)
    with fig.phase("move"):
        moved = read_once.move([values[i] for i in moves], list(moves.values()))
    for i, v in zip(moves, moved, strict=True):
        values[i] = v
    return values


def _read_all(
    loc: Location,
    wants: list[Want],
    budget: int,
    meshes: list[dict],
    fig: Figures,
    source: orbax.OrbaxCheckpoint | None,
) -> list[Any]:
    ctx = arrays.new_context()
    if source is None:
        db = arrays.database_dir(loc, None)
        opener = functools.partial(arrays.open_leaf, db, ctx=ctx)
    else:  # an Orbax checkpoint: its own layout, the same reads
        db, opener = source.item, source.opener(ctx)
    stores = {
        w.record.name: opener(w.record.name)
        for w in wants
        if w.record.has_array and math.prod(w.record.shape)
    }
    reader = _BoundedReader(db, budget, meshes)
    finishers: list[Callable[[], Any]] = []
    try:
        for w in wants:
            if w.record.has_array:
                finishers.append(_plan_leaf(w, stores.get(w.record.name), reader))
            else:
                finishers.append(lambda rec=w.record: rec.value)
        reader.drain()
        fig.bytes += reader.total
    finally:
        reader.close()  # also on errors: no placing thread outlives the call
    return [f() for f in finishers]


def _plan_leaf(w: Want, store_fut, reader: _BoundedReader) -> Callable[[], Any]:
    rec = w.record
    shape = tuple(rec.shape)
    saved = rec.data_dtype
    want_dtype = w.dtype or saved

    def convert(data: np.ndarray) -> np.ndarray:
        if data.dtype != saved:
            data = data.view(saved)
        return data if data.dtype == want_dtype else data.astype(want_dtype)

    if rec.kind == "prng_key" or w.sharding is None:
        # Whole leaf on the host (NumPy results; PRNG keys are small and re-wrapped).
        holder: dict = {}
        if store_fut is None:
            holder["v"] = np.zeros(shape, saved)
        else:
            reader.submit(store_fut, rec, None, lambda d: holder.__setitem__("v", convert(d)))

        def finish() -> Any:
            data = holder["v"]
            if rec.kind == "prng_key":
                if w.sharding is None:
                    return jax.random.wrap_key_data(data, impl=rec.prng_impl)
                return place_key(data, w, rec)
            if rec.kind == "numpy" and rec.scalar:
                return data[()]
            return data

        return finish

    out = Placement(w.sharding, shape, want_dtype)
    for index in out.indices:
        if store_fut is None or not math.prod(b - a for a, b in index):
            out.put(index, np.zeros(tuple(b - a for a, b in index), want_dtype))
        else:
            reader.submit(store_fut, rec, index, lambda d, i=index: out.put(i, convert(d)))
    return out.array


def place_key(data: np.ndarray, w: Want, rec: LeafRecord) -> jax.Array:
    """A typed PRNG key from its key data, on ``w.sharding`` (which may span processes)."""
    s = w.sharding
    ndim = data.ndim - 1 if data.ndim else 0  # key data has one more (impl) dimension
    if isinstance(s, jax.sharding.NamedSharding) and len(s.spec) > ndim:
        s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[:ndim]))
    if isinstance(s, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
        arr = jax.make_array_from_callback(data.shape, s, lambda i: data[i])
        return jax.random.wrap_key_data(arr, impl=rec.prng_impl)
    return jax.device_put(jax.random.wrap_key_data(data, impl=rec.prng_impl), s)


class _BoundedReader:
    """Issues slice reads, keeping at most ``budget`` bytes read but not yet on a device.

    Slices read are handed to two threads that copy them onto their devices, so reading
    and the host->device copies overlap.
    """

    def __init__(self, db: Location, budget: int, meshes: list[dict]):
        self.db, self.budget, self.meshes = db, budget, meshes
        self.reads: collections.deque = collections.deque()
        self.placing: collections.deque = collections.deque()
        self.bytes = 0
        self.total = 0  # bytes read, for the figures
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="jaxckpt-restore")

    def submit(self, store_fut, rec: LeafRecord, index, consume) -> None:
        itemsize = rec.nbytes // max(1, math.prod(rec.shape))
        nbytes = rec.nbytes if index is None else math.prod(b - a for a, b in index) * itemsize
        while self.bytes + nbytes > self.budget and (self.reads or self.placing):
            self._advance()
        try:
            store = store_fut.result()
            fut = store.read() if index is None else arrays.read_slice(store, index)
        except Exception as e:
            raise self._error(e, rec) from e
        self.reads.append((fut, rec, consume, nbytes))
        self.bytes += nbytes
        self.total += nbytes

    def _advance(self) -> None:
        """Hands the oldest read to a placing thread, or waits for the oldest placement."""
        if self.reads and len(self.placing) < 2:
            fut, rec, consume, nbytes = self.reads.popleft()
            try:
                data = fut.result()
            except Exception as e:
                raise self._error(e, rec) from e
            self.placing.append((self.pool.submit(consume, data), nbytes))
        else:
            done, nbytes = self.placing.popleft()
            done.result()
            self.bytes -= nbytes

    def drain(self) -> None:
        while self.reads or self.placing:
            self._advance()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        arrays.release_free_memory()

    def _error(self, e: Exception, rec: LeafRecord) -> Exception:
        def writers(key: str) -> str:
            where = saved_writers(rec, self.meshes)
            coords = key.rsplit("/c/", 1)[-1].split("/") if "/c/" in key else []
            try:
                proc = where.get(tuple(int(c) for c in coords))
            except ValueError:
                proc = None
            at = arrays.locate(self.db, key)  # the data file and byte range, from the B-tree
            by = "" if proc is None else f", written by process {proc}"
            if at is not None:
                return f"{at}{by}"
            if proc is None:
                return f"the OCDBT database under {self.db.url}"
            return f"the OCDBT data files of process {proc} under {self.db.url}"

        return arrays.read_error(e, leaf=rec.name, db=self.db, writers=writers)
