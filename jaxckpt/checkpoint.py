"""``save`` / ``restore`` / ``metadata`` of one checkpoint directory.

A save goes: flatten the tree and describe each leaf -> each process writes the shards it
owns (``arrays.write``) -> barrier -> process 0 merges the per-process databases, writes
``manifest.json``, renames the temporary directory into place and writes ``COMMITTED``.
"""

from __future__ import annotations

import collections
import datetime
import difflib
import json
import math
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import arrays, multihost
from . import tree as tree_lib
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    LeafNotFoundError,
    ManifestError,
    ShapeMismatchError,
    UnsupportedLeafError,
)
from .manifest import COMMIT_FILE, MANIFEST_FILE, LeafRecord, Manifest, array_info
from .sharding import (
    bind_spec,
    mesh_by_position,
    normalize_index,
)
from .staging import StagedLeaf, describe
from .storage import (
    OWNER_FILE,
    Location,
    hold_owner_lock,
    location,
    release_owner_lock,
    rename_dir,
)

DEFAULT_TIMEOUT_S = 600.0
READ_BUDGET_BYTES = 128 << 20  # host memory for slices read but not yet on device


# --- save ----------------------------------------------------------------------------------


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    metadata: Any = None,
    metrics: dict | None = None,
    compression: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Writes ``tree`` as one checkpoint directory at ``path``; blocks until committed.

    Every process must call it with the same tree structure. Each writes only the shards it
    owns, one replica of each. ``metadata`` is any JSON-serializable value kept in the
    manifest; ``metrics`` a dict of numbers (used by the manager to rank steps). ``tree``
    may be a handle from :func:`jaxckpt.stage`. Refuses to overwrite a committed checkpoint.

    >>> jaxckpt.save("/ckpt/run1/step_100", {"params": params, "step": 100})
    """
    loc = location(path)
    check_json(metadata, "metadata", loc)
    check_json(metrics, "metrics", loc)
    if loc.exists(COMMIT_FILE):
        raise CheckpointExistsError(
            f"{loc.url} already holds a committed checkpoint; choose a new path or delete it first"
        )
    staged = describe(tree, compression=compression)
    leaves, meshes = list(staged.leaves), staged.meshes
    _check_unique_names(leaves, loc)
    pid, count = multihost.process_index(), multihost.process_count()
    # One round before anything is written: the same path, tree, shapes and dtypes on every
    # process? Who runs where, and process 0's id for this save (temporary directory and
    # barrier names, so a restarted job never meets a stale one).
    extras = multihost.agree(
        multihost.unique_name("save"),
        _summary(loc, leaves),
        timeout_s,
        what=loc.url,
        extra=f"{multihost.host_name()} {uuid.uuid4().hex[:12]}",
    )
    hosts = [e.rsplit(" ", 1)[0] for e in extras]
    save_id = extras[0].rsplit(" ", 1)[1]
    work = loc.parent().join(f"{loc.name}.tmp-{save_id}") if loc.is_local else loc
    writes = [leaf.write for leaf in leaves if leaf.write is not None]
    owner = None
    try:
        if work == loc:
            # Object stores have no rename, so the arrays go straight to ``loc``: first clear
            # what an earlier save that never committed left there (its zarr.json would clash).
            if pid == 0 and loc.list_children():
                loc.remove()
            multihost.barrier(f"jaxckpt/{save_id}/cleared", timeout_s, what=loc.url)
        db = arrays.database_dir(work, None if count == 1 else pid)
        db.makedirs()
        if pid == 0:
            owner = hold_owner_lock(work)
        arrays.write(db, writes)
        multihost.barrier(f"jaxckpt/{save_id}/written", timeout_s, what=loc.url)
        if pid == 0:
            if count > 1:
                arrays.merge(work, count)
            manifest = _manifest(leaves, meshes, hosts, metadata, metrics)
            work.write_bytes(MANIFEST_FILE, manifest.to_json().encode(), create_dir=False)
            if work != loc:
                if os.path.exists(loc.url):  # an uncommitted leftover of an earlier crash
                    if loc.exists(COMMIT_FILE):  # ...or another save committed meanwhile
                        raise CheckpointExistsError(
                            f"{loc.url} was committed by another save while this one was "
                            "writing; nothing was overwritten. Save each checkpoint once"
                        )
                    loc.remove()
                rename_dir(work, loc)
            loc.write_bytes(COMMIT_FILE, b"", create_dir=False)
            loc.delete_file(OWNER_FILE)
        multihost.barrier(f"jaxckpt/{save_id}/committed", timeout_s, what=loc.url)
    except BaseException:
        if pid == 0 and work != loc:
            work.remove()
        raise
    finally:
        release_owner_lock(owner)


def check_json(value: Any, what: str, loc: Location) -> None:
    """Fails before anything is written if ``value`` cannot go into the manifest."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ManifestError(
            f"{loc.url}: {what} must be JSON-serializable (dicts, lists, str, int, float, bool, "
            f"None): {e}. Convert arrays with float()/int()/.tolist() first"
        ) from e


