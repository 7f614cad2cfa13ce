"""The export directory on disk: its layout, writing and committing it, reading it back.

An export is one directory::

    path/
      signature.json                  inputs, outputs, mesh axes, variants, versions, checksums
      params/                         the parameters: one jaxckpt checkpoint, stored once
      artifacts/devices_<n>.jaxexport a serialized ``jax.export.Exported`` per device count

:func:`write` writes ``signature.json`` last, so its presence marks a finished export;
:func:`prepare_target` refuses a finished one and clears what an unfinished one left. Reading
checks the format version (:func:`signature`) and, per artifact, the calling convention and
serialization versions, the SHA-256 and the platform (:func:`read_artifact`). The signature's
contents are built by :mod:`jaxckpt.export`; :mod:`jaxckpt._src.export.serving` loads an export.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version
from typing import Any

import jax

from ...errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ExportChecksumError,
    ExportError,
    ExportVersionError,
    FormatVersionError,
    ManifestError,
)
from .. import multihost, saving
from ..fields import MAX_NDIM, Fields, parse_json
from ..manifest import (
    AXIS_TYPES,
    FORMAT_VERSION,
    check_format_version,
    path_entry,
)
from ..storage import Location, location

EXPORT_FORMAT = "jaxckpt.export"
EXPORT_FORMAT_VERSION = FORMAT_VERSION  # one version scheme for every file jaxckpt writes
SIGNATURE_FILE = "signature.json"
PARAMS_DIR = "params"
ARTIFACTS_DIR = "artifacts"

# The only symbolic dimension that may be sharded: a plain symbol such as "b" (not "2*b").
PLAIN_SYMBOL = re.compile(r"[A-Za-z_]\w*")
_BARRIER_TIMEOUT_S = 600.0


def artifact_file(count: int) -> str:
    """The artifact's path, relative to the export, for the ``count``-device variant."""
    return f"{ARTIFACTS_DIR}/devices_{count}.jaxexport"


def shape_json(shape: Sequence[Any]) -> list[int | str]:
    """A shape as written in the signature: ints, and strings for symbolic dimensions."""
    return [str(d) if jax.export.is_symbolic_dim(d) else int(d) for d in shape]


def package_version(name: str) -> str:
    """The installed version of the distribution ``name`` ("?" when it is not installed)."""
    try:
        return dist_version(name)
    except PackageNotFoundError:
        return "?"


def schema_version() -> int | None:
    """The installed jax.export flatbuffer schema version (None when jax hides it)."""
    try:
        from jax._src.export import serialization
    except ImportError:
        return None
    return getattr(serialization, "_SERIALIZATION_VERSION", None)


def require_flatbuffers(loc: Location) -> None:
    """Raises ExportError unless jax.export can (de)serialize: it needs ``flatbuffers``."""
    try:
        import flatbuffers  # noqa: F401
    except ImportError as e:
        raise ExportError(
            f"{loc.url}: jax.export needs the 'flatbuffers' package to (de)serialize "
            "artifacts; install it (pip install flatbuffers)"
        ) from e


# --- writing --------------------------------------------------------------------------------


def prepare_target(loc: Location) -> None:
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


def variant_record(
    count: int, sizes: Sequence[int], exp: jax.export.Exported, blob: bytes, divisors: list
) -> dict:
    """The signature's entry for the ``count``-device artifact ``blob`` (serialized ``exp``)."""
    return {
        "device_count": count,
        "axis_sizes": list(sizes),
        "file": artifact_file(count),
        "sha256": hashlib.sha256(blob).hexdigest(),
        "bytes": len(blob),
        "calling_convention_version": exp.calling_convention_version,
        "serialization_version": schema_version(),
        "platforms": list(exp.platforms),
        "input_divisors": divisors,
    }


def write(loc: Location, params: Any, blobs: dict[str, bytes], sig: dict) -> None:
    """Writes the parameters, then the artifacts, then ``signature.json``, which commits."""
    saving.save(loc.join(PARAMS_DIR), params, custom_metadata={"jaxckpt.export": sig["function"]})
    if multihost.process_index() == 0:
        for file, blob in blobs.items():
            folder, _, name = file.rpartition("/")
            loc.join(folder).write_bytes(name, blob)
        loc.write_bytes(SIGNATURE_FILE, json.dumps(sig, indent=1).encode())  # commit
    multihost.barrier(multihost.unique_name("export-committed"), _BARRIER_TIMEOUT_S)


# --- reading --------------------------------------------------------------------------------


