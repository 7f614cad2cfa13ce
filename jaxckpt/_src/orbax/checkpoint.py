"""Reading checkpoints written by orbax-checkpoint, with TensorStore alone (no orbax import).

``jaxckpt.restore`` and ``jaxckpt.metadata`` call :func:`read` when a path holds an Orbax
checkpoint: a ``StandardSave``/``PyTreeSave`` item directory (``_METADATA``), or a manager's
step directory holding one item. Its ``_METADATA`` (the tree: key paths and value types),
``_sharding`` (each leaf's sharding, keyed by the base64 of its name), the arrays' zarr
metadata and, for leaves Orbax aggregated (``skip_deserialize``), the msgpack ``checkpoint``
file become a jaxckpt :class:`Manifest`, so the restore onto any mesh, device count or as
NumPy is jaxckpt's own. Covered (docs/ORBAX.md, tests/golden/orbax): orbax-checkpoint 0.5 to
0.12, OCDBT (one process or several) and per-array directories, zarr v2 and v3,
``jax.Array``, ``np.ndarray`` and scalar leaves. Every file is read as untrusted input
(``files``): what cannot be read is refused with an :class:`OrbaxFormatError` naming
the file, never restored in part.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts

from ...errors import CheckpointNotFoundError, OrbaxFormatError
from .. import tree as tree_lib
from ..fields import MAX_NDIM, MAX_PROCESSES
from ..manifest import AXIS_TYPES, COMMIT_FILE, MANIFEST_FILE, LeafRecord, Manifest
from ..storage import Location
from . import files as files
from .files import AGGREGATE, CHECKPOINT_METADATA, METADATA, SHARDING, Where

_KINDS = {"jax.Array": "array", "np.ndarray": "numpy", "scalar": "python", "None": "none"}


@dataclass(frozen=True)
class OrbaxCheckpoint:
    """An Orbax item directory as jaxckpt reads it."""

    item: Location
    manifest: Manifest
    use_ocdbt: bool
    zarr3: bool
    keys: dict[str, str]  # a leaf's jaxckpt name -> its Orbax name (keys joined by ".")
    inline: dict[str, np.ndarray] = field(default_factory=dict)  # aggregated (msgpack) leaves
    complete: bool = False  # every chunk stored (0.11+): a missing one is an error, not zeros

    def kvstore(self) -> dict:
        """The item's keys: its OCDBT database, or (``use_ocdbt=False``) its directory."""
        base = self.item.kvstore()
        return {"driver": "ocdbt", "base": base} if self.use_ocdbt else base

    def spec(self, name: str) -> dict:
        driver = "zarr3" if self.zarr3 else "zarr"
        spec = {"driver": driver, "kvstore": self.kvstore(), "path": name + "/"}
        return {**spec, "fill_missing_data_reads": False} if self.complete else spec

    def opener(self, ctx: ts.Context) -> Callable[[str], ts.Future]:
        """Opens a leaf by its jaxckpt name (an aggregated leaf: its array in memory)."""

        def open_leaf(name: str) -> ts.Future:
            promise: ts.Promise[ts.TensorStore]
            future: ts.Future[ts.TensorStore]
            promise, future = ts.Promise.new()
            if name in self.inline:
                promise.set_result(ts.array(self.inline[name]))
                return future
            key = f"{self.keys[name]}/{'zarr.json' if self.zarr3 else '.zarray'}"
            opening = ts.open({**self.spec(self.keys[name]), "open": True}, context=ctx, read=True)

            def done(f: ts.Future) -> None:
                try:
                    promise.set_result(f.result())
                except Exception as e:  # TensorStore's: the metadata it checks, we did not
                    promise.set_exception(
                        OrbaxFormatError(
                            f"{self.item.url}/{key}: leaf {name!r} cannot be opened ({e}); "
                            "the file is damaged: restore it with orbax or re-save it"
                        )
                    )

            opening.add_done_callback(done)
            return future

        return open_leaf


def item_dir(loc: Location) -> Location | None:
    """The Orbax item directory at ``loc`` (itself, or a manager step's single item), or
    None when ``loc`` is not an Orbax checkpoint."""
    if loc.exists(MANIFEST_FILE) or loc.exists(COMMIT_FILE):
        return None
    if loc.exists(METADATA):
        return loc
    if ".orbax-checkpoint-tmp" in loc.name:
        raise CheckpointNotFoundError(
            f"{loc.url} is an Orbax save that never finished (Orbax renames the directory "
            "when it commits); restore a finished step"
        )
    children = loc.list_children()
    items = [n for n in children if loc.join(n).exists(METADATA)]
    steps = sorted((n for n in children if n.isdigit()), key=int)
    if items and all(n.isdigit() for n in items):  # numbered saves: steps, not items
        items = []
    if len(items) == 1:  # a step (orbax 0.5 wrote no _CHECKPOINT_METADATA) with one item
        return loc.join(items[0])
    if not items and steps and _is_orbax_step(loc.join(steps[-1])):
        raise OrbaxFormatError(
            f"{loc.url} is an Orbax CheckpointManager directory (steps {steps[:3]}"
            f"{'...' if len(steps) > 3 else ''}), not one checkpoint: pass a step directory, "
            f"e.g. {loc.join(steps[-1]).url}"
        )
    if items or loc.exists(CHECKPOINT_METADATA):
        raise OrbaxFormatError(
            f"{loc.url} is an Orbax step with items {items}; jaxckpt reads one item at a time: "
            "pass the item's directory (e.g. f'{step_dir}/state')"
        )
    if loc.exists(AGGREGATE):
        raise OrbaxFormatError(
            f"{loc.url} holds a msgpack '{AGGREGATE}' file and no {METADATA}: a checkpoint "
            "of orbax-checkpoint before 0.4 or flax.training.checkpoints, which jaxckpt does "
            "not read; restore it with flax and re-save it"
        )
    return None


