"""The writing side of :mod:`jaxckpt.export` (its docstring says what an export holds):
checking the specs, placing the parameters and lowering each variant."""

from __future__ import annotations

import datetime
import functools
import inspect
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.export
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec
from jax.tree_util import PyTreeDef

from ...errors import ExportError
from .. import bits
from .. import tree as tree_lib
from ..saving import package_version
from ..sharding import entry_axes, spec_to_json
from ..storage import Location, location
from .format import (
    EXPORT_FORMAT,
    EXPORT_FORMAT_VERSION,
    PARAMS_DIR,
    PLAIN_SYMBOL,
    MeshAxes,
    ParamLeaf,
    Params,
    Signature,
    Value,
    Variant,
    prepare_target,
    require_flatbuffers,
    split_ways,
    variant_record,
    write,
)

# --- axis sizes and small helpers ---------------------------------------------------------


def axis_sizes_for(sizes: Sequence[int], count: int) -> tuple[int, ...]:
    """Axis sizes for ``count`` devices, derived from the export mesh's ``sizes``.

    Axes from the last to the second keep ``gcd(size, rest)``; the first takes the rest.
    """
    out = [1] * len(sizes)
    rest = count
    for i in range(len(sizes) - 1, 0, -1):
        out[i] = math.gcd(int(sizes[i]), rest)
        rest //= out[i]
    out[0] = rest
    return tuple(out)


def _check_spec(spec: Any, names: tuple[str, ...], what: str, loc: Location) -> PartitionSpec:
    if spec is None:
        return PartitionSpec()
    if not isinstance(spec, PartitionSpec):
        raise ExportError(f"{loc.url}: {what} is {spec!r}; give a jax.sharding.PartitionSpec")
    for entry in spec:
        if entry is not None and not isinstance(entry, (str, tuple)):
            raise ExportError(
                f"{loc.url}: {what} {spec} has the entry {entry!r}; only axis names, tuples "
                "of axis names and None can be exported"
            )
    missing = [a for entry in spec for a in entry_axes(entry) if a not in names]
    if missing:
        raise ExportError(
            f"{loc.url}: {what} {spec} names axes {missing} that the mesh {names} lacks; use "
            "the mesh's axis names"
        )
    return spec


# --- save ----------------------------------------------------------------------------------


