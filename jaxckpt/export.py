"""Export a sharded function for serving without its model code: :func:`save` and :func:`load`.

An export is one directory::

    path/
      signature.json                  inputs, outputs, mesh axes, variants, versions, checksums
      params/                         the parameters: one jaxckpt checkpoint, stored once
      artifacts/devices_<n>.jaxexport a serialized ``jax.export.Exported`` per device count

Each artifact is lowered over a :class:`jax.sharding.AbstractMesh` with the export mesh's axis
names, so exporting needs no serving devices. The axis sizes for ``n`` devices, unless given
explicitly: walking the axes from the last to the second, each keeps ``gcd(size, rest)``
where ``rest`` is what is left of ``n``; the first axis takes the remainder. A (4, 2) mesh
gives 8 -> (4, 2), 4 -> (2, 2), 2 -> (1, 2), 1 -> (1, 1), 16 -> (8, 2).

>>> jaxckpt.export.save("/exports/mlp", apply, params, x_spec, mesh=mesh,
...                     in_specs=(P("data"),), out_specs=P("data"), device_counts=[1, 4, 8])
>>> served = jaxckpt.export.load("/exports/mlp")  # in the serving process
>>> y = served(x)
"""

from __future__ import annotations

import datetime
import hashlib
import inspect
import json
import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from . import checkpoint, multihost
from . import tree as tree_lib
from .errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ExportArgumentError,
    ExportChecksumError,
    ExportError,
    ExportVersionError,
)
from .sharding import spec_from_json, spec_to_json
from .storage import Location, location

EXPORT_FORMAT = "jaxckpt.export"
EXPORT_FORMAT_VERSION = 1
SIGNATURE_FILE = "signature.json"
PARAMS_DIR = "params"
ARTIFACTS_DIR = "artifacts"

_PLAIN_SYMBOL = re.compile(r"[A-Za-z_]\w*")
_BARRIER_TIMEOUT_S = 600.0


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


def _version(name: str) -> str:
    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "?"


def _schema_version() -> int | None:
    """The installed jax.export flatbuffer schema version (None when jax hides it)."""
    try:
        from jax._src.export import serialization
    except ImportError:
        return None
    return getattr(serialization, "_SERIALIZATION_VERSION", None)


def _require_flatbuffers(loc: Location) -> None:
    try:
        import flatbuffers  # noqa: F401
    except ImportError as e:
        raise ExportError(
            f"{loc.url}: jax.export needs the 'flatbuffers' package to (de)serialize "
            "artifacts; install it (pip install flatbuffers)"
        ) from e


def _shape_json(shape: Sequence[Any]) -> list[int | str]:
    return [str(d) if jax.export.is_symbolic_dim(d) else int(d) for d in shape]


def _fmt_shape(shape: Sequence[Any]) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _spec_axes(spec: PartitionSpec) -> list[str]:
    return [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]


