"""Orbax's small files, read as untrusted input: every field is checked before it is used.

Each parser raises :class:`OrbaxFormatError` naming the file, the leaf, the Orbax era
(:func:`era`: Orbax records no version) and what is missing, never a bare
``KeyError``/``TypeError``/``ValueError``. ``read_file`` (and so ``read_aggregate``) and
``inside`` refuse files that resolve outside the checkpoint directory.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import tensorstore as ts

from ...errors import MissingDependencyError, OrbaxFormatError
from ..fields import MAX_NDIM, numpy_dtype
from ..storage import Location

METADATA = "_METADATA"
SHARDING = "_sharding"
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
AGGREGATE = "checkpoint"  # the msgpack file of aggregated leaves (skip_deserialize: true)
MAX_LEAF_BYTES = 1 << 44  # 16 TiB: a larger shape is a corrupt file, not a leaf
_ML_NAMES = {"bfloat16", "int4", "uint4", "int2", "uint2"} | {
    n for n in dir(ml_dtypes) if n.startswith("float8") or n.startswith("float4")
}


@dataclass(frozen=True)
class Where:
    """What an error message names: the item directory and the Orbax era (:func:`era`)."""

    item: Location
    doc: Any = None  # the parsed _METADATA, once read

    @property
    def era(self) -> str:
        """Worked out when an error needs it: a few more reads (on object stores, requests)."""
        return era(self.item, self.doc)

    def error(self, file: str, what: str, fix: str = "") -> OrbaxFormatError:
        fix = fix or (
            "the file is damaged or from an Orbax layout jaxckpt does not read; restore it "
            "with the orbax-checkpoint that wrote it, or re-save it"
        )
        return OrbaxFormatError(f"{self.item.url}/{file}: {what} ({self.era}); {fix}")


def era(item: Location, doc: dict | None) -> str:
    """The Orbax that wrote ``item``, as near as its files tell (no version is recorded)."""
    return f"written by orbax-checkpoint {_versions(item, doc)}; Orbax records no version"


def _versions(item: Location, doc: dict | None) -> str:
    doc = doc if isinstance(doc, dict) else {}
    if "use_ocdbt" in doc:
        return "0.12 or later"
    if "store_array_data_equal_to_fill_value" in doc or item.exists("array_metadatas"):
        return "0.11"
    if not item.exists(CHECKPOINT_METADATA) and not item.parent().exists(CHECKPOINT_METADATA):
        return f"0.5 or earlier (before September 2024: no {CHECKPOINT_METADATA})"
    if _meshes_without_devices(item):
        return "0.5 (before September 2024: its _sharding has no device_mesh)"
    return "0.6 to 0.10"


def _meshes_without_devices(item: Location) -> bool:
    """Whether ``_sharding`` has NamedShardings without ``device_mesh`` (orbax 0.5)."""
    try:
        doc = json.loads(read_file(Where(item), SHARDING) or b"{}")
        entries = [json.loads(v) for v in doc.values()] if isinstance(doc, dict) else []
    except (OrbaxFormatError, ValueError, TypeError, RecursionError):
        return False  # damaged: the error at hand says so
    named = [
        e for e in entries if isinstance(e, dict) and e.get("sharding_type") == "NamedSharding"
    ]
    return bool(named) and not any("device_mesh" in e for e in named)


def read_file(where: Where, name: str) -> bytes | None:
    """The bytes of ``name`` in the item directory (None if absent), refusing a local file
    that resolves outside it (a symbolic link) or is not a regular file."""
    item = where.item
    if item.is_local:
        if not os.path.lexists(os.path.join(item.url, name)):
            return None
        if not os.path.isfile(_resolved(where, name, name)):
            raise where.error(name, "is not a regular file")
    try:
        return item.read_bytes(name)
    except OSError as e:
        raise where.error(name, f"cannot be read ({e})") from e


def inside(where: Where, key: str) -> None:
    """Refuses a leaf's file or directory (without OCDBT) that resolves outside the item."""
    if where.item.is_local:
        for path in (key.rsplit("/", 1)[0], key):
            _resolved(where, key, path)


def _resolved(where: Where, name: str, path: str) -> str:
    """Where the local ``path`` in the item directory really is; outside it, an error
    naming the file ``name``."""
    root = os.path.realpath(where.item.url)
    real = os.path.realpath(os.path.join(where.item.url, path))
    if os.path.commonpath([real, root]) != root:
        raise where.error(
            name,
            f"leads outside the checkpoint directory (to {real})",
            "jaxckpt reads nothing outside it: copy the file in place of the link",
        )
    return real


