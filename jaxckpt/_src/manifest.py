"""The manifest: one JSON record per checkpoint describing every leaf (see docs/FORMAT.md)."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from ..errors import FormatVersionError, ManifestError
from .sharding import spec_from_json

FORMAT_NAME = "jaxckpt"
FORMAT_VERSION = (1, 4)  # (major, minor): a reader accepts any minor of its own major
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
    chunk_writers: list | None = None  # [[chunk grid coords], process index]
    writer_salt: int | None = None  # 1.3: named shardings' writers follow the split rule
    value: Any = None
    python_type: str | None = None
    prng_impl: str | None = None
    scalar: bool = False  # a NumPy scalar (np.float32(1.0)) rather than a 0-d array

    @property
    def has_array(self) -> bool:
        return self.kind in ("array", "numpy", "prng_key")

    @property
    def data_dtype(self) -> np.dtype:
        """The dtype of the leaf's data (a PRNG key's: its uint32 key data)."""
        if self.kind == "prng_key":
            return np.dtype(np.uint32)
        return np.dtype(_dtype_or_none(self.dtype))

    @property
    def storage_dtype(self) -> np.dtype:
        """The zarr dtype the data is stored as (unsigned bits where zarr lacks the dtype)."""
        return np.dtype(_dtype_or_none(self.stored_dtype)) if self.stored_dtype else self.data_dtype

    def to_dict(self) -> dict:
        """The record as stored: fields left at None/False are omitted."""
        return {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k == "value" and self.kind == "python" or (v is not None and v is not False)
        }

    @classmethod
    def from_dict(cls, doc: dict) -> LeafRecord:
        """The record in ``doc``, ignoring fields a newer minor version added."""
        return cls(**{k: v for k, v in doc.items() if k in _LEAF_FIELDS})


_LEAF_FIELDS = frozenset(f.name for f in dataclasses.fields(LeafRecord))


def check_format_version(
    doc: dict, *, where: str, legacy_key: str | None = None
) -> tuple[int, int]:
    """``doc``'s ``format_version`` as (major, minor), refusing a major this jaxckpt can't read.

    One scheme for every file jaxckpt writes (manifest.json, local.json, an export's
    signature.json): ``[major, minor]``; a minor adds optional fields that older readers
    ignore. Files written before 1.1 may carry a plain integer major (or ``legacy_key``).
    """
    raw = doc.get("format_version", doc.get(legacy_key) if legacy_key else None)
    if isinstance(raw, int):
        raw = [raw, 0]
    if not (
        isinstance(raw, (list, tuple)) and len(raw) == 2 and all(isinstance(v, int) for v in raw)
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
            "leaves": [leaf.to_dict() for leaf in self.leaves],
        }
        return json.dumps(doc, indent=1)

    @classmethod
    def from_json(cls, text: str, *, where: str) -> Manifest:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ManifestError(f"{where}: manifest is not valid JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ManifestError(f"{where}: not a jaxckpt manifest (no 'format': 'jaxckpt')")
        version = check_format_version(doc, where=where)
        try:
            return cls(
                leaves=tuple(LeafRecord.from_dict(leaf) for leaf in doc["leaves"]),
                meshes=doc["meshes"],
                process_count=doc["process_count"],
                process_hosts=doc.get("process_hosts"),
                per_process=doc.get("per_process"),
                bytes_per_process=doc["bytes_per_process"],
                metadata=doc.get("metadata"),
                metrics=doc.get("metrics"),
                created=doc.get("created", ""),
                writer=doc.get("writer", {}),
                format_version=version,
            )
        except (KeyError, TypeError) as e:
            raise ManifestError(f"{where}: manifest is missing or has a bad field: {e}") from e


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
        dtype=leaf.dtype if leaf.kind == "prng_key" else _dtype_or_none(leaf.dtype),
        kind=leaf.kind,
        nbytes=leaf.nbytes,
        mesh_axes=mesh_axes,
        mesh_shape=mesh_shape,
        spec=spec,
        value=leaf.value if leaf.kind == "python" else None,
    )


def _dtype_or_none(name: str | None) -> np.dtype | None:
    # jax.numpy.dtype is np.dtype; names like "bfloat16" resolve once jax (ml_dtypes) is in
    return None if name is None else np.dtype(name)