def _ways(entry: Any, sizes: Mapping[str, int]) -> int:
    """How many pieces a PartitionSpec entry cuts its dimension into."""
    if entry is None:
        return 1
    return math.prod(sizes[a] for a in (entry if isinstance(entry, tuple) else (entry,)))


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
    missing = [a for a in _spec_axes(spec) if a not in names]
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
) -> dict:
    """Exports ``fn(params, *args)`` for serving; returns the signature written.

    ``arg_specs`` are ``jax.ShapeDtypeStruct`` (dimensions may be symbolic, made with
    ``jax.export.symbolic_shape``); ``in_specs`` has one PartitionSpec per argument,
    ``out_specs`` is a PartitionSpec or a pytree prefix of the outputs. Each ``params`` leaf
    keeps the PartitionSpec of its NamedSharding (replicated otherwise). ``device_counts``
    lists the serving device counts (default: ``mesh.size``), or maps each count to its
    axis sizes. ``platforms`` defaults to the current backend's.
    """
    loc = location(path)
    _prepare_target(loc)
    _require_flatbuffers(loc)
    if not isinstance(mesh, Mesh):
        raise ExportError(f"{loc.url}: mesh= must be a jax.sharding.Mesh, got {type(mesh)}")
    names = tuple(str(n) for n in mesh.axis_names)
    for i, spec in enumerate(arg_specs):
        if not isinstance(spec, jax.ShapeDtypeStruct):
            raise ExportError(
                f"{loc.url}: argument spec {i} is a {type(spec).__name__}; pass one "
                "jax.ShapeDtypeStruct per argument"
            )
    if isinstance(in_specs, PartitionSpec):
        in_specs = (in_specs,)
    in_specs = tuple(in_specs)
    if len(in_specs) != len(arg_specs):
        raise ExportError(
            f"{loc.url}: {len(arg_specs)} argument spec(s) but {len(in_specs)} in_specs; give "
            "one PartitionSpec per argument"
        )
    in_specs = tuple(_check_spec(s, names, f"in_specs[{i}]", loc) for i, s in enumerate(in_specs))
    arg_names = _arg_names(fn, len(arg_specs))
    fn_name = getattr(fn, "__name__", "fn")

    treedef, leaves, param_specs, param_records = _place_params(params, mesh, loc)

    def flat_fn(param_leaves, *args):
        return fn(jax.tree_util.tree_unflatten(treedef, param_leaves), *args)

    flat_fn.__name__ = fn_name
    param_sds = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]
    try:
        out_shape = jax.eval_shape(flat_fn, param_sds, *arg_specs)
    except Exception as e:
        raise ExportError(f"{loc.url}: tracing {fn_name} on the argument specs failed: {e}") from e
    out_full = _broadcast_out_specs(out_specs, out_shape, names, loc)

    variants, blobs = [], {}
    for count, sizes in _variant_sizes(device_counts, mesh, loc).items():
        exp, divisors = _export_variant(
            flat_fn,
            param_sds,
            param_specs,
            arg_specs,
            in_specs,
            out_full,
            mesh,
            sizes,
            platforms,
            loc,
        )
        blob = bytes(exp.serialize())
        file = f"{ARTIFACTS_DIR}/devices_{count}.jaxexport"
        blobs[file] = blob
        variants.append(
            {
                "device_count": count,
                "axis_sizes": list(sizes),
                "file": file,
                "sha256": hashlib.sha256(blob).hexdigest(),
                "bytes": len(blob),
                "calling_convention_version": exp.calling_convention_version,
                "serialization_version": _schema_version(),
                "platforms": list(exp.platforms),
                "input_divisors": divisors,
            }
        )

    out_flat = jax.tree_util.tree_flatten_with_path(out_shape)[0]
    signature = {
        "format": EXPORT_FORMAT,
        "format_version": EXPORT_FORMAT_VERSION,
        "function": fn_name,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {
            "jax": jax.__version__,
            "jaxlib": _version("jaxlib"),
            "jaxckpt": _version("jaxckpt"),
        },
        "mesh": {
            "axis_names": list(names),
            "axis_types": [t.name for t in mesh.axis_types],
            "exported_from": [int(s) for s in mesh.devices.shape],
        },
        "inputs": [
            {
                "index": i,
                "name": arg_names[i],
                "shape": _shape_json(s.shape),
                "dtype": str(np.dtype(s.dtype)),
                "spec": spec_to_json(in_specs[i]),
            }
            for i, s in enumerate(arg_specs)
        ],
        "outputs": [
            {
                "name": tree_lib.path_name(tree_lib.path_to_json(p)),
                "shape": _shape_json(s.shape),
                "dtype": str(np.dtype(s.dtype)),
                "spec": spec_to_json(spec),
            }
            for (p, s), spec in zip(out_flat, jax.tree.leaves(out_full), strict=True)
        ],
        "params": {
            "dir": PARAMS_DIR,
            "nbytes": sum(x.nbytes for x in leaves),
            "leaves": param_records,
        },
        "variants": variants,
    }

    checkpoint.save(
        loc.join(PARAMS_DIR),
        jax.tree_util.tree_unflatten(treedef, leaves),
        metadata={"jaxckpt.export": fn_name},
    )
    if multihost.process_index() == 0:
        for file, blob in blobs.items():
            folder, _, name = file.rpartition("/")
            loc.join(folder).write_bytes(name, blob)
        loc.write_bytes(SIGNATURE_FILE, json.dumps(signature, indent=1).encode())  # commit
    multihost.barrier(multihost.unique_name("export-committed"), _BARRIER_TIMEOUT_S)
    return signature