def save(
    path: str | os.PathLike,
    fn: Callable[..., Any],
    params: Any,
    *arg_specs: jax.ShapeDtypeStruct,
    mesh: Mesh,
    in_specs: PartitionSpec | Sequence[PartitionSpec],
    out_specs: Any,
    device_counts: Sequence[int] | Mapping[int, Sequence[int]] | None = None,
    platforms: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Exports ``fn(params, *args)`` for serving; returns the signature written.

    ``arg_specs`` are ``jax.ShapeDtypeStruct`` (dimensions may be symbolic, made with
    ``jax.export.symbolic_shape``); ``in_specs`` has one PartitionSpec per argument,
    ``out_specs`` is a PartitionSpec or a pytree prefix of the outputs. Each ``params`` leaf
    keeps the PartitionSpec of its NamedSharding (replicated otherwise). ``device_counts``
    lists the serving device counts (default: ``mesh.size``), or maps each count to its
    axis sizes. ``platforms`` defaults to the current backend's.
    """
    loc = location(path)
    prepare_target(loc)
    require_flatbuffers(loc)
    if not isinstance(mesh, Mesh):
        raise ExportError(f"{loc.url}: mesh= must be a jax.sharding.Mesh, got {type(mesh)}")
    names = _axis_names(mesh)
    for i, spec in enumerate(arg_specs):
        if not isinstance(spec, jax.ShapeDtypeStruct):
            raise ExportError(
                f"{loc.url}: argument spec {i} is a {type(spec).__name__}; pass one "
                "jax.ShapeDtypeStruct per argument"
            )
    given = (in_specs,) if isinstance(in_specs, PartitionSpec) else tuple(in_specs)
    if len(given) != len(arg_specs):
        raise ExportError(
            f"{loc.url}: {len(arg_specs)} argument spec(s) but {len(given)} in_specs; give "
            "one PartitionSpec per argument"
        )
    specs = tuple(_check_spec(s, names, f"in_specs[{i}]", loc) for i, s in enumerate(given))
    arg_names = _arg_names(fn, len(arg_specs))
    fn_name = getattr(fn, "__name__", "fn")

    treedef, leaves, param_specs, param_records = _place_params(params, mesh, loc)

    def flat_fn(param_leaves: list[jax.Array], *args: Any) -> Any:
        return fn(jax.tree_util.tree_unflatten(treedef, param_leaves), *args)

    flat_fn.__name__ = fn_name
    param_sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    try:
        out_shape = jax.eval_shape(flat_fn, param_sds, *arg_specs)
    except Exception as e:
        raise ExportError(f"{loc.url}: tracing {fn_name} on the argument specs failed: {e}") from e
    out_full = _broadcast_out_specs(out_specs, out_shape, names, loc)

    variants: list[Variant] = []
    blobs: dict[str, bytes] = {}
    for sizes in _variant_sizes(device_counts, mesh, loc).values():
        exp, divisors = _export_variant(
            flat_fn, param_sds, param_specs, arg_specs, specs, out_full, mesh, sizes, platforms, loc
        )
        try:
            blob = bytes(exp.serialize())
        except KeyError as e:  # jax.export's serialization knows no 1- and 2-bit types
            bad = [r.name for r in param_records if r.dtype == str(e.args[0])]
            if not bad:
                raise
            raise ExportError(
                f"{loc.url}: jax.export cannot serialize {e.args[0]} (parameters {bad}); "
                "store them as int4/int8 and cast inside the function"
            ) from e
        variant = variant_record(sizes, exp, blob, divisors)
        blobs[variant.file] = blob
        variants.append(variant)

    out_flat = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    signature = Signature(
        format=EXPORT_FORMAT,
        format_version=list(EXPORT_FORMAT_VERSION),
        function=fn_name,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        versions={
            "jax": jax.__version__,
            "jaxlib": package_version("jaxlib"),
            "jaxckpt": package_version("jaxckpt"),
        },
        mesh=MeshAxes(
            list(names), [t.name for t in mesh.axis_types], [int(s) for s in mesh.devices.shape]
        ),
        inputs=[
            Value.of(i, arg_names[i], s, spec)
            for i, (s, spec) in enumerate(zip(arg_specs, specs, strict=True))
        ],
        outputs=[
            Value.of(None, tree_lib.path_name(tree_lib.path_to_json(p)), s, spec)
            for (p, s), spec in zip(out_flat, jax.tree.leaves(out_full), strict=True)
        ],
        params=Params(PARAMS_DIR, sum(x.nbytes for x in leaves), param_records),
        variants=variants,
    )
    write(loc, jax.tree_util.tree_unflatten(treedef, leaves), blobs, signature)
    return signature.to_json()


def _axis_names(mesh: Mesh) -> tuple[str, ...]:
    return tuple(str(n) for n in mesh.axis_names)


def _arg_names(fn: Callable[..., Any], n: int) -> list[str]:
    """The names of ``fn``'s positional parameters after ``params`` (``arg<i>`` otherwise)."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    try:
        found = [p.name for p in inspect.signature(fn).parameters.values() if p.kind in kinds][1:]
    except (TypeError, ValueError):  # no signature to inspect
        found = []
    return [found[i] if i < len(found) else f"arg{i}" for i in range(n)]


def _place_params(
    params: Any, mesh: Mesh, loc: Location
) -> tuple[PyTreeDef, list[jax.Array], list[PartitionSpec], list[ParamLeaf]]:
    """The leaves of ``params`` placed on ``mesh`` with their PartitionSpecs, and records.
    Bytes unchanged: NumPy values slice by slice, arrays as bits in one transfer (``bits``)."""
    names = _axis_names(mesh)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [tree_lib.path_to_json(key_path) for key_path, _ in flat]
    leaves, specs = [], []
    for path, (_, leaf) in zip(paths, flat, strict=True):
        spec = _param_spec(leaf, tree_lib.path_name(path), names, loc)
        if not isinstance(leaf, jax.Array):
            leaf = bits.from_host(np.asarray(leaf), NamedSharding(mesh, spec))
        leaves.append(leaf)
        specs.append(spec)
    placed = bits.reshard(leaves, [NamedSharding(mesh, spec) for spec in specs])
    records = [
        ParamLeaf(tree_lib.path_name(path), path, list(x.shape), str(x.dtype), spec_to_json(s))
        for path, x, s in zip(paths, placed, specs, strict=True)
    ]
    return treedef, placed, specs, records


def _param_spec(leaf: Any, name: str, names: tuple[str, ...], loc: Location) -> PartitionSpec:
    if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        raise ExportError(
            f"{loc.url}: parameter {name!r} is a {type(leaf).__name__}; parameters must be "
            "jax or NumPy arrays (pass other values through a closure over fn)"
        )
    sharding = getattr(leaf, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return PartitionSpec()
    return _check_spec(sharding.spec, names, f"parameter {name!r}'s PartitionSpec", loc)


def _broadcast_out_specs(
    out_specs: Any, out_shape: Any, names: tuple[str, ...], loc: Location
) -> Any:
    """``out_specs`` as a PartitionSpec per output leaf, each checked against the mesh."""

    def is_leaf(x: Any) -> bool:
        return x is None or isinstance(x, PartitionSpec)

    try:
        full = jax.tree.broadcast(out_specs, out_shape, is_leaf=is_leaf)
    except Exception as e:
        raise ExportError(
            f"{loc.url}: out_specs {out_specs!r} does not match the outputs' structure "
            f"{jax.tree.structure(out_shape)}; give one PartitionSpec, or a prefix tree of them"
        ) from e

    return jax.tree.map(lambda s: _check_spec(s, names, "out_specs", loc), full, is_leaf=is_leaf)


def _variant_sizes(
    device_counts: Sequence[int] | Mapping[int, Sequence[int]] | None, mesh: Mesh, loc: Location
) -> dict[int, tuple[int, ...]]:
    """The axis sizes of each variant, by device count (in increasing order), checked."""
    sizes = tuple(int(s) for s in mesh.devices.shape)
    if isinstance(device_counts, Mapping):
        out = {int(n): tuple(int(s) for s in v) for n, v in device_counts.items()}
    else:  # (axis_sizes_for gives the mesh's own sizes for its size, the default count)
        counts = [mesh.size] if device_counts is None else device_counts
        out = {int(n): axis_sizes_for(sizes, int(n)) for n in counts}
    for n, v in out.items():
        if n < 1 or len(v) != len(sizes) or math.prod(v) != n:
            raise ExportError(
                f"{loc.url}: device count {n} with axis sizes {v} does not fit the mesh axes "
                f"{tuple(mesh.axis_names)}; the sizes must be {len(sizes)} numbers whose "
                "product is the device count"
            )
    if not out:
        raise ExportError(f"{loc.url}: device_counts is empty; name at least one count")
    return dict(sorted(out.items()))


def _export_variant(
    flat_fn: Callable[..., Any],
    param_sds: list[jax.ShapeDtypeStruct],
    param_specs: list[PartitionSpec],
    arg_specs: Sequence[jax.ShapeDtypeStruct],
    in_specs: Sequence[PartitionSpec],
    out_full: Any,
    mesh: Mesh,
    sizes: tuple[int, ...],
    platforms: Sequence[str] | None,
    loc: Location,
) -> tuple[jax.export.Exported, list[list[int]]]:
    """One ``Exported`` over an abstract mesh of ``sizes``, and each input's divisors."""
    names = _axis_names(mesh)
    by_name = dict(zip(names, sizes, strict=True))
    amesh = AbstractMesh(tuple(sizes), names, axis_types=tuple(mesh.axis_types))
    count = math.prod(sizes)
    divisors: list[list[int]] = []
    multiples: dict[str, int] = {}  # symbol -> what it must be a multiple of
    for i, (spec, pspec) in enumerate(zip(arg_specs, in_specs, strict=True)):
        ways = split_ways(pspec, len(spec.shape), by_name)  # pieces per dimension
        divisors.append(ways)
        for d, (dim, k) in enumerate(zip(spec.shape, ways, strict=True)):
            if k == 1 or not jax.export.is_symbolic_dim(dim):
                continue
            if not PLAIN_SYMBOL.fullmatch(str(dim)):
                raise ExportError(
                    f"{loc.url}: argument {i} dimension {d} is the symbolic expression "
                    f"{str(dim)!r} and is split {k} ways for {count} device(s); only a plain "
                    "symbol (like 'b') can be sharded: shard another dimension or use a symbol"
                )
            multiples[str(dim)] = math.lcm(multiples.get(str(dim), 1), k)
    # A sharded symbol b becomes m*b_div<m> (an equality constraint) so the exported shapes
    # themselves say that b divides by m; a mod() constraint would not be serialized.
    constraints = [f"{b} == {m}*{b}_div{m}" for b, m in multiples.items()]
    specs = _with_constraints(arg_specs, constraints, loc) if constraints else list(arg_specs)

    named = functools.partial(NamedSharding, amesh)
    jitted = jax.jit(
        flat_fn,
        in_shardings=jax.tree.map(named, (param_specs, *in_specs)),
        out_shardings=jax.tree.map(named, out_full),
    )
    try:
        exp = jax.export.export(jitted, platforms=platforms)(param_sds, *specs)
    except Exception as e:
        raise ExportError(
            f"{loc.url}: exporting {flat_fn.__name__} for {count} device(s) (mesh {by_name}) "
            f"failed: {e}. Every sharded dimension must divide by its axes' sizes at this "
            "device count; drop the count or give its axis sizes (device_counts={count: sizes})"
        ) from e
    return exp, divisors


def _with_constraints(
    arg_specs: Sequence[jax.ShapeDtypeStruct], constraints: list[str], loc: Location
) -> list[jax.ShapeDtypeStruct]:
    """The argument specs re-made in one symbolic scope that also says which dims divide."""
    # the user's constraints: those of the scope of the first symbolic dimension (jax.export
    # takes the symbolic dimensions of all the arguments from one scope)
    first = next(d for s in arg_specs for d in s.shape if jax.export.is_symbolic_dim(d))
    user = [c.debug_str for c in getattr(first.scope, "_explicit_constraints", [])]
    try:
        scope = jax.export.SymbolicScope([*user, *dict.fromkeys(constraints)])
    except Exception as e:
        raise ExportError(
            f"{loc.url}: cannot combine the symbolic constraints {user} with the divisibility "
            f"of sharded dimensions {constraints}: {e}"
        ) from e
    out = []
    for spec in arg_specs:
        if any(jax.export.is_symbolic_dim(d) for d in spec.shape):
            text = ", ".join(str(d) for d in spec.shape)
            shape = jax.export.symbolic_shape(text, scope=scope)
            spec = jax.ShapeDtypeStruct(shape, spec.dtype)
        out.append(spec)
    return out
