"""The export directory on disk: its layout, writing and committing it, reading it back.

An export is one directory::

    path/
      signature.json                  inputs, outputs, mesh axes, variants, versions, checksums
      params/                         the parameters: one jaxckpt checkpoint, stored once
      artifacts/devices_<n>.jaxexport a serialized ``jax.export.Exported`` per device count

``signature.json`` is a :class:`Signature` (``to_json``/``from_json``, one record per part of
it). :func:`write` writes it last, so its presence marks a finished export;
:func:`prepare_target` refuses a finished one and clears what an unfinished one left. Reading
checks the format version and every field (:func:`read_signature`) and, per artifact, the
calling convention and serialization versions, the SHA-256 and the platform
(:func:`read_artifact`). The signature's contents are built by :mod:`jaxckpt._src.export.save`;
:mod:`jaxckpt._src.export.serving` loads an export.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import jax
import numpy as np
from jax.sharding import PartitionSpec

from ...errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    ChecksumError,
    ExportError,
    FormatVersionError,
    ManifestError,
)
from .. import multihost, saving
from ..fields import MAX_NDIM, Fields, parse_json
from ..manifest import AXIS_TYPES, FORMAT_VERSION, check_format_version, path_entry
from ..sharding import spec_to_json
from ..storage import Location, location
from ..tree import PathJson, path_name

EXPORT_FORMAT = "jaxckpt.export"
EXPORT_FORMAT_VERSION = FORMAT_VERSION  # one version scheme for every file jaxckpt writes
SIGNATURE_FILE = "signature.json"
PARAMS_DIR = "params"
ARTIFACTS_DIR = "artifacts"

# The only symbolic dimension that may be sharded: a plain symbol such as "b" (not "2*b").
PLAIN_SYMBOL = re.compile(r"[A-Za-z_]\w*")
_BARRIER_TIMEOUT_S = 600.0
T = TypeVar("T")


def artifact_file(count: int) -> str:
    """The artifact's path, relative to the export, for the ``count``-device variant."""
    return f"{ARTIFACTS_DIR}/devices_{count}.jaxexport"


def shape_json(shape: Sequence[Any]) -> list[int | str]:
    """A shape as written in the signature: ints, and strings for symbolic dimensions."""
    return [str(d) if jax.export.is_symbolic_dim(d) else int(d) for d in shape]


def split_ways(spec: Iterable[Any], ndim: int, sizes: Mapping[str, int]) -> list[int]:
    """How many ways ``spec`` (a PartitionSpec, or one as JSON) splits each of ``ndim``
    dimensions on a mesh of axis ``sizes``."""
    entries = [*spec, *[None] * ndim][:ndim]
    return [math.prod(sizes[a] for a in ((e,) if isinstance(e, str) else e or ())) for e in entries]


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
        import flatbuffers  # type: ignore[import-untyped]  # noqa: F401  (ships no stubs)
    except ImportError as e:
        raise ExportError(
            f"{loc.url}: jax.export needs the 'flatbuffers' package to (de)serialize "
            "artifacts; install it (pip install flatbuffers)"
        ) from e


# --- signature.json as records ----------------------------------------------------------------


def _present(fields: list[tuple[str, Any]]) -> dict[str, Any]:
    """A record's fields as JSON, in order, leaving out those that are None (a file may lack
    them), except ``serialization_version``, which a writer records as null when unknown."""
    return {k: v for k, v in fields if v is not None or k == "serialization_version"}


@dataclass(frozen=True)
class _Record:
    def to_json(self) -> dict[str, Any]:
        """The record as in ``signature.json``, key for key."""
        return dataclasses.asdict(self, dict_factory=_present)


def _opt(
    f: Fields, doc: dict[str, Any], key: str, check: Callable[[Any, str], T], at: str = ""
) -> T | None:
    """``doc[key]`` checked, or None where the file lacks it."""
    return check(doc[key], at + key) if key in doc else None


@dataclass(frozen=True)
class Value(_Record):
    """An input (``index``: its position) or an output (``index`` None) of the function."""

    index: int | None
    name: str
    shape: list[int | str]  # ints, and strings for symbolic dimensions
    dtype: str
    spec: list[Any]  # a PartitionSpec as JSON

    @classmethod
    def of(
        cls, index: int | None, name: str, sds: jax.ShapeDtypeStruct, spec: PartitionSpec
    ) -> Value:
        """The record of a value of shape and dtype ``sds``, sharded per PartitionSpec ``spec``."""
        return cls(index, name, shape_json(sds.shape), str(np.dtype(sds.dtype)), spec_to_json(spec))

    @classmethod
    def from_json(cls, f: Fields, v: Any, at: str, axes: list[str]) -> Value:
        """Name, shape (ints, or strings for symbolic dims), dtype, spec; ``index`` as found."""
        v = f.obj(v, at)
        at += "."
        name = f.text(f.need(v, "name", at), at + "name")
        shape = f.items(
            f.need(v, "shape", at),
            at + "shape",
            lambda d, a: d if isinstance(d, str) and d.strip() else f.integer(d, a),
        )
        if len(shape) > MAX_NDIM:
            f.bad(at + "shape", f"has more than {MAX_NDIM} dimensions", shape)
        f.dtype(f.need(v, "dtype", at), at + "dtype")
        spec = f.spec(f.need(v, "spec", at), at + "spec", axes, len(shape))
        return cls(v.get("index"), name, shape, v["dtype"], spec)