def signature(path: str | os.PathLike) -> dict:
    """The ``signature.json`` of the export at ``path``, checked for format and version."""
    loc = location(path)
    text = loc.read_bytes(SIGNATURE_FILE)
    if text is None:
        raise CheckpointNotFoundError(
            f"{loc.url} holds no {SIGNATURE_FILE}: it is not a jaxckpt export, or its export "
            "never finished; pass the directory jaxckpt.export.save wrote"
        )
    where = f"{loc.url}/{SIGNATURE_FILE}"
    try:
        sig = parse_json(text, where=where, what=SIGNATURE_FILE)
        if not isinstance(sig, dict) or sig.get("format") != EXPORT_FORMAT:
            raise ExportError(f"{where} is not a {EXPORT_FORMAT} signature; re-export")
        check_format_version(sig, where=where)
        check_signature(Fields(where), sig)
    except FormatVersionError as e:
        raise ExportVersionError(str(e)) from e
    except ManifestError as e:
        raise ExportError(f"{e} (re-export it)") from e
    return sig


def check_signature(f: Fields, sig: dict) -> None:
    """Every field serving reads, checked: types, ranges, names against the mesh axes, the
    artifact and parameter paths (fixed names inside the export, never elsewhere)."""
    from ..tree import path_name

    for key in ("function", "created"):
        f.text(sig.get(key, ""), key)
    f.opt_dict(sig, "versions")
    mesh = f.obj(f.need(sig, "mesh"), "mesh")
    axes = f.items(f.need(mesh, "axis_names", "mesh."), "mesh.axis_names", f.text)
    if len(set(axes)) != len(axes):
        f.bad("mesh.axis_names", "names an axis twice", axes)
    types = f.items(f.need(mesh, "axis_types", "mesh."), "mesh.axis_types", f.text)
    if len(types) != len(axes) or any(t not in AXIS_TYPES for t in types):
        f.bad("mesh.axis_types", f"must be {len(axes)} of {list(AXIS_TYPES)}", types)
    if "exported_from" in mesh:
        f.shape(mesh["exported_from"], "mesh.exported_from", lo=1)
    inputs = f.items(f.need(sig, "inputs"), "inputs", lambda v, at: _value(f, v, at, axes))
    for i, v in enumerate(inputs):
        if v.get("index") != i:
            f.bad(f"inputs[{i}].index", f"must be {i}", v.get("index"))
    f.items(f.need(sig, "outputs"), "outputs", lambda v, at: _value(f, v, at, axes))
    params = f.obj(f.need(sig, "params"), "params")
    if params.get("dir") != PARAMS_DIR:
        f.bad("params.dir", f"must be {PARAMS_DIR!r} (inside the export)", params.get("dir"))
    f.integer(params.get("nbytes", 0), "params.nbytes")
    leaves = f.items(f.need(params, "leaves", "params."), "params.leaves", f.obj)
    for i, leaf in enumerate(leaves):
        at = f"params.leaves[{i}]."
        path = f.items(f.need(leaf, "path", at), at + "path", lambda p, a: path_entry(f, p, a))
        if f.need(leaf, "name", at) != path_name(path):
            f.bad(at + "name", f"must be the path joined, {path_name(path)!r}", leaf["name"])
        f.spec(f.need(leaf, "spec", at), at + "spec", axes, MAX_NDIM)
    if len({leaf["name"] for leaf in leaves}) != len(leaves):
        f.bad("params.leaves", "names a leaf twice", [leaf["name"] for leaf in leaves])
    variants = f.items(f.need(sig, "variants"), "variants", f.obj)
    counts = [_variant(f, v, f"variants[{i}].", axes, inputs) for i, v in enumerate(variants)]
    if not counts or len(set(counts)) != len(counts):
        f.bad("variants", "must list each device count once (and at least one)", counts)


def _value(f: Fields, v: Any, at: str, axes: list[str]) -> dict:
    """An input or output: name, shape (ints, or strings for symbolic dims), dtype, spec."""
    v = f.obj(v, at)
    at += "."
    f.text(f.need(v, "name", at), at + "name")
    shape = f.items(f.need(v, "shape", at), at + "shape", lambda d, a: _dim(f, d, a))
    if len(shape) > MAX_NDIM:
        f.bad(at + "shape", f"has more than {MAX_NDIM} dimensions", shape)
    f.dtype(f.need(v, "dtype", at), at + "dtype")
    f.spec(f.need(v, "spec", at), at + "spec", axes, len(shape))
    return v


def _dim(f: Fields, d: Any, at: str) -> int | str:
    if isinstance(d, str) and d.strip():
        return d
    return f.integer(d, at)