def _summary(loc: Location, leaves: list[StagedLeaf]) -> dict:
    """What every process must agree on before a multi-process save writes anything."""
    return {
        "path": loc.url,
        "leaves": len(leaves),
        "tree": [
            (r.name, r.kind, list(r.shape), r.dtype) for r in (leaf.record for leaf in leaves)
        ],
    }


def _check_unique_names(leaves: list[StagedLeaf], loc: Location) -> None:
    seen: dict[str, list] = {}
    for leaf in leaves:
        other = seen.setdefault(leaf.record.name, leaf.record.path)
        if other is not leaf.record.path:
            raise UnsupportedLeafError(
                f"{loc.url}: leaves {other} and {leaf.record.path} both map to the name "
                f"{leaf.record.name!r}; rename one of the keys"
            )


def _manifest(
    leaves: list[StagedLeaf],
    meshes: list[dict],
    hosts: list[str],
    metadata: Any,
    metrics: dict | None,
) -> Manifest:
    count = len(hosts)
    per_process = [0] * count
    for rec in (leaf.record for leaf in leaves):
        if not rec.chunk_writers:
            continue
        itemsize = rec.nbytes // math.prod(rec.shape)
        for coords, proc in rec.chunk_writers:
            extent = [
                min(c, s - i * c)
                for i, c, s in zip(coords, rec.chunk_shape, rec.shape, strict=True)
            ]
            per_process[proc] += math.prod(extent) * itemsize
    return Manifest(
        leaves=tuple(leaf.record for leaf in leaves),
        meshes=meshes,
        process_count=count,
        process_hosts=hosts,
        bytes_per_process=per_process,
        metadata=metadata,
        metrics=metrics,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        writer={
            "jaxckpt": _version(),
            "jax": jax.__version__,
            "tensorstore": _dist_version("tensorstore"),
        },
    )


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


def _version() -> str:
    from . import __version__

    return __version__


# --- reading the manifest ----------------------------------------------------------------


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
    return Manifest.from_json(text.decode(), where=f"{loc.url}/{MANIFEST_FILE}")


def metadata(path: str | os.PathLike) -> Any:
    """The tree of :class:`ArrayInfo` (shape, dtype, saved mesh and spec, bytes); no data read."""
    manifest = read_manifest(path)
    items = [(leaf.path, array_info(leaf, manifest.meshes)) for leaf in manifest.leaves]
    return tree_lib.unflatten_paths(items)


def user_metadata(path: str | os.PathLike) -> Any:
    """The ``metadata=`` value given to :func:`save`."""
    return read_manifest(path).metadata


# --- restore -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Want:
    """What one restored leaf should become."""

    record: LeafRecord
    dtype: np.dtype | None  # None: the saved dtype
    sharding: jax.sharding.Sharding | None  # None: a NumPy array


def restore(
    path: str | os.PathLike,
    target: Any = None,
    *,
    mesh: jax.sharding.Mesh | None = None,
) -> Any:
    """Reads the checkpoint at ``path`` onto the devices and shardings asked for.

    ``target`` is a pytree whose leaves are ``jax.ShapeDtypeStruct`` (with ``.sharding``),
    ``jax.Array`` (its sharding, dtype and shape), ``jax.sharding.Sharding`` or NumPy arrays;
    the result has its structure, may name fewer leaves than were saved, and casts to its
    dtypes. With ``mesh`` and no target, each leaf's saved PartitionSpec is bound to
    ``mesh`` (with a target, so is each ``ShapeDtypeStruct`` leaf without a sharding; a
    NumPy target leaf means a NumPy result). With neither, leaves come back on their saved mesh rebuilt over the current
    devices when the device count allows, else as NumPy arrays.

    >>> state = jaxckpt.restore("/ckpt/step_100", target=abstract_state)
    """
    loc = location(path)
    manifest = read_manifest(loc)
    by_name = {leaf.name: leaf for leaf in manifest.leaves}
    if target is None:
        wants = [_want_saved(rec, manifest, mesh) for rec in manifest.leaves]
    else:
        flat = tree_lib.flatten(target)
        wants = [_want_target(p, t, by_name, loc) for p, t in flat]
        if mesh is not None:  # ShapeDtypeStructs without a sharding: saved spec on ``mesh``
            wants = [
                _want_saved(w.record, manifest, mesh, dtype=w.dtype)
                if isinstance(t, jax.ShapeDtypeStruct) and t.sharding is None
                else w
                for (_, t), w in zip(flat, wants, strict=True)
            ]
    values = _read_all(loc, wants)
    if target is None:
        return tree_lib.unflatten_paths(
            [(w.record.path, v) for w, v in zip(wants, values, strict=True)]
        )
    return tree_lib.unflatten_like(target, values)