@dataclass(frozen=True)
class MeshAxes(_Record):
    """The export mesh: axis names and types, and its sizes (``exported_from``)."""

    axis_names: list[str]
    axis_types: list[str]
    exported_from: list[int] | None

    @classmethod
    def from_json(cls, f: Fields, v: Any) -> MeshAxes:
        mesh = f.obj(v, "mesh")
        axes = f.items(f.need(mesh, "axis_names", "mesh."), "mesh.axis_names", f.text)
        if len(set(axes)) != len(axes):
            f.bad("mesh.axis_names", "names an axis twice", axes)
        types = f.items(f.need(mesh, "axis_types", "mesh."), "mesh.axis_types", f.text)
        if len(types) != len(axes) or any(t not in AXIS_TYPES for t in types):
            f.bad("mesh.axis_types", f"must be {len(axes)} of {list(AXIS_TYPES)}", types)
        sizes = _opt(f, mesh, "exported_from", lambda v, a: f.shape(v, a, lo=1), "mesh.")
        return cls(axes, types, sizes)


@dataclass(frozen=True)
class ParamLeaf(_Record):
    """One parameter: its pytree path (and ``name``, the path joined) and PartitionSpec."""

    name: str
    path: PathJson
    shape: Any  # shape and dtype: recorded for readers, unused (and unchecked) when serving
    dtype: Any
    spec: list[Any]

    @classmethod
    def from_json(cls, f: Fields, leaf: dict[str, Any], at: str, axes: list[str]) -> ParamLeaf:
        path = f.items(f.need(leaf, "path", at), at + "path", lambda p, a: path_entry(f, p, a))
        if f.need(leaf, "name", at) != path_name(path):
            f.bad(at + "name", f"must be the path joined, {path_name(path)!r}", leaf["name"])
        spec = f.spec(f.need(leaf, "spec", at), at + "spec", axes, MAX_NDIM)
        return cls(leaf["name"], path, leaf.get("shape"), leaf.get("dtype"), spec)


@dataclass(frozen=True)
class Params(_Record):
    """The parameters: their checkpoint's directory (always ``params``), bytes and leaves."""

    dir: str
    nbytes: int | None
    leaves: list[ParamLeaf]

    @classmethod
    def from_json(cls, f: Fields, v: Any, axes: list[str]) -> Params:
        params = f.obj(v, "params")
        if params.get("dir") != PARAMS_DIR:
            f.bad("params.dir", f"must be {PARAMS_DIR!r} (inside the export)", params.get("dir"))
        nbytes = _opt(f, params, "nbytes", f.integer, "params.")
        found = f.items(f.need(params, "leaves", "params."), "params.leaves", f.obj)
        leaves = [
            ParamLeaf.from_json(f, x, f"params.leaves[{i}].", axes) for i, x in enumerate(found)
        ]
        if len({leaf.name for leaf in leaves}) != len(leaves):
            f.bad("params.leaves", "names a leaf twice", [leaf.name for leaf in leaves])
        return cls(PARAMS_DIR, nbytes, leaves)