def _variant(f: Fields, v: dict, at: str, axes: list[str], inputs: list[dict]) -> int:
    """Checks one variant; returns its device count."""
    count = f.integer(f.need(v, "device_count", at), at + "device_count", lo=1, hi=1 << 24)
    sizes = f.shape(f.need(v, "axis_sizes", at), at + "axis_sizes", lo=1)
    if len(sizes) != len(axes) or math.prod(sizes) != count:
        f.bad(at + "axis_sizes", f"must be {len(axes)} sizes whose product is {count}", sizes)
    if v.get("file") != artifact_file(count):
        f.bad(at + "file", f"must be {artifact_file(count)!r} (inside the export)", v.get("file"))
    digest = f.text(f.need(v, "sha256", at), at + "sha256")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        f.bad(at + "sha256", "must be 64 hexadecimal digits", digest)
    f.integer(v.get("bytes", 0), at + "bytes")
    f.integer(f.need(v, "calling_convention_version", at), at + "calling_convention_version")
    if v.get("serialization_version") is not None:
        f.integer(v["serialization_version"], at + "serialization_version")
    f.items(f.need(v, "platforms", at), at + "platforms", f.text)
    ways = dict(zip(axes, sizes, strict=True))
    want = [
        [
            math.prod(ways[a] for a in ([e] if isinstance(e, str) else e or []))
            for e in i["spec"] + [None] * (len(i["shape"]) - len(i["spec"]))
        ]
        for i in inputs
    ]
    if v.get("input_divisors") != want:  # how many ways each input dimension is split
        f.bad(
            at + "input_divisors",
            f"must be {want} (the inputs' specs on this mesh)",
            v.get("input_divisors"),
        )
    return count


def read_artifact(loc: Location, sig: dict, variant: dict) -> jax.export.Exported:
    """The variant's ``Exported``, once its versions, checksum and platform check out."""
    where = f"{loc.url}/{variant['file']}"
    writer = (sig.get("versions") or {}).get("jax", "?")
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    ccv = variant["calling_convention_version"]
    if not lo <= ccv <= hi:
        raise ExportVersionError(
            f"{where}: written by jax {writer} with calling convention version {ccv} (as "
            f"{SIGNATURE_FILE} records); the "
            f"installed jax {jax.__version__} supports versions {lo}..{hi}. Serve with a jax "
            "that supports it, or re-export with the installed jax"
        )
    schema, mine = variant.get("serialization_version"), schema_version()
    if schema is not None and mine is not None and schema > mine:
        raise ExportVersionError(
            f"{where}: written by jax {writer} with serialization version {schema} (as "
            f"{SIGNATURE_FILE} records); the "
            f"installed jax {jax.__version__} reads up to version {mine}. Upgrade jax to at "
            f"least {writer}, or re-export with the installed jax"
        )
    require_flatbuffers(loc)
    blob = loc.read_bytes(variant["file"])
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
    matches_signature(exported, sig, where)
    platform = jax.export.default_export_platform()
    if platform not in exported.platforms:
        raise ExportError(
            f"{where} was exported for platforms {list(exported.platforms)}, but this process "
            f"serves on {platform!r}; re-export with platforms=[..., {platform!r}]"
        )
    return exported


def matches_signature(exported: jax.export.Exported, sig: dict, where: str) -> None:
    """Refuses a signature that disagrees with the artifact it describes: how many
    parameters, each input's and output's shape and dtype."""
    n = len(sig["params"]["leaves"])
    avals, inputs = exported.in_avals, sig["inputs"]
    described = [(i, i["shape"], i["dtype"]) for i in [*inputs, *sig["outputs"]]]
    got = [(shape_json(a.shape), str(a.dtype)) for a in [*avals[n:], *exported.out_avals]]
    if (
        len(avals) != n + len(inputs)
        or len(got) != len(described)
        or any(
            not _same_aval(shape, dtype, *g)
            for (_, shape, dtype), g in zip(described, got, strict=True)
        )
    ):
        raise ExportError(
            f"{where}: {SIGNATURE_FILE} describes {n} parameter(s), inputs "
            f"{[(i['shape'], i['dtype']) for i in inputs]} and outputs "
            f"{[(o['shape'], o['dtype']) for o in sig['outputs']]}, but the artifact takes "
            f"{len(avals)} values, the last {len(avals) - n} of them "
            f"{[a for a in got[: len(avals) - n]]}, and returns {got[len(avals) - n :]}; "
            "the signature is damaged: copy the export again or re-export it"
        )


def _same_aval(shape: list, dtype: str, got_shape: list, got_dtype: str) -> bool:
    """Sizes equal where the signature gives a number; symbolic where it gives a symbol (the
    artifact may spell it differently: ``4*b_div4`` for ``b`` split 4 ways)."""
    return (
        str(jax.numpy.dtype(dtype)) == got_dtype
        and len(shape) == len(got_shape)
        and all(
            type(a) is type(b) and (isinstance(a, str) or a == b)
            for a, b in zip(shape, got_shape, strict=True)
        )
    )


def matches_params(params: list, exported: jax.export.Exported, where: str) -> None:
    """Refuses parameters whose shapes or dtypes differ from what the artifact takes."""
    for i, (p, a) in enumerate(zip(params, exported.in_avals, strict=False)):
        if tuple(p.shape) != tuple(a.shape) or p.dtype != a.dtype:
            raise ExportError(
                f"{where}: parameter {i} restored as {p.dtype}{list(p.shape)}, but the artifact "
                f"takes {a.dtype}{list(a.shape)}; {SIGNATURE_FILE}'s params.leaves are damaged "
                "or reordered: copy the export again or re-export it"
            )