def _is_orbax_step(step: Location) -> bool:
    if step.exists(CHECKPOINT_METADATA) or step.exists(METADATA):  # a step, or a saved item
        return True
    return any(step.join(n).exists(METADATA) for n in step.list_children())


def read(item: Location) -> OrbaxCheckpoint:
    """The checkpoint in the Orbax item directory ``item``, described as a jaxckpt manifest."""
    where = Where(item)
    raw = files.read_file(where, METADATA)
    if raw is None:
        raise CheckpointNotFoundError(f"{item.url} holds no Orbax {METADATA}")
    doc = files.parse_json(where, METADATA, raw)
    where = Where(item, doc)
    if not isinstance(doc, dict):
        raise where.error(METADATA, "is not a JSON object")
    use_ocdbt = doc.get("use_ocdbt", item.exists("manifest.ocdbt"))
    zarr3 = doc.get("use_zarr3", False)
    if not isinstance(use_ocdbt, bool) or not isinstance(zarr3, bool):
        raise where.error(METADATA, "has a use_ocdbt or use_zarr3 that is not true/false")
    raw = files.read_file(where, SHARDING)
    shardings = {} if raw is None else files.parse_json(where, SHARDING, raw) or {}
    if not isinstance(shardings, dict):
        raise where.error(SHARDING, "is not a JSON object")
    entries = files.entries(where, doc, use_ocdbt)
    named = {_b64(e.name, f) for e in entries for f in (0, 1)}
    stray = [k for k in shardings if k not in named]
    if stray:
        raise where.error(SHARDING, f"lists {stray[:3]}, which {METADATA} does not list")
    # {} when no leaf is aggregated: then nothing looks into it
    aggregate = files.read_aggregate(where) if any(e.aggregated for e in entries) else {}
    complete = doc.get("store_array_data_equal_to_fill_value") is True
    ckpt = OrbaxCheckpoint(item, Manifest((), [], 1, []), use_ocdbt, zarr3, {}, {}, complete)
    try:
        kv = ts.KvStore.open(ckpt.kvstore()).result()
    except Exception as exc:  # TensorStore raises ValueError/OSError for a bad database
        raise where.error("manifest.ocdbt", f"cannot be opened ({exc})") from exc
    meshes: list[dict] = []
    keys: dict[str, str] = {}
    inline: dict[str, np.ndarray] = {}
    leaves: list[LeafRecord] = []
    for e in entries:
        ours = tree_lib.path_name(e.path)
        if ours in keys:
            raise where.error(METADATA, f"leaves {keys[ours]!r} and {e.name!r} share a path")
        keys[ours] = e.name
        kind = _KINDS.get(e.value_type)
        if kind is None:
            raise where.error(
                METADATA,
                f"leaf {e.name!r} has Orbax value type {e.value_type!r}, which jaxckpt does "
                f"not read (it reads {sorted(_KINDS)})",
                "restore it with orbax",
            )
        if kind == "none":  # an empty node (optax's EmptyState, a None field)
            leaves.append(_python(e.path, ours, None))
            continue
        if e.aggregated:
            value = files.aggregated_value(where, aggregate, e)
            if kind == "python":
                if isinstance(value, np.ndarray) and value.size != 1:
                    raise where.error(AGGREGATE, f"scalar leaf {e.name!r} has shape {value.shape}")
                value = np.asarray(value).reshape(()).item() if _numpy(value) else value
                leaves.append(_python(e.path, ours, value))
                continue
            if not _numpy(value):  # Orbax packs every array (jax's too) as an ndarray
                raise where.error(
                    AGGREGATE, f"leaf {e.name!r} is a {e.value_type} but holds {repr(value)[:40]}"
                )
            value = inline[ours] = np.asarray(value)
            shape, dtype, chunks = value.shape, value.dtype, tuple(max(1, d) for d in value.shape)
        else:
            shape, dtype, chunks = files.zarr_layout(where, kv, e.name, zarr3, use_ocdbt)
        if kind == "python":  # a scalar: read now, restored as a Python number
            leaves.append(_python(e.path, ours, _scalar(where, ckpt, e.name, shape)))
            continue
        leaves.append(
            LeafRecord(
                path=e.path,
                name=ours,
                kind=kind,
                shape=list(shape),
                dtype=str(dtype),
                sharding=_sharding(where, shardings, e.name, meshes) if kind == "array" else None,
                chunk_shape=list(chunks),
                nbytes=math.prod(shape) * dtype.itemsize,
                chunk_writers=[],  # Orbax records no chunk's writer
            )
        )
    manifest = Manifest(
        leaves=tuple(leaves),
        meshes=meshes,
        process_count=1,
        bytes_per_process=[sum(r.nbytes for r in leaves)],
        metadata=doc.get("custom_metadata"),
        writer={"orbax": "?"},  # Orbax records no version
    )
    return OrbaxCheckpoint(item, manifest, use_ocdbt, zarr3, keys, inline, complete)


