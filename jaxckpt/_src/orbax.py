"""Reading checkpoints written by orbax-checkpoint, with TensorStore alone (no orbax import).

``jaxckpt.restore`` and ``jaxckpt.metadata`` call :func:`read` when a path holds an Orbax
checkpoint: a ``StandardSave``/``PyTreeSave`` item directory (``_METADATA``), or a manager's
step directory holding one item. Its ``_METADATA`` (the tree: key paths and value types),
``_sharding`` (each leaf's sharding, keyed by the base64 of its name) and the arrays' zarr
metadata become a jaxckpt :class:`Manifest`, so the restore onto any mesh, device count or
as NumPy is jaxckpt's own. Covered (docs/ORBAX.md): orbax-checkpoint 0.12 (0.11 untested), OCDBT
(one process or several: the root ``manifest.ocdbt`` references every process's database)
and per-array directories (``use_ocdbt=False``), zarr v2 and v3, ``jax.Array``,
``np.ndarray`` and scalar leaves.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tensorstore as ts

from ..errors import CheckpointNotFoundError, OrbaxFormatError
from . import tree as tree_lib
from .manifest import MANIFEST_FILE, LeafRecord, Manifest
from .storage import Location

METADATA = "_METADATA"
SHARDING = "_sharding"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
_KINDS = {"jax.Array": "array", "np.ndarray": "numpy", "scalar": "python", "None": "none"}


@dataclass(frozen=True)
class OrbaxCheckpoint:
    """An Orbax item directory as jaxckpt reads it."""

    item: Location
    manifest: Manifest
    use_ocdbt: bool
    zarr3: bool
    keys: dict[str, str]  # a leaf's jaxckpt name -> its Orbax name (keys joined by ".")

    def kvstore(self) -> dict:
        """The item's keys: its OCDBT database, or (``use_ocdbt=False``) its directory."""
        base = self.item.kvstore()
        return {"driver": "ocdbt", "base": base} if self.use_ocdbt else base

    def spec(self, name: str) -> dict:
        driver = "zarr3" if self.zarr3 else "zarr"
        return {"driver": driver, "kvstore": self.kvstore(), "path": name + "/"}

    def opener(self, ctx: ts.Context) -> Callable[[str], ts.Future]:
        """Opens a leaf by its jaxckpt name."""
        return lambda name: ts.open(
            {**self.spec(self.keys[name]), "open": True}, context=ctx, read=True
        )


def item_dir(loc: Location) -> Location | None:
    """The Orbax item directory at ``loc`` (itself, or a manager step's single item), or
    None when ``loc`` is not an Orbax checkpoint."""
    if loc.exists(MANIFEST_FILE):
        return None
    if loc.exists(METADATA):
        return loc
    if not loc.exists(CHECKPOINT_METADATA):
        return None
    items = [n for n in loc.list_children() if loc.join(n).exists(METADATA)]
    if len(items) != 1:
        raise OrbaxFormatError(
            f"{loc.url} is an Orbax step with items {items}; jaxckpt reads one item at a time: "
            "pass the item's directory (e.g. f'{step_dir}/state')"
        )
    return loc.join(items[0])