def _prepare_target(loc: Location) -> None:
    """Refuses a finished export; clears what an unfinished one left."""
    if loc.exists(SIGNATURE_FILE):
        raise CheckpointExistsError(
            f"{loc.url} already holds an export ({SIGNATURE_FILE}); choose a new path or delete it"
        )
    children = loc.list_children()
    others = sorted(set(children) - {PARAMS_DIR, ARTIFACTS_DIR})
    if others:
        raise ExportError(
            f"{loc.url} is not empty ({others[:5]}); export into a new or empty directory"
        )
    if children and multihost.process_index() == 0:  # an export that never finished
        loc.join(PARAMS_DIR).remove()
        loc.join(ARTIFACTS_DIR).remove()
    multihost.barrier(multihost.unique_name("export-prepared"), _BARRIER_TIMEOUT_S)


def _arg_names(fn: Callable, n: int) -> list[str]:
    """The names of ``fn``'s positional parameters after ``params`` (``arg<i>`` otherwise)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return [f"arg{i}" for i in range(n)]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    found = [p.name for p in sig.parameters.values() if p.kind in kinds][1:]
    return [found[i] if i < len(found) else f"arg{i}" for i in range(n)]


def _place_params(params: Any, mesh: Mesh, loc: Location):
    """The leaves of ``params`` placed on ``mesh`` with their PartitionSpecs, and records."""
    names = tuple(str(n) for n in mesh.axis_names)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    leaves, specs, records = [], [], []
    for key_path, leaf in flat:
        path = tree_lib.path_to_json(key_path)
        name = tree_lib.path_name(path)
        spec = _param_spec(leaf, name, names, loc)
        placed = jax.device_put(leaf, NamedSharding(mesh, spec))
        leaves.append(placed)
        specs.append(spec)
        records.append(
            {
                "name": name,
                "path": path,
                "shape": list(placed.shape),
                "dtype": str(placed.dtype),
                "spec": spec_to_json(spec),
            }
        )
    return treedef, leaves, specs, records


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


def _broadcast_out_specs(out_specs: Any, out_shape: Any, names: tuple[str, ...], loc: Location):
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


def _variant_sizes(device_counts, mesh: Mesh, loc: Location) -> dict[int, tuple[int, ...]]:
    sizes = tuple(int(s) for s in mesh.devices.shape)
    if device_counts is None:
        out = {int(mesh.size): sizes}
    elif isinstance(device_counts, Mapping):
        out = {int(n): tuple(int(s) for s in v) for n, v in device_counts.items()}
    else:
        out = {int(n): axis_sizes_for(sizes, int(n)) for n in device_counts}
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
    flat_fn, param_sds, param_specs, arg_specs, in_specs, out_full, mesh, sizes, platforms, loc
):
    """One ``Exported`` over an abstract mesh of ``sizes``, and each input's divisors."""
    names = tuple(str(n) for n in mesh.axis_names)
    by_name = dict(zip(names, sizes, strict=True))
    amesh = AbstractMesh(tuple(sizes), names, axis_types=tuple(mesh.axis_types))
    count = math.prod(sizes)
    divisors: list[list[int]] = []
    multiples: dict[str, int] = {}  # symbol -> what it must be a multiple of
    for i, (spec, pspec) in enumerate(zip(arg_specs, in_specs, strict=True)):
        ways = ([_ways(e, by_name) for e in pspec] + [1] * len(spec.shape))[: len(spec.shape)]
        divisors.append(ways)
        for d, (dim, k) in enumerate(zip(spec.shape, ways, strict=True)):
            if k == 1 or not jax.export.is_symbolic_dim(dim):
                continue
            if not _PLAIN_SYMBOL.fullmatch(str(dim)):
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

    def named(spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(amesh, spec)

    jitted = jax.jit(
        flat_fn,
        in_shardings=([named(s) for s in param_specs], *(named(s) for s in in_specs)),
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


def _with_constraints(arg_specs, constraints: list[str], loc: Location) -> list:
    """The argument specs re-made in one symbolic scope that also says which dims divide."""
    user: list[str] = []
    for spec in arg_specs:
        for d in spec.shape:
            if jax.export.is_symbolic_dim(d):
                found = getattr(d.scope, "_explicit_constraints", [])
                user = [c.debug_str for c in found]
                break
        if user:
            break
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


# --- load ----------------------------------------------------------------------------------


def signature(path: str | os.PathLike) -> dict:
    """The ``signature.json`` of the export at ``path``, checked for format and version."""
    loc = location(path)
    text = loc.read_bytes(SIGNATURE_FILE)
    if text is None:
        raise CheckpointNotFoundError(
            f"{loc.url} holds no {SIGNATURE_FILE}: it is not a jaxckpt export, or its export "
            "never finished; pass the directory jaxckpt.export.save wrote"
        )
    try:
        sig = json.loads(text)
    except ValueError as e:
        raise ExportError(f"{loc.url}/{SIGNATURE_FILE} is not valid JSON: {e}; re-export") from e
    if not isinstance(sig, dict) or sig.get("format") != EXPORT_FORMAT:
        raise ExportError(f"{loc.url}/{SIGNATURE_FILE} is not a {EXPORT_FORMAT} signature")
    if sig.get("format_version", 0) > EXPORT_FORMAT_VERSION:
        raise ExportVersionError(
            f"{loc.url}: export format version {sig.get('format_version')} is newer than this "
            f"jaxckpt reads ({EXPORT_FORMAT_VERSION}); upgrade jaxckpt"
        )
    return sig


@dataclass(frozen=True, eq=False)
class Served:
    """A loaded export; call it with the arguments of the exported function after ``params``.

    Inputs are checked against ``signature["inputs"]`` and placed per their PartitionSpecs on
    ``mesh``; outputs come back sharded per ``signature["outputs"]``.
    """

    path: str
    signature: dict = field(repr=False)
    mesh: Mesh
    variant: dict = field(repr=False)
    in_shardings: tuple[NamedSharding, ...] = field(repr=False)
    params: list = field(repr=False)
    exported: jax.export.Exported = field(repr=False)
    _call: Callable = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_call", jax.jit(self.exported.call))

    def __call__(self, *args: Any) -> Any:
        self._check(args)
        placed = [jax.device_put(a, s) for a, s in zip(args, self.in_shardings, strict=True)]
        return self._call(self.params, *placed)

    def _check(self, args: tuple) -> None:
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
                elif isinstance(dim, str) and _PLAIN_SYMBOL.fullmatch(dim):
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
                        f"{self.variant['device_count']}-device mesh {self._axes()}; pass a "
                        f"multiple of {k}"
                    )
                if why is not None:
                    raise self._arg_error(i, shape, dtype, why)

    def _arg_error(self, i: int, shape: tuple, dtype: np.dtype, why: str) -> ExportArgumentError:
        want = self.signature["inputs"][i]
        return ExportArgumentError(
            f"{self.path}: argument {i} ({want['name']!r}) {why}: expected "
            f"{_fmt_shape(want['shape'])} {want['dtype']}, got {_fmt_shape(shape)} {dtype}"
        )

    def _axes(self) -> dict[str, int]:
        return dict(zip(self.mesh.axis_names, self.mesh.devices.shape, strict=True))


def load(path: str | os.PathLike, mesh: Mesh | None = None) -> Served:
    """Loads the export at ``path`` for serving on ``mesh`` (default: all current devices).

    Picks the variant exported for the mesh's device count, restores the parameters onto the
    mesh with their recorded PartitionSpecs and returns a :class:`Served` callable. The mesh
    must have the recorded axis names and the variant's axis sizes, in any device order.
    """
    loc = location(path)
    sig = signature(loc)
    count = int(mesh.size) if mesh is not None else jax.device_count()
    by_count = {v["device_count"]: v for v in sig["variants"]}
    variant = by_count.get(count)
    if variant is None:
        raise ExportError(
            f"{loc.url} was exported for {sorted(by_count)} device(s), not {count}; serve on "
            f"one of those counts (mesh= over that many devices), or re-export with "
            f"device_counts including {count}"
        )
    exported = _read_artifact(loc, sig, variant)
    mesh = _serving_mesh(mesh, sig, variant, loc)
    params = _restore_params(loc, sig, mesh)
    in_shardings = tuple(NamedSharding(mesh, spec_from_json(i["spec"])) for i in sig["inputs"])
    return Served(loc.url, sig, mesh, variant, in_shardings, params, exported)


def _read_artifact(loc: Location, sig: dict, variant: dict) -> jax.export.Exported:
    where = f"{loc.url}/{variant['file']}"
    writer = sig.get("versions", {}).get("jax", "?")
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    ccv = variant["calling_convention_version"]
    if not lo <= ccv <= hi:
        raise ExportVersionError(
            f"{where}: written by jax {writer} with calling convention version {ccv}; the "
            f"installed jax {jax.__version__} supports versions {lo}..{hi}. Serve with a jax "
            "that supports it, or re-export with the installed jax"
        )
    schema, mine = variant.get("serialization_version"), _schema_version()
    if schema is not None and mine is not None and schema > mine:
        raise ExportVersionError(
            f"{where}: written by jax {writer} with serialization version {schema}; the "
            f"installed jax {jax.__version__} reads up to version {mine}. Upgrade jax to at "
            f"least {writer}, or re-export with the installed jax"
        )
    _require_flatbuffers(loc)
    folder, _, name = variant["file"].rpartition("/")
    blob = loc.join(folder).read_bytes(name) if folder else loc.read_bytes(name)
    if blob is None:
        raise ExportError(f"{where} is missing; the export is incomplete, re-export it")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != variant["sha256"]:
        raise ExportChecksumError(
            f"{where} is corrupt: its SHA-256 is {digest}, {SIGNATURE_FILE} records "
            f"{variant['sha256']}; copy the export again or re-export it"
        )
    try:
        exported = jax.export.deserialize(bytearray(blob))
    except Exception as e:
        raise ExportError(f"{where}: jax.export cannot deserialize it: {e}") from e
    platform = jax.export.default_export_platform()
    if platform not in exported.platforms:
        raise ExportError(
            f"{where} was exported for platforms {list(exported.platforms)}, but this process "
            f"serves on {platform!r}; re-export with platforms=[..., {platform!r}]"
        )
    return exported


def _serving_mesh(mesh: Mesh | None, sig: dict, variant: dict, loc: Location) -> Mesh:
    names = tuple(sig["mesh"]["axis_names"])
    sizes = tuple(variant["axis_sizes"])
    types = tuple(AxisType[t] for t in sig["mesh"]["axis_types"])
    if mesh is None:
        return jax.make_mesh(sizes, names, axis_types=types)
    got = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
    if tuple(mesh.axis_names) != names or tuple(mesh.devices.shape) != sizes:
        raise ExportError(
            f"{loc.url}: the serving mesh has axes {got}, but the {variant['device_count']}-"
            f"device variant was exported for {dict(zip(names, sizes, strict=True))}; build "
            "the mesh with those axis names and sizes (any device order), or pass mesh=None"
        )
    if tuple(mesh.axis_types) != types:  # same devices and layout, the exported axis types
        mesh = Mesh(mesh.devices, names, axis_types=types)
    return mesh


def _restore_params(loc: Location, sig: dict, mesh: Mesh) -> list:
    records = sig["params"]["leaves"]
    if not records:
        return []
    target = tree_lib.unflatten_paths(
        [(r["path"], NamedSharding(mesh, spec_from_json(r["spec"]))) for r in records]
    )
    restored = checkpoint.restore(loc.join(sig["params"]["dir"]), target=target)
    by_name = {tree_lib.path_name(p): v for p, v in tree_lib.flatten(restored)}
    return [by_name[r["name"]] for r in records]