@dataclass(frozen=True)
class Variant(_Record):
    """The artifact for one device count: the mesh's axis sizes there, where the artifact is,
    its digest and versions, and how many ways each input dimension is split."""

    device_count: int
    axis_sizes: list[int]
    file: str
    sha256: str
    bytes: int | None
    calling_convention_version: int
    serialization_version: int | None
    platforms: list[str]
    input_divisors: list[list[int]]

    @classmethod
    def from_json(
        cls, f: Fields, v: dict[str, Any], at: str, axes: list[str], inputs: Sequence[Value]
    ) -> Variant:
        count = f.integer(f.need(v, "device_count", at), at + "device_count", lo=1, hi=1 << 24)
        sizes = f.shape(f.need(v, "axis_sizes", at), at + "axis_sizes", lo=1)
        if len(sizes) != len(axes) or math.prod(sizes) != count:
            f.bad(at + "axis_sizes", f"must be {len(axes)} sizes whose product is {count}", sizes)
        file = artifact_file(count)
        if v.get("file") != file:
            f.bad(at + "file", f"must be {file!r} (inside the export)", v.get("file"))
        digest = f.text(f.need(v, "sha256", at), at + "sha256")
        if not re.fullmatch(r"[0-9a-f]{64}", digest):
            f.bad(at + "sha256", "must be 64 hexadecimal digits", digest)
        nbytes = _opt(f, v, "bytes", f.integer, at)
        ccv = f.integer(
            f.need(v, "calling_convention_version", at), at + "calling_convention_version"
        )
        schema = v.get("serialization_version")
        if schema is not None:
            f.integer(schema, at + "serialization_version")
        platforms = f.items(f.need(v, "platforms", at), at + "platforms", f.text)
        ways = dict(zip(axes, sizes, strict=True))
        want = [split_ways(i.spec, len(i.shape), ways) for i in inputs]
        if v.get("input_divisors") != want:  # how many ways each input dimension is split
            f.bad(
                at + "input_divisors",
                f"must be {want} (the inputs' specs on this mesh)",
                v.get("input_divisors"),
            )
        return cls(count, sizes, file, digest, nbytes, ccv, schema, platforms, want)


def variant_record(
    sizes: Sequence[int], exp: jax.export.Exported, blob: bytes, divisors: list[list[int]]
) -> Variant:
    """The signature's entry for the artifact ``blob`` (``exp`` serialized) for a mesh of
    ``sizes``; ``divisors``: how many ways each input dimension is split there."""
    count, ccv, schema = math.prod(sizes), exp.calling_convention_version, schema_version()
    digest, platforms = hashlib.sha256(blob).hexdigest(), list(exp.platforms)
    return Variant(
        count, [*sizes], artifact_file(count), digest, len(blob), ccv, schema, platforms, divisors
    )


@dataclass(frozen=True)
class Signature(_Record):
    """``signature.json``: what was exported (the function's name, inputs and outputs), on
    which mesh, from which versions, where the parameters are, and one variant per device
    count."""

    format: str
    format_version: list[int] | int  # an int: a file written before 1.1
    function: str | None
    created: str | None
    versions: dict[str, Any] | None
    mesh: MeshAxes
    inputs: list[Value]
    outputs: list[Value]
    params: Params
    variants: list[Variant]

    @classmethod
    def from_json(cls, doc: Any, where: str) -> Signature:
        """``doc``, read from ``where``, checked: the format and its version, then every
        field serving reads: types, ranges, names against the mesh axes, the artifact and
        parameter paths (fixed names inside the export, never elsewhere). Damage raises
        ManifestError, a newer major version FormatVersionError, naming ``where``."""
        if not isinstance(doc, dict) or doc.get("format") != EXPORT_FORMAT:
            raise ExportError(f"{where} is not a {EXPORT_FORMAT} signature; re-export")
        check_format_version(doc, where=where)
        f = Fields(where)
        function, created = (_opt(f, doc, key, f.text) for key in ("function", "created"))
        writers = f.opt_dict(doc, "versions")
        mesh = MeshAxes.from_json(f, f.need(doc, "mesh"))

        def value(v: Any, at: str) -> Value:
            return Value.from_json(f, v, at, mesh.axis_names)

        ins = f.items(f.need(doc, "inputs"), "inputs", value)
        for i, v in enumerate(ins):
            if v.index != i:
                f.bad(f"inputs[{i}].index", f"must be {i}", v.index)
        found = f.items(f.need(doc, "outputs"), "outputs", value)
        outs = [dataclasses.replace(v, index=None) for v in found]
        params = Params.from_json(f, f.need(doc, "params"), mesh.axis_names)
        found = f.items(f.need(doc, "variants"), "variants", f.obj)
        variants = [
            Variant.from_json(f, v, f"variants[{i}].", mesh.axis_names, ins)
            for i, v in enumerate(found)
        ]
        counts = [v.device_count for v in variants]
        if not counts or len(set(counts)) != len(counts):
            f.bad("variants", "must list each device count once (and at least one)", counts)
        version = doc["format_version"]
        return cls(
            EXPORT_FORMAT, version, function, created, writers, mesh, ins, outs, params, variants
        )


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


def write(loc: Location, params: Any, blobs: dict[str, bytes], sig: Signature) -> None:
    """Writes the parameters, then the artifacts, then ``signature.json``, which commits."""
    saving.save(loc.join(PARAMS_DIR).url, params, custom_metadata={"jaxckpt.export": sig.function})
    if multihost.process_index() == 0:
        for file, blob in blobs.items():
            folder, _, name = file.rpartition("/")
            loc.join(folder).write_bytes(name, blob)
        loc.write_bytes(SIGNATURE_FILE, json.dumps(sig.to_json(), indent=1).encode())  # commit
    multihost.barrier(multihost.unique_name("export-committed"), _BARRIER_TIMEOUT_S)