def read(item: Location) -> OrbaxCheckpoint:
    """The checkpoint in the Orbax item directory ``item``, described as a jaxckpt manifest."""
    text = item.read_bytes(METADATA)
    if text is None:
        raise CheckpointNotFoundError(f"{item.url} holds no Orbax {METADATA}")
    try:
        doc = json.loads(text)
        tree = doc["tree_metadata"]
    except (TypeError, ValueError, KeyError) as e:
        raise OrbaxFormatError(
            f"{item.url}/{METADATA} is not an Orbax tree metadata file ({e})"
        ) from e
    shardings = json.loads(item.read_bytes(SHARDING) or b"{}")
    use_ocdbt = bool(doc.get("use_ocdbt", item.exists("manifest.ocdbt")))
    zarr3 = bool(doc.get("use_zarr3", False))
    ckpt = OrbaxCheckpoint(item, Manifest((), [], 1, []), use_ocdbt, zarr3, {})
    keys: dict[str, str] = {}
    kv = ts.KvStore.open(ckpt.kvstore()).result()
    meshes: list[dict] = []
    leaves = []
    for entry in tree.values():
        value = entry["value_metadata"]
        name = ".".join(str(k["key"]) for k in entry["key_metadata"])  # Orbax's name
        path = [
            ["i", int(k["key"])] if k.get("key_type") == 1 else ["k", str(k["key"])]
            for k in entry["key_metadata"]
        ]
        ours = tree_lib.path_name(path)
        keys[ours] = name
        kind = _KINDS.get(value.get("value_type"))
        if kind is None:
            raise OrbaxFormatError(
                f"{item.url}: leaf {name!r} has Orbax value type {value.get('value_type')!r}, "
                f"which jaxckpt does not read (it reads {sorted(_KINDS)}); restore it with orbax"
            )
        if value.get("skip_deserialize"):
            continue
        if kind == "none":  # an empty node (optax's EmptyState, a None field)
            leaves.append(LeafRecord(path, ours, "python", python_type="NoneType"))
            continue
        meta = _zarr_metadata(item, kv, name, zarr3)
        shape, dtype, chunks = _shape_dtype_chunks(meta, zarr3)
        if kind == "python":  # a scalar: read now, restored as a Python number
            data = ts.open({**ckpt.spec(name), "open": True}).result().read().result()
            number = np.asarray(data).item()
            leaves.append(
                LeafRecord(path, ours, "python", value=number, python_type=type(number).__name__)
            )
            continue
        leaves.append(
            LeafRecord(
                path=path,
                name=ours,
                kind=kind,
                shape=list(shape),
                dtype=str(dtype),
                sharding=_sharding(shardings, name, meshes) if kind == "array" else None,
                chunk_shape=list(chunks),
                nbytes=math.prod(shape) * dtype.itemsize,
            )
        )
    manifest = Manifest(
        leaves=tuple(leaves),
        meshes=meshes,
        process_count=1,
        bytes_per_process=[sum(r.nbytes for r in leaves)],
        metadata=doc.get("custom_metadata"),
        writer={"orbax": "?"},
    )
    return OrbaxCheckpoint(item, manifest, use_ocdbt, zarr3, keys)


def _zarr_metadata(item: Location, kv: ts.KvStore, name: str, zarr3: bool) -> dict:
    key = f"{name}/{'zarr.json' if zarr3 else '.zarray'}"
    raw = kv.read(key).result().value
    if not raw:
        raise OrbaxFormatError(
            f"{item.url}: leaf {name!r} has no array metadata ({key}); the checkpoint is "
            "incomplete or uses a layout jaxckpt does not read"
        )
    return json.loads(raw)


def _shape_dtype_chunks(meta: dict, zarr3: bool):
    shape = tuple(meta["shape"])
    if zarr3:
        dtype = np.dtype(meta["data_type"])
        chunks = tuple(meta["chunk_grid"]["configuration"]["chunk_shape"])
    else:
        text = meta["dtype"]
        dtype = np.dtype(text[1:] if text[0] in "<>|" and not text[1:2].isdigit() else text)
        chunks = tuple(meta["chunks"]) or shape
    return shape, dtype, tuple(c if c else 1 for c in chunks) if shape else ()


def _sharding(shardings: dict, name: str, meshes: list[dict]) -> dict | None:
    key = base64.urlsafe_b64encode(name.encode()).decode()
    raw = shardings.get(key) or shardings.get(base64.b64encode(name.encode()).decode())
    if raw is None:
        return None
    s = json.loads(raw)
    if s.get("sharding_type") == "NamedSharding":
        ids = [d["id"] for d in _flat(s["device_mesh"]["mesh"])]
        mesh = {
            "axis_names": list(s["axis_names"]),
            "shape": list(s["shape"]),
            "device_ids": np.asarray(ids).reshape(s["shape"]).tolist(),
            "axis_types": [t.rsplit(".", 1)[-1] for t in s.get("axis_types", [])] or None,
        }
        if mesh not in meshes:
            meshes.append(mesh)
        spec = [list(e) if isinstance(e, list) else e for e in s["partition_spec"]]
        return {"type": "named", "mesh": meshes.index(mesh), "spec": spec}
    if s.get("sharding_type") == "SingleDeviceSharding":
        return {"type": "single_device", "device_id": 0}
    return {"type": "other", "repr": s.get("sharding_type", "?")}


def _flat(grid) -> list[dict]:
    """The device grid's entries in row-major order, whatever its rank."""
    if isinstance(grid, dict):
        return [grid]
    return [d for row in grid for d in _flat(row)]