def parse_json(where: Where, name: str, raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise where.error(name, f"is not JSON ({type(e).__name__}: {str(e)[:80]})") from e


@dataclass(frozen=True)
class Entry:
    """One ``_METADATA`` leaf: Orbax's name for it, its pytree path and value type."""

    name: str  # Orbax's: the keys joined by "."
    path: list  # jaxckpt's: [["k", key]] or [["i", index]]
    value_type: str
    aggregated: bool  # skip_deserialize: its value is in the msgpack file


def entries(where: Where, doc: Any, use_ocdbt: bool) -> list[Entry]:
    """The leaves ``_METADATA`` lists, each checked; a key that would leave the directory,
    a duplicate or an empty tree is refused."""
    tree = doc.get("tree_metadata") if isinstance(doc, dict) else None
    if not isinstance(tree, dict) or not tree:
        raise where.error(METADATA, "has no 'tree_metadata' object listing the leaves")
    out: list[Entry] = []
    seen: set[str] = set()
    nodes: dict[tuple[tuple[str | int, ...], ...], str] = {}  # a node's path -> "i" or "k"
    for label, entry in tree.items():
        keys = entry.get("key_metadata") if isinstance(entry, dict) else None
        value = entry.get("value_metadata") if isinstance(entry, dict) else None
        if not isinstance(keys, list) or not keys or not isinstance(value, dict):
            raise where.error(METADATA, f"leaf {label!r} lacks key_metadata or value_metadata")
        path: list[list[str | int]] = []
        for k in keys:
            key = k.get("key") if isinstance(k, dict) else None
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                raise where.error(METADATA, f"leaf {label!r} has a key that is not a string")
            key_type = k.get("key_type")
            kind = {1: "i", 2: "k"}.get(key_type) if type(key_type) is int else None
            if kind is None:
                raise where.error(METADATA, f"leaf {label!r}: key_type {key_type!r} is not 1 or 2")
            if nodes.setdefault(tuple(map(tuple, path)), kind) != kind:
                raise where.error(METADATA, f"leaf {label!r}: a node both list and dict")
            try:
                path.append([kind, int(key) if kind == "i" else str(key)])
            except ValueError:
                raise where.error(METADATA, f"leaf {label!r}: index {key!r}") from None
        name = ".".join(str(k["key"]) for k in keys)
        parts = name.split("/")  # a file's path without OCDBT: no "..", no odd names
        odd = "\0" in name or ".." in parts
        if odd or not use_ocdbt and ("\\" in name or any(p in ("", ".") for p in parts)):
            raise where.error(
                METADATA, f"leaf {label!r} is named {name!r}, a path that leaves the item"
            )
        if name in seen:
            raise where.error(METADATA, f"leaf {name!r} is listed twice")
        seen.add(name)
        vt = value.get("value_type")
        if not isinstance(vt, str):
            raise where.error(METADATA, f"leaf {name!r} has no value_type")
        skip = value.get("skip_deserialize", False)
        if not isinstance(skip, bool):
            raise where.error(METADATA, f"leaf {name!r} has a skip_deserialize that is not a bool")
        skip = skip and vt != "None"  # None: an empty node, in no file
        out.append(Entry(name, path, vt, skip))
    inner = [e.name for e in out if tuple(map(tuple, e.path)) in nodes]
    if inner:
        raise where.error(METADATA, f"leaf {inner[0]!r} is also a node with leaves under it")
    return out


def check_dtype(where: Where, file: str, leaf: str, text: Any) -> np.dtype:
    """A numeric dtype from its zarr/msgpack name (ml_dtypes' too), or an error."""
    bare = text.lstrip("<>|=") if isinstance(text, str) else None
    if bare in _ML_NAMES:
        return np.dtype(getattr(ml_dtypes, bare))
    for name in (text, bare):  # zarr v2 names carry a byte order ("<f4"), some only bare
        dtype = numpy_dtype(name)
        if dtype is not None and dtype.kind in "biufc":
            return dtype
    raise where.error(file, f"leaf {leaf!r} has data type {text!r}, not a numeric one")


def check_shape(
    where: Where, file: str, leaf: str, shape: Any, itemsize: int = 1
) -> tuple[int, ...]:
    ok = isinstance(shape, list) and len(shape) <= MAX_NDIM
    ok = ok and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    if not ok or math.prod(shape) * itemsize > MAX_LEAF_BYTES:
        raise where.error(file, f"leaf {leaf!r} has shape {str(shape)[:80]}, not a valid one")
    return tuple(shape)


def zarr_layout(
    where: Where, kv: ts.KvStore, name: str, zarr3: bool, use_ocdbt: bool
) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...]]:
    """(shape, dtype, chunk shape) of leaf ``name`` from its ``.zarray`` / ``zarr.json`` in
    ``kv``, the item's keys."""
    key = f"{name}/{'zarr.json' if zarr3 else '.zarray'}"
    if not use_ocdbt:
        inside(where, key)
    try:
        raw = kv.read(key).result().value
    except Exception as e:  # a damaged OCDBT database
        raise where.error(key, f"leaf {name!r}: its array metadata cannot be read ({e})") from e
    if not raw:
        raise where.error(
            key,
            f"is missing: leaf {name!r}, which {METADATA} lists, has no array metadata",
            "the checkpoint is incomplete or uses a layout jaxckpt does not read",
        )
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise where.error(key, f"leaf {name!r}: the array metadata is not JSON") from e
    if not isinstance(meta, dict):
        raise where.error(key, f"leaf {name!r}: the array metadata is not an object")
    dtype = check_dtype(where, key, name, meta.get("data_type" if zarr3 else "dtype"))
    shape = check_shape(where, key, name, meta.get("shape"), dtype.itemsize)
    if zarr3:
        grid = meta.get("chunk_grid")
        conf = grid.get("configuration") if isinstance(grid, dict) else None
        chunks = conf.get("chunk_shape") if isinstance(conf, dict) else None
    else:
        chunks = meta.get("chunks")
    chunks = check_shape(where, key, name, chunks)
    if len(chunks) != len(shape):
        raise where.error(key, f"leaf {name!r}: chunks {chunks} do not match shape {shape}")
    return shape, dtype, tuple(c or 1 for c in (chunks or shape))