# --- reading --------------------------------------------------------------------------------


def signature(path: str | os.PathLike) -> dict[str, Any]:
    """The ``signature.json`` of the export at ``path`` as written (with any fields a newer
    minor version added), once it checks out for format and version."""
    return _read(location(path))[0]


def read_signature(loc: Location) -> Signature:
    """The export's :class:`Signature`; damage is an ExportError, a newer major format
    version a FormatVersionError, each naming the file."""
    return _read(loc)[1]


def _read(loc: Location) -> tuple[dict[str, Any], Signature]:
    text = loc.read_bytes(SIGNATURE_FILE)
    if text is None:
        raise CheckpointNotFoundError(
            f"{loc.url} holds no {SIGNATURE_FILE}: it is not a jaxckpt export, or its export "
            "never finished; pass the directory jaxckpt.export.save wrote"
        )
    where = f"{loc.url}/{SIGNATURE_FILE}"
    try:
        doc = parse_json(text, where=where, what=SIGNATURE_FILE)
        return doc, Signature.from_json(doc, where)
    except ManifestError as e:
        raise ExportError(f"{e} (re-export it)") from e


def read_artifact(loc: Location, sig: Signature, variant: Variant) -> jax.export.Exported:
    """The variant's ``Exported``, once its versions, checksum and platform check out."""
    where = f"{loc.url}/{variant.file}"
    writer = (sig.versions or {}).get("jax", "?")
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    ccv = variant.calling_convention_version
    if not lo <= ccv <= hi:
        raise FormatVersionError(
            f"{where}: written by jax {writer} with calling convention version {ccv} (as "
            f"{SIGNATURE_FILE} records); the installed jax {jax.__version__} supports versions "
            f"{lo}..{hi}. Serve with a jax that supports it, or re-export with the installed jax"
        )
    schema, mine = variant.serialization_version, schema_version()
    if schema is not None and mine is not None and schema > mine:
        raise FormatVersionError(
            f"{where}: written by jax {writer} with serialization version {schema} (as "
            f"{SIGNATURE_FILE} records); the installed jax {jax.__version__} reads up to "
            f"version {mine}. Upgrade jax to at least {writer}, or re-export with the installed jax"
        )
    require_flatbuffers(loc)
    blob = loc.read_bytes(variant.file)
    if blob is None:
        raise ExportError(f"{where} is missing; the export is incomplete, re-export it")
    digest = hashlib.sha256(blob).hexdigest()
    if digest != variant.sha256:
        raise ChecksumError(
            f"{where} is corrupt: its SHA-256 is {digest}, {SIGNATURE_FILE} records "
            f"{variant.sha256}; copy the export again or re-export it"
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


def matches_signature(exported: jax.export.Exported, sig: Signature, where: str) -> None:
    """Refuses a signature that disagrees with the artifact it describes: how many
    parameters, each input's and output's shape and dtype."""
    n, k = len(sig.params.leaves), len(sig.inputs)
    avals = exported.in_avals
    described = [(v.shape, v.dtype) for v in [*sig.inputs, *sig.outputs]]
    got = [(shape_json(a.shape), str(a.dtype)) for a in [*avals[n:], *exported.out_avals]]
    if (
        len(avals) != n + k
        or len(got) != len(described)
        or any(not _same_aval(*d, *g) for d, g in zip(described, got, strict=True))
    ):
        raise ExportError(
            f"{where}: {SIGNATURE_FILE} describes {n} parameter(s), inputs "
            f"{described[:k]} and outputs {described[k:]}, but the artifact takes "
            f"{len(avals)} values, the last {len(avals) - n} of them "
            f"{got[: len(avals) - n]}, and returns {got[len(avals) - n :]}; "
            "the signature is damaged: copy the export again or re-export it"
        )


def _same_aval(
    shape: list[int | str], dtype: str, got_shape: list[int | str], got_dtype: str
) -> bool:
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


def matches_params(params: list[jax.Array], exported: jax.export.Exported, where: str) -> None:
    """Refuses parameters whose shapes or dtypes differ from what the artifact takes."""
    for i, (p, a) in enumerate(zip(params, exported.in_avals, strict=False)):
        if tuple(p.shape) != tuple(a.shape) or p.dtype != a.dtype:
            raise ExportError(
                f"{where}: parameter {i} restored as {p.dtype}{list(p.shape)}, but the artifact "
                f"takes {a.dtype}{list(a.shape)}; {SIGNATURE_FILE}'s params.leaves are damaged "
                "or reordered: copy the export again or re-export it"
            )
