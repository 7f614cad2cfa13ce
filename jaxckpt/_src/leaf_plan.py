"""What each restored leaf should become, and the tree it comes back in: shared by
``restore`` and the emergency tier's restore (:mod:`jaxckpt._src.emergency.restore`).

A :class:`Want` per saved leaf: its record, the dtype and the sharding it should come back
with, from the restore target (``want_target``) or from the saved spec bound to a mesh
(``want_saved``). ``result`` puts the restored values back into the target's structure.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from ..errors import LeafNotFoundError, ShapeMismatchError, ShardingError
from . import tree as tree_lib
from .manifest import LeafRecord
from .sharding import bind_spec, mesh_by_position
from .storage import Location


@dataclass(frozen=True)
class Want:
    """What one restored leaf should become."""

    record: LeafRecord
    dtype: np.dtype | None  # None: the saved dtype
    sharding: jax.sharding.Sharding | None  # None: a NumPy array


def want_saved(
    rec: LeafRecord, meshes: list[dict], mesh: Mesh | None, dtype: np.dtype | None = None
) -> Want:
    """``rec`` with its saved spec bound to ``mesh`` (default: the saved mesh, if it fits)."""
    if not rec.has_array:
        return Want(rec, None, None)
    sharding: jax.sharding.Sharding | None = None
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


def wants(
    leaves: Sequence[LeafRecord],
    meshes: list[dict],
    target: Any,
    mesh: Mesh | None,
    loc: Location,
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


def whole_on_host(w: Want, data: np.ndarray) -> Any:
    """A leaf read whole into host memory (``data``, in the wanted dtype) as ``w`` asks: a
    PRNG key (re-wrapped; placed on ``w.sharding`` if any), a NumPy scalar or array."""
    rec = w.record
    if rec.kind == "prng_key":
        return place_key(data, w, rec) if w.sharding is not None else _wrap(data, rec)
    return data[()] if rec.kind == "numpy" and rec.scalar else data


def _wrap(data: Any, rec: LeafRecord) -> jax.Array:
    """A typed key from its data (a jax.Array or NumPy: jax's stub names Array only)."""
    return jax.random.wrap_key_data(data, impl=rec.prng_impl)


def place_key(data: np.ndarray, w: Want, rec: LeafRecord) -> jax.Array:
    """A typed PRNG key from its key data, on ``w.sharding`` (which may span processes)."""
    s = w.sharding
    ndim = data.ndim - 1 if data.ndim else 0  # key data has one more (impl) dimension
    if isinstance(s, jax.sharding.NamedSharding) and len(s.spec) > ndim:
        s = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[:ndim]))
    if isinstance(s, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding)):
        return _wrap(jax.make_array_from_callback(data.shape, s, lambda i: data[i]), rec)
    return jax.device_put(_wrap(data, rec), s)