def _numpy(value: Any) -> bool:
    return isinstance(value, (np.ndarray, np.generic))


def _python(path: list, name: str, value: Any) -> LeafRecord:
    return LeafRecord(path, name, "python", value=value, python_type=type(value).__name__)


def _b64(name: str, urlsafe: int) -> str:
    return (base64.urlsafe_b64encode if urlsafe else base64.b64encode)(name.encode()).decode()


def _scalar(where: Where, ckpt: OrbaxCheckpoint, name: str, shape: tuple[int, ...]) -> Any:
    key = f"{name}/{'zarr.json' if ckpt.zarr3 else '.zarray'}"
    if math.prod(shape) != 1:
        raise where.error(key, f"leaf {name!r} is a scalar in _METADATA but has shape {shape}")
    try:
        data = ts.open({**ckpt.spec(name), "open": True}).result().read().result()
    except Exception as e:  # TensorStore's errors: ValueError, OSError, ...
        raise where.error(key, f"scalar leaf {name!r} cannot be read ({e})") from e
    return np.asarray(data).reshape(()).item()


def _sharding(where: Where, shardings: dict, name: str, meshes: list[dict]) -> dict | None:
    raw = shardings.get(_b64(name, 1)) or shardings.get(_b64(name, 0))
    if raw is None:
        return None
    try:
        s = json.loads(raw) if isinstance(raw, str) else None
    except (ValueError, RecursionError):
        s = None
    if not isinstance(s, dict):
        raise where.error(SHARDING, f"leaf {name!r}: its entry is not a JSON object")
    kind = s.get("sharding_type")
    if kind == "NamedSharding":
        mesh = _mesh(where, name, s)
        if mesh not in meshes:
            meshes.append(mesh)
        return {"type": "named", "mesh": meshes.index(mesh), "spec": _spec(where, name, s, mesh)}
    if kind == "SingleDeviceSharding":
        return {"type": "single_device", "device_id": 0}
    return {"type": "other", "repr": str(kind)}


def _mesh(where: Where, name: str, s: dict) -> dict:
    """The saved mesh; without ``device_mesh`` (orbax 0.5) its devices in id order."""
    shape, names = s.get("shape"), s.get("axis_names")
    if not (
        isinstance(shape, list)
        and isinstance(names, list)
        and len(shape) == len(names)
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        and all(isinstance(n, str) for n in names)
        and len(set(names)) == len(names)
        and math.prod(shape) <= MAX_PROCESSES
    ):
        raise where.error(SHARDING, f"leaf {name!r}: its mesh shape/axis_names are invalid")
    count = math.prod(shape)
    ids: list[Any] = list(range(count))
    if "device_mesh" in s:
        dm = s["device_mesh"]
        flat = _flat(dm.get("mesh") if isinstance(dm, dict) else None)
        ids = [d.get("id") if isinstance(d, dict) else None for d in flat]
        if len(ids) != count or not all(isinstance(i, int) for i in ids):
            raise where.error(SHARDING, f"leaf {name!r}: its device_mesh does not fit {shape}")
    types = [t.rsplit(".", 1)[-1] if isinstance(t, str) else t for t in s.get("axis_types", [])]
    if types and (len(types) != len(shape) or any(t not in AXIS_TYPES for t in types)):
        raise where.error(SHARDING, f"leaf {name!r}: axis_types {types} are not JAX's")
    return {
        "axis_names": list(names),
        "shape": list(shape),
        "device_ids": np.asarray(ids).reshape(shape).tolist(),
        "axis_types": types or None,
    }


def _spec(where: Where, name: str, s: dict, mesh: dict) -> list:
    spec = s.get("partition_spec")
    if not isinstance(spec, list):
        raise where.error(SHARDING, f"leaf {name!r} has no partition_spec list")
    for e in spec:
        axes = e if isinstance(e, list) else [] if e is None else [e]
        if not all(isinstance(a, str) and a in mesh["axis_names"] for a in axes):
            raise where.error(SHARDING, f"leaf {name!r}: partition_spec {spec} names no axis")
    return spec  # parsed for this leaf alone: nobody else holds it


def _flat(grid: Any, depth: int = 0) -> list[Any]:
    """The device grid's entries in row-major order, whatever its rank (past ``MAX_NDIM``
    levels, the list itself)."""
    if not isinstance(grid, list) or depth > MAX_NDIM:
        return [grid]
    return [x for row in grid for x in _flat(row, depth + 1)]
