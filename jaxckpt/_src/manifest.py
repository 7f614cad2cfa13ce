"""The manifest: one JSON record per checkpoint describing every leaf (see docs/FORMAT.md)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from ..errors import CheckpointNotFoundError, FormatVersionError, ManifestError
from .fields import MAX_BYTES, MAX_PROCESSES, Fields, parse_json
from .sharding import spec_from_json
from .storage import Location, location

FORMAT_NAME = "jaxckpt"
FORMAT_VERSION = (1, 10)  # (major, minor): a reader accepts any minor of its own major
MANIFEST_FILE = "manifest.json"
COMMIT_FILE = "COMMITTED"
ARRAYS_DIR = "arrays"


@dataclass(frozen=True)
class LeafRecord:
    """One pytree leaf.

    kind: ``"array"`` (jax.Array), ``"numpy"`` (np.ndarray / NumPy scalar), ``"prng_key"``
    (typed key; its key data is stored), ``"python"`` (int/float/bool/str/None in ``value``).
    """

    path: list
    name: str
    kind: str
    shape: list[int] = field(default_factory=list)
    dtype: str | None = None
    stored_dtype: str | None = None  # zarr data type, when it differs from ``dtype``
    sharding: dict | None = None
    chunk_shape: list[int] | None = None
    nbytes: int = 0
    # [[chunk grid coords], process index] (a save may hand tuples; JSON gives lists)
    chunk_writers: Sequence[Sequence[Any]] | None = None
    writer_salt: int | None = None  # 1.3: named shardings' writers follow the split rule
    value: Any = None
    python_type: str | None = None
    prng_impl: str | None = None
    scalar: bool = False  # a NumPy scalar (np.float32(1.0)) rather than a 0-d array
    float_bits: str | None = None  # 1.5: a NaN Python float's 64 bits (JSON drops its payload)
    fingerprint: str | None = None  # 1.10: the values' fingerprint, 3 lanes (io/fingerprint.py)

    @property
    def has_array(self) -> bool:
        return self.kind in ("array", "numpy", "prng_key")

    @property
    def data_dtype(self) -> np.dtype:
        """The dtype of the leaf's data (a PRNG key's: its uint32 key data)."""
        return np.dtype(np.uint32 if self.kind == "prng_key" else self.dtype)

    @property
    def storage_dtype(self) -> np.dtype:
        """The zarr dtype the data is stored as (unsigned bits where zarr lacks the dtype)."""
        return np.dtype(self.stored_dtype) if self.stored_dtype else self.data_dtype

    def to_dict(self) -> dict:
        """The record as stored: fields left at None/False are omitted. (Its lists are the
        record's own, not copies: for JSON, which ``dataclasses.asdict``'s deep copies
        made a noticeable part of a save's time: docs/MEASURED.md.)"""
        out = {}
        for k in _LEAF_FIELD_ORDER:
            v = getattr(self, k)
            if (v is not None and v is not False) or (k == "value" and self.kind == "python"):
                out[k] = v
        return out

    @classmethod
    def from_dict(cls, doc: dict) -> LeafRecord:
        """The record in ``doc``, ignoring fields a newer minor version added."""
        return cls(**{k: v for k, v in doc.items() if k in _LEAF_FIELDS})


_LEAF_FIELD_ORDER = tuple(f.name for f in dataclasses.fields(LeafRecord))
_LEAF_FIELDS = frozenset(_LEAF_FIELD_ORDER)


def check_format_version(
    doc: dict, *, where: str, legacy_key: str | None = None
) -> tuple[int, int]:
    """``doc``'s ``format_version`` as (major, minor), refusing a major this jaxckpt can't read.

    One scheme for every file jaxckpt writes (manifest.json, local.json, an export's
    signature.json): ``[major, minor]``; a minor adds optional fields that older readers
    ignore. Files written before 1.1 may carry a plain integer major (or ``legacy_key``).
    """
    raw = doc.get("format_version", doc.get(legacy_key) if legacy_key else None)
    if type(raw) is int:  # not bool: JSON's true is no version
        raw = [raw, 0]
    if not (
        isinstance(raw, (list, tuple))
        and len(raw) == 2
        and all(type(v) is int and v >= 0 for v in raw)
    ):
        raise ManifestError(
            f"{where}: has no valid format_version ([major, minor]), got {raw!r}; the file is "
            "damaged or was not written by jaxckpt"
        )
    version = (raw[0], raw[1])
    if version[0] != FORMAT_VERSION[0]:
        writer = doc.get("writer") or doc.get("versions") or {}
        raise FormatVersionError(
            f"{where}: written with format version {version[0]}.{version[1]}, but this jaxckpt "
            f"reads major version {FORMAT_VERSION[0]} (writer: jaxckpt "
            f"{writer.get('jaxckpt', '?') if isinstance(writer, dict) else '?'}); install a "
            "jaxckpt that supports it, e.g. the writer's version"
        )
    return version


@dataclass(frozen=True)
class Manifest:
    leaves: tuple[LeafRecord, ...]
    meshes: list[dict]
    process_count: int
    bytes_per_process: list[int]
    metadata: Any = None
    metrics: dict | None = None
    process_hosts: list[str] | None = None  # hostname of each process (index = process)
    per_process: list[int] | None = None  # 1.4: processes that saved a per_process value
    created: str = ""
    writer: dict = field(default_factory=dict)
    format_version: tuple[int, int] = FORMAT_VERSION

    def to_json(self) -> str:
        doc = {
            "format": FORMAT_NAME,
            "format_version": list(self.format_version),
            "created": self.created,
            "writer": self.writer,
            "process_count": self.process_count,
            "process_hosts": self.process_hosts,
            "per_process": self.per_process,
            "bytes_per_process": self.bytes_per_process,
            "arrays": ARRAYS_DIR,
            "metadata": self.metadata,
            "metrics": self.metrics,
            "meshes": self.meshes,
        }
        # one line a field and a leaf, each by the C encoder (``indent`` takes the pure
        # Python one, a fifth of a save of many small leaves: docs/MEASURED.md)
        head = ",\n ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items())
        leaves = ",\n  ".join(json.dumps(leaf.to_dict()) for leaf in self.leaves)
        return f'{{\n {head},\n "leaves": [\n  {leaves}\n ]\n}}\n'

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> Manifest:
        """The manifest in ``text``, checked field by field: anything damaged or
        inconsistent raises :class:`ManifestError` naming ``where`` and the field."""
        doc = parse_json(text, where=where, what="manifest")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not a jaxckpt manifest (no 'format': 'jaxckpt')")
        version = check_format_version(doc, where=where)
        f = Fields(where)
        count = f.integer(f.need(doc, "process_count"), "process_count", lo=1, hi=MAX_PROCESSES)
        if doc.get("arrays", ARRAYS_DIR) != ARRAYS_DIR:
            f.bad("arrays", f"must be {ARRAYS_DIR!r} (the database is always there)", doc["arrays"])
        meshes = meshes_from_json(f, f.need(doc, "meshes"), count)
        leaves = leaves_from_json(f, f.need(doc, "leaves"), meshes, count)
        written = f.items(
            f.need(doc, "bytes_per_process"), "bytes_per_process", f.integer, length=count
        )
        check_bytes(f, leaves, written)
        return cls(
            leaves=leaves,
            meshes=meshes,
            process_count=count,
            process_hosts=f.opt_list(doc, "process_hosts", f.text, length=count),
            per_process=_per_process(f, doc.get("per_process"), count),
            bytes_per_process=written,
            metadata=doc.get("metadata"),
            metrics=f.opt_dict(doc, "metrics"),
            created=f.text(doc.get("created", ""), "created"),
            writer=f.opt_dict(doc, "writer") or {},
            format_version=version,
        )


def _per_process(f: Fields, raw: Any, count: int) -> list[int] | None:
    if raw is None:
        return None
    got = f.items(raw, "per_process", lambda v, at: f.integer(v, at, hi=count - 1))
    if len(set(got)) != len(got):
        f.bad("per_process", "lists a process twice", raw)
    return got


# --- reading untrusted JSON -------------------------------------------------------------------

AXIS_TYPES = ("Auto", "Explicit", "Manual")
PRNG_KEY_SHAPES = {"threefry2x32": (2,), "rbg": (4,), "unsafe_rbg": (4,)}
MAX_INDEX = 1 << 24  # list positions in a path: more elements than any pytree has
PATH_KINDS = {"k": (str, int), "a": (str,), "i": (int,), "f": (int,)}
PYTHON_TYPES = {"int": int, "float": float, "bool": bool, "str": str, "NoneType": type(None)}


def meshes_from_json(f: Fields, raw: Any, process_count: int) -> list[dict]:
    """The ``meshes`` list, each mesh's fields checked against each other."""
    meshes = f.items(raw, "meshes", f.obj)
    for i, mesh in enumerate(meshes):
        at = f"meshes[{i}]."
        names = f.items(f.need(mesh, "axis_names", at), at + "axis_names", f.text)
        shape = f.shape(f.need(mesh, "shape", at), at + "shape", lo=1)
        if len(names) != len(shape) or len(set(names)) != len(names):
            f.bad(at + "axis_names", f"must be {len(shape)} distinct names", names)
        size = math.prod(shape)
        for key, hi in (("device_ids", MAX_BYTES), ("process_indices", process_count - 1)):
            grid = f.need(mesh, key, at)
            flat = _grid(f, grid, shape, at + key)
            for j, v in enumerate(flat):
                f.integer(v, f"{at}{key}[{j}]", hi=hi)
            if key == "device_ids" and len(set(flat)) != size:
                f.bad(at + key, "lists a device twice", grid)
        types = mesh.get("axis_types")
        if types is not None:
            f.items(types, at + "axis_types", f.text, length=len(shape))
            if any(t not in AXIS_TYPES for t in types):
                f.bad(at + "axis_types", f"must be among {list(AXIS_TYPES)}", types)
    return meshes


def _grid(f: Fields, grid: Any, shape: list[int], at: str) -> list:
    """The nested lists ``grid`` of ``shape``, flattened (row major)."""
    rows = [grid]
    for d, n in enumerate(shape):
        if not all(isinstance(r, list) and len(r) == n for r in rows):
            f.bad(at, f"must be nested lists of shape {shape} (dimension {d})", grid)
        rows = [x for r in rows for x in r]
    return rows


def leaves_from_json(
    f: Fields, raw: Any, meshes: list[dict], process_count: int
) -> tuple[LeafRecord, ...]:
    """The ``leaves`` list as records, each checked (see :func:`leaf_from_json`); names unique."""
    leaves = tuple(
        f.items(raw, "leaves", lambda d, at: leaf_from_json(f, d, at, meshes, process_count))
    )
    names = [leaf.name for leaf in leaves]
    if len(set(names)) != len(names):
        f.bad("leaves", "holds a leaf name twice", sorted(n for n in names if names.count(n) > 1))
    return leaves


def check_bytes(f: Fields, leaves: tuple[LeafRecord, ...], bytes_per_process: list[int]) -> None:
    """One process wrote every chunk once: its bytes are the leaves' bytes, so a leaf record
    dropped from the list (a partial restore, silently) is caught."""
    total = sum(r.nbytes for r in leaves if r.has_array)
    if len(bytes_per_process) == 1 and total != bytes_per_process[0]:
        f.bad(
            "leaves",
            f"hold {total} bytes of arrays but bytes_per_process says {bytes_per_process[0]} "
            "were written: a leaf record is missing or damaged",
            len(leaves),
        )


def leaf_from_json(f: Fields, doc: Any, at: str, meshes: list[dict], count: int) -> LeafRecord:
    """One leaf record, its fields checked against each other (name and path, shape, dtype
    and bytes, chunks, sharding and mesh); unknown fields (a newer minor) are ignored."""
    from .tree import path_name

    doc = f.obj(doc, at)
    at += "."
    path = f.items(f.need(doc, "path", at), at + "path", lambda p, a: path_entry(f, p, a))
    name = f.text(f.need(doc, "name", at), at + "name")
    if name != path_name(path):
        f.bad(at + "name", f"must be the path joined, {path_name(path)!r}", name)
    at = f"leaves[{name!r}]."
    kind = f.text(f.need(doc, "kind", at), at + "kind")
    if kind not in ("array", "numpy", "prng_key", "python"):
        f.bad(at + "kind", "must be array, numpy, prng_key or python", kind)
    shape = f.shape(doc.get("shape", []), at + "shape")
    scalar = doc.get("scalar", False)
    if type(scalar) is not bool or scalar and shape:
        f.bad(at + "scalar", "must be true or false (true only for shape [])", doc.get("scalar"))
    if kind == "python":
        typ = f.text(f.need(doc, "python_type", at), at + "python_type")
        if typ not in PYTHON_TYPES:
            f.bad(at + "python_type", f"must be among {list(PYTHON_TYPES)}", typ)
        value = doc.get("value")
        if typ == "float" and type(value) is int:
            value = float(value)
        if typ == "float" and doc.get("float_bits") is not None:
            value = nan_from_bits(f, doc["float_bits"], at + "float_bits")
        if type(value) is not PYTHON_TYPES[typ]:
            f.bad(at + "value", f"must be a {typ}", value)
        return LeafRecord.from_dict({**doc, "shape": shape, "value": value})
    if kind == "prng_key":
        impl = f.text(f.need(doc, "prng_impl", at), at + "prng_impl")
        key_shape = PRNG_KEY_SHAPES.get(impl)
        if key_shape is None:
            f.bad(at + "prng_impl", f"must be among {list(PRNG_KEY_SHAPES)}", impl)
        if tuple(shape[len(shape) - len(key_shape) :]) != key_shape:
            f.bad(at + "shape", f"must end in the key data shape {list(key_shape)}", shape)
        f.text(f.need(doc, "dtype", at), at + "dtype")
        dt = np.dtype(np.uint32)
    else:
        dt = f.dtype(f.need(doc, "dtype", at), at + "dtype")
    if doc.get("stored_dtype") is not None:
        stored = f.dtype(doc["stored_dtype"], at + "stored_dtype")
        if stored.kind != "u" or stored.itemsize != dt.itemsize:
            f.bad(at + "stored_dtype", f"must be unsigned of {dt.itemsize} bytes", stored.name)
    nbytes = f.integer(f.need(doc, "nbytes", at), at + "nbytes")
    if nbytes != math.prod(shape) * dt.itemsize:
        f.bad(at + "nbytes", f"must be shape {shape} x {dt.itemsize} bytes", nbytes)
    chunks = f.shape(f.need(doc, "chunk_shape", at), at + "chunk_shape", lo=1)
    if len(chunks) != len(shape) or any(c > max(n, 1) for c, n in zip(chunks, shape, strict=False)):
        f.bad(
            at + "chunk_shape", f"must have one extent <= the shape {shape} per dimension", chunks
        )
    if doc.get("writer_salt") is not None:
        f.integer(doc["writer_salt"], at + "writer_salt")
    if doc.get("fingerprint") is not None:  # 1.10: compared as text, so held to its form
        text = f.text(doc["fingerprint"], at + "fingerprint")
        if not re.fullmatch(r"[0-9a-f]{24}", text):
            f.bad(at + "fingerprint", "must be 24 lower-case hex digits (format 1.10)", text)
    grid = [max(-(-n // c), 1) for n, c in zip(shape, chunks, strict=True)]
    if doc.get("chunk_writers") is not None:
        writers = f.items(
            doc["chunk_writers"], at + "chunk_writers", lambda w, a: _writer(f, w, a, grid, count)
        )
        if sorted(tuple(c) for c, _ in writers) != list(itertools.product(*map(range, grid))):
            f.bad(at + "chunk_writers", f"must list each chunk of the grid {grid} once", grid)
    sharding = _sharding(f, doc.get("sharding"), at + "sharding", meshes, len(shape))
    if sharding is not None and sharding["type"] == "named":
        mesh = meshes[sharding["mesh"]]
        sizes = dict(zip(mesh["axis_names"], mesh["shape"], strict=True))
        spec = sharding["spec"] + [None] * (len(shape) - len(sharding["spec"]))
        for n, c, e in zip(shape, chunks, spec, strict=True):
            ways = math.prod(sizes[a] for a in ([e] if isinstance(e, str) else e or []))
            if n and -(-n // ways) % c:
                f.bad(
                    at + "chunk_shape",
                    f"must divide the shards of shape {shape} over {spec}",
                    chunks,
                )
    return LeafRecord.from_dict({**doc, "shape": shape, "chunk_shape": chunks})


def path_entry(f: Fields, entry: Any, at: str) -> list:
    if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in ("k", "a", "i", "f")):
        f.bad(at, f"must be a [kind, key] pair, kind among {list(PATH_KINDS)}", entry)
    kind, key = entry
    if type(key) not in PATH_KINDS[kind] or isinstance(key, int) and kind in "if" and key < 0:
        f.bad(at, f"has a key of the wrong type for kind {kind!r}", entry)
    if kind in "if" and key > MAX_INDEX:  # a restore without target builds lists this long
        f.bad(at, f"has a sequence index above {MAX_INDEX}", entry)
    return entry


def _writer(f: Fields, w: Any, at: str, grid: list[int], count: int) -> list:
    if not (isinstance(w, list) and len(w) == 2):
        f.bad(at, "must be [[chunk grid coordinates], process]", w)
    coords = f.items(w[0], at + "[0]", f.integer, length=len(grid))
    if any(c >= g for c, g in zip(coords, grid, strict=True)):
        f.bad(at, f"names a chunk outside the grid {grid}", w)
    f.integer(w[1], at + "[1]", hi=count - 1)
    return w


def _sharding(f: Fields, v: Any, at: str, meshes: list[dict], ndim: int) -> dict | None:
    if v is None:
        return None
    v = f.obj(v, at)
    kind = v.get("type")
    if kind == "named":
        mesh = f.integer(f.need(v, "mesh", at + "."), at + ".mesh", hi=len(meshes) - 1)
        f.spec(f.need(v, "spec", at + "."), at + ".spec", meshes[mesh]["axis_names"], ndim)
    elif kind == "single_device":
        f.integer(f.need(v, "device_id", at + "."), at + ".device_id")
    elif kind == "other":
        f.text(v.get("repr", ""), at + ".repr")
    else:
        f.bad(at + ".type", "must be named, single_device or other", kind)
    return v


@dataclass(frozen=True)
class ArrayInfo:
    """What ``jaxckpt.metadata`` reports for a leaf, without reading array data."""

    shape: tuple[int, ...]
    dtype: np.dtype | str | None
    kind: str
    nbytes: int
    mesh_axes: tuple[str, ...] | None = None
    mesh_shape: tuple[int, ...] | None = None
    spec: PartitionSpec | None = None
    value: Any = None
    fingerprint: str | None = None  # the values' (format 1.10): equal ones, equal values

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def array_info(leaf: LeafRecord, meshes: list[dict]) -> ArrayInfo:
    mesh_axes = mesh_shape = spec = None
    if leaf.sharding and leaf.sharding.get("type") == "named":
        mesh = meshes[leaf.sharding["mesh"]]
        mesh_axes = tuple(mesh["axis_names"])
        mesh_shape = tuple(mesh["shape"])
        spec = spec_from_json(leaf.sharding["spec"])
    return ArrayInfo(
        shape=tuple(leaf.shape),
        # jax.numpy.dtype is np.dtype; names like "bfloat16" resolve once jax (ml_dtypes) is in
        dtype=leaf.dtype if leaf.kind == "prng_key" or leaf.dtype is None else np.dtype(leaf.dtype),
        kind=leaf.kind,
        nbytes=leaf.nbytes,
        mesh_axes=mesh_axes,
        mesh_shape=mesh_shape,
        spec=spec,
        value=leaf.value if leaf.kind == "python" else None,
        fingerprint=leaf.fingerprint,
    )


def nan_bits(x: float) -> str | None:
    """A NaN Python float's 64 bits as 16 hex digits (None for other floats, which JSON
    keeps exactly): its sign and payload survive the manifest."""
    if x == x:
        return None
    return f"{struct.unpack('<Q', struct.pack('<d', x))[0]:016x}"


def nan_from_bits(f: Fields, v: Any, at: str) -> float:
    """The NaN that ``nan_bits`` wrote."""
    text = f.text(v, at)
    if not re.fullmatch(r"[0-9a-f]{16}", text):
        f.bad(at, "must be 16 lowercase hex digits", v)
    x = struct.unpack("<d", struct.pack("<Q", int(text, 16)))[0]
    if x == x:
        f.bad(at, "must be the bits of a NaN", v)
    return x


def read_manifest(path: str | os.PathLike | Location) -> Manifest:
    """The manifest of the committed checkpoint at ``path``."""
    loc = location(path)
    if not loc.exists(COMMIT_FILE):
        why = "nothing is there"
        if loc.exists(MANIFEST_FILE) or loc.list_children():
            why = "its save never finished (no COMMITTED marker)"
        raise CheckpointNotFoundError(
            f"{loc.url} is not a committed jaxckpt checkpoint: {why}; pass the directory "
            "that jaxckpt.save wrote, or a manager's step directory"
        )
    text = loc.read_bytes(MANIFEST_FILE)
    if text is None:
        raise CheckpointNotFoundError(f"{loc.url}: COMMITTED but {MANIFEST_FILE} is missing")
    return Manifest.from_json(text, where=f"{loc.url}/{MANIFEST_FILE}")