def read_aggregate(where: Where) -> dict:
    """The msgpack ``checkpoint`` file that holds Orbax's aggregated leaves (Flax's
    ``save_args_from_target`` before flax 0.9)."""
    try:
        import msgpack
    except ImportError as e:
        raise MissingDependencyError(
            f"{where.item.url}/{AGGREGATE}: this Orbax checkpoint ({where.era}) keeps some "
            "leaves in a msgpack file, and reading it needs the msgpack package: "
            "pip install 'jaxckpt[orbax]' (or pip install msgpack)"
        ) from e
    raw = read_file(where, AGGREGATE)
    if raw is None:
        raise where.error(
            AGGREGATE,
            "is missing, and _METADATA puts leaves in it (skip_deserialize: true)",
            "copy the item directory whole (the msgpack 'checkpoint' file with it)",
        )
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, max_bin_len=len(raw))
    except Exception as e:  # msgpack's errors (ExtraData, StackError, ...) share no base
        raise where.error(AGGREGATE, f"is not a msgpack document ({type(e).__name__})") from e
    if not isinstance(doc, dict):
        raise where.error(AGGREGATE, "does not hold a tree (a msgpack map)")
    return doc


def aggregated_value(where: Where, doc: dict, entry: Entry) -> Any:
    """The leaf's value in the msgpack document: an ndarray or a Python number."""
    import msgpack

    node: Any = doc
    for kind, key in entry.path:
        if isinstance(node, msgpack.ExtType) and node.code == 4:  # a tuple
            node = _unpack(where, entry, node.data)
        if isinstance(node, list) and kind == "i" and 0 <= key < len(node):
            node = node[key]
        elif isinstance(node, dict) and str(key) in node:
            node = node[str(key)]
        else:
            raise where.error(AGGREGATE, f"lacks leaf {entry.name!r}, which _METADATA puts there")
    if isinstance(node, (bool, int, float)):
        return node
    if isinstance(node, dict) and node.get("__msgpack_chunked_array__") is True:
        return _unchunk(where, entry, node)
    if isinstance(node, msgpack.ExtType) and node.code in (1, 2, 3):
        match node.code, _unpack(where, entry, node.data):
            case 2, [int() | float() as real, int() | float() as imag]:
                return complex(real, imag)
            case 1 | 3, [list() as dims, str() as name, bytes() as data]:
                dtype = check_dtype(where, AGGREGATE, entry.name, name)
                shape = check_shape(where, AGGREGATE, entry.name, dims, dtype.itemsize)
                if math.prod(shape) * dtype.itemsize == len(data):
                    array = np.frombuffer(data, dtype).reshape(shape).copy()
                    return array[()] if node.code == 3 else array
    raise where.error(AGGREGATE, f"leaf {entry.name!r} is not an array or a number there")


def _unpack(where: Where, entry: Entry, data: bytes) -> Any:
    import msgpack

    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack's errors share no base
        raise where.error(AGGREGATE, f"leaf {entry.name!r}: its value is damaged") from e


def _unchunk(where: Where, entry: Entry, node: dict) -> np.ndarray:
    """An array over 1 GiB, which Orbax's msgpack splits into numbered chunks."""
    shape, chunks = node.get("shape"), node.get("chunks")
    if isinstance(shape, dict) and isinstance(chunks, dict):
        part = Entry(entry.name, [["k", "c"]], "", True)  # a chunk: the leaf of {"c": chunk}
        parts = [
            aggregated_value(where, {"c": chunks[str(i)]}, part)
            for i in range(len(chunks))
            if str(i) in chunks
        ]
        listed = [shape.get(str(i)) for i in range(len(shape))]
        if len(parts) == len(chunks) and all(isinstance(p, np.ndarray) for p in parts):
            flat = np.concatenate([p.reshape(-1) for p in parts]) if parts else None
            dims = check_shape(where, AGGREGATE, entry.name, listed)
            if flat is not None and flat.size == math.prod(dims):
                return flat.reshape(dims)
    raise where.error(AGGREGATE, f"leaf {entry.name!r}: its chunked array is damaged")