def _want_saved(rec: LeafRecord, manifest: Manifest, mesh, dtype=None) -> _Want:
    if not rec.has_array:
        return _Want(rec, None, None)
    sharding = None
    sj = rec.sharding or {}
    if sj.get("type") == "named":
        saved_mesh = manifest.meshes[sj["mesh"]]
        bound = mesh if mesh is not None else mesh_by_position(saved_mesh)
        if bound is not None:
            sharding = bind_spec(sj["spec"], bound, leaf=rec.name, shape=tuple(rec.shape))
    elif sj.get("type") == "single_device":
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    return _Want(rec, dtype, sharding)


def _want_target(path: list, t: Any, by_name: dict[str, LeafRecord], loc: Location) -> _Want:
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
        return _Want(rec, None, None)
    if isinstance(t, jax.sharding.Sharding):
        return _Want(rec, None, t)
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
        return _Want(rec, np.dtype(t.dtype) if rec.kind != "prng_key" else None, sharding)
    return _Want(rec, None, None)


def _read_all(loc: Location, wants: list[_Want]) -> list[Any]:
    db = arrays.database_dir(loc, None)
    ctx = arrays.new_context()
    stores = {
        w.record.name: arrays.open_leaf(db, w.record.name, ctx)
        for w in wants
        if w.record.has_array and math.prod(w.record.shape)
    }
    reader = _BoundedReader(db, READ_BUDGET_BYTES)
    finishers: list[Callable[[], Any]] = []
    try:
        for w in wants:
            rec = w.record
            if not rec.has_array:
                finishers.append(lambda rec=rec: rec.value)
                continue
            finishers.append(_plan_leaf(w, stores.get(rec.name), reader))
        reader.drain()
    finally:
        reader.close()  # also on errors: no placing thread outlives the call
    return [f() for f in finishers]


def _plan_leaf(w: _Want, store_fut, reader: _BoundedReader) -> Callable[[], Any]:
    rec = w.record
    shape = tuple(rec.shape)
    saved = jax.numpy.dtype(rec.dtype) if rec.kind != "prng_key" else np.dtype(np.uint32)
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

    index_map = w.sharding.addressable_devices_indices_map(shape)
    by_index: dict[tuple, list] = {}
    for device, index in index_map.items():
        by_index.setdefault(normalize_index(index, shape), []).append(device)
    placed: dict = {}

    def put(index, data):
        # The first device may adopt the read buffer (zero-copy on CPU when aligned); the
        # replicas are device-to-device copies of it, so no two devices share memory.
        first, *rest = by_index[index]
        placed[first] = jax.device_put(data, first, may_alias=True)
        for device in rest:
            placed[device] = jax.device_put(placed[first], device)

    for index in by_index:
        if store_fut is None or not math.prod(b - a for a, b in index):
            put(index, np.zeros(tuple(b - a for a, b in index), want_dtype))
        else:
            reader.submit(store_fut, rec, index, lambda d, i=index: put(i, convert(d)))

    def finish_sharded() -> jax.Array:
        singles = [placed[d] for d in index_map]
        return jax.make_array_from_single_device_arrays(shape, w.sharding, singles)

    return finish_sharded


def place_key(data: np.ndarray, w: _Want, rec: LeafRecord) -> jax.Array:
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

    def __init__(self, db: Location, budget: int):
        self.db, self.budget = db, budget
        self.reads: collections.deque = collections.deque()
        self.placing: collections.deque = collections.deque()
        self.bytes = 0
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
            where = {tuple(c): p for c, p in rec.chunk_writers or []}
            coords = key.rsplit("/c/", 1)[-1].split("/") if "/c/" in key else []
            try:
                proc = where.get(tuple(int(c) for c in coords))
            except ValueError:
                proc = None
            if proc is None:
                return f"the OCDBT database under {self.db.url}"
            return f"the OCDBT data files of process {proc} under {self.db.url}"

        return arrays.read_error(e, leaf=rec.name, db=self.db, writers=writers)
