"""Serving an export: :func:`load` and the :class:`Served` callable it returns.

``load`` picks the variant exported for the serving mesh's device count, reads and checks its
artifact (:mod:`jaxckpt._src.export.format`), restores the parameters onto the mesh with their
recorded PartitionSpecs and wraps the ``jax.export.Exported`` in :class:`Served`, which
checks each call's arguments against the signature before placing them on the mesh. No
model code is needed. Reached as ``jaxckpt.export.load``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding

from ...errors import ExportArgumentError, ExportError
from .. import tree as tree_lib
from ..restoring import restore
from ..sharding import spec_from_json
from ..storage import Location, location
from .format import (
    PLAIN_SYMBOL,
    SIGNATURE_FILE,
    MeshAxes,
    Params,
    Variant,
    matches_params,
    read_artifact,
    read_signature,
)


def _fmt_shape(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


@dataclass(frozen=True, eq=False)
class Served:
    """A loaded export; call it with the arguments of the exported function after ``params``.

    Inputs are checked against ``signature["inputs"]`` and placed per their PartitionSpecs on
    ``mesh``; outputs come back sharded per ``signature["outputs"]``.
    """

    path: str
    signature: dict[str, Any] = field(repr=False)
    mesh: Mesh
    variant: dict[str, Any] = field(repr=False)
    in_shardings: tuple[NamedSharding, ...] = field(repr=False)
    params: list[jax.Array] = field(repr=False)
    exported: jax.export.Exported = field(repr=False)
    _call: Callable[..., Any] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_call", jax.jit(self.exported.call))

    def __call__(self, *args: Any) -> Any:
        self._check(args)
        placed = [jax.device_put(a, s) for a, s in zip(args, self.in_shardings, strict=True)]
        return self._call(self.params, *placed)

    def _check(self, args: tuple[Any, ...]) -> None:
        inputs = self.signature["inputs"]
        if len(args) != len(inputs):
            raise ExportArgumentError(
                f"{self.path}: the served function takes {len(inputs)} argument(s) "
                f"{[i['name'] for i in inputs]}, got {len(args)}"
            )
        bound: dict[str, tuple[int, int]] = {}
        for i, (arg, want, divs) in enumerate(
            zip(args, inputs, self.variant["input_divisors"], strict=True)
        ):
            shape = tuple(np.shape(arg))
            dtype = np.dtype(arg.dtype) if hasattr(arg, "dtype") else np.asarray(arg).dtype
            if dtype != jax.numpy.dtype(want["dtype"]):
                raise self._arg_error(i, shape, dtype, "has the wrong dtype (cast it with .astype)")
            if len(shape) != len(want["shape"]):
                raise self._arg_error(i, shape, dtype, "has the wrong number of dimensions")
            for d, (got, dim, k) in enumerate(zip(shape, want["shape"], divs, strict=True)):
                why = None
                if isinstance(dim, int) and got != dim:
                    why = f"has the wrong size in dimension {d}"
                elif isinstance(dim, str) and PLAIN_SYMBOL.fullmatch(dim):
                    first = bound.setdefault(dim, (got, i))
                    if got < 1:
                        why = f"has {dim}={got} in dimension {d}; symbolic sizes must be >= 1"
                    elif first[0] != got:
                        why = (
                            f"has {dim}={got} in dimension {d}, but argument {first[1]} has "
                            f"{dim}={first[0]}"
                        )
                if why is None and got % k:
                    why = (
                        f"has size {got} in dimension {d}, which is split {k} ways on the "
                        f"{self.variant['device_count']}-device mesh {dict(self.mesh.shape)}; "
                        f"pass a multiple of {k}"
                    )
                if why is not None:
                    raise self._arg_error(i, shape, dtype, why)

    def _arg_error(
        self, i: int, shape: tuple[int, ...], dtype: np.dtype, why: str
    ) -> ExportArgumentError:
        want = self.signature["inputs"][i]
        return ExportArgumentError(
            f"{self.path}: argument {i} ({want['name']!r}) {why}: expected "
            f"{_fmt_shape(want['shape'])} {want['dtype']}, got {_fmt_shape(shape)} {dtype}"
        )


def load(path: str | os.PathLike, mesh: Mesh | None = None) -> Served:
    """Loads the export at ``path`` for serving on ``mesh`` (default: all current devices).

    Picks the variant exported for the mesh's device count, restores the parameters onto the
    mesh with their recorded PartitionSpecs and returns a :class:`Served` callable. The mesh
    must have the recorded axis names and the variant's axis sizes, in any device order.
    """
    loc = location(path)
    sig = read_signature(loc)
    count = int(mesh.size) if mesh is not None else jax.device_count()
    by_count = {v.device_count: v for v in sig.variants}
    variant = by_count.get(count)
    if variant is None:
        raise ExportError(
            f"{loc.url} was exported for {sorted(by_count)} device(s), not {count} (the "
            f"variants in {loc.url}/{SIGNATURE_FILE}); serve on one of those counts (mesh= over "
            f"that many devices), or re-export with device_counts including {count}"
        )
    exported = read_artifact(loc, sig, variant)
    mesh = _serving_mesh(mesh, sig.mesh, variant, loc)
    params = _restore_params(loc, sig.params, mesh)
    matches_params(params, exported, f"{loc.url}/{SIGNATURE_FILE}")
    in_shardings = tuple(NamedSharding(mesh, spec_from_json(i.spec)) for i in sig.inputs)
    return Served(loc.url, sig.to_json(), mesh, variant.to_json(), in_shardings, params, exported)


def _serving_mesh(mesh: Mesh | None, axes: MeshAxes, variant: Variant, loc: Location) -> Mesh:
    """``mesh`` (default: one over the current devices) with the variant's axis names, sizes
    and types; a mesh of other names or sizes is refused."""
    names, sizes = tuple(axes.axis_names), tuple(variant.axis_sizes)
    types = tuple(AxisType[t] for t in axes.axis_types)
    if mesh is None:
        return jax.make_mesh(sizes, names, axis_types=types)
    got = dict(mesh.shape)
    if tuple(mesh.axis_names) != names or tuple(mesh.devices.shape) != sizes:
        raise ExportError(
            f"{loc.url}: the serving mesh has axes {got}, but the {variant.device_count}-"
            f"device variant was exported for {dict(zip(names, sizes, strict=True))}; build "
            "the mesh with those axis names and sizes (any device order), or pass mesh=None"
        )
    if tuple(mesh.axis_types) != types:  # same devices and layout, the exported axis types
        mesh = Mesh(mesh.devices, names, axis_types=types)
    return mesh


def _restore_params(loc: Location, params: Params, mesh: Mesh) -> list[jax.Array]:
    """The parameters, in the signature's order, on ``mesh`` with their PartitionSpecs."""
    if not params.leaves:
        return []
    target = tree_lib.unflatten_paths(
        [(r.path, NamedSharding(mesh, spec_from_json(r.spec))) for r in params.leaves]
    )
    restored = restore(loc.join(params.dir).url, target=target)
    by_name = {tree_lib.path_name(p): v for p, v in tree_lib.flatten(restored)}
    return [by_name[r.name] for r in params.leaves]
