"""The safetensors file format, and where a slice of a tensor lies in it.

A ``.safetensors`` file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``,
padded with spaces to a multiple of 8) and the data: each tensor row-major, little-endian,
at ``8 + N + begin``. A model split over several files has ``model.safetensors.index.json``
(``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``) beside them.

Here: reading headers through a TensorStore kvstore (local files, ``s3://``, ``gs://``: the
same byte-range reads everywhere), the byte runs of a box of a row-major tensor, and the
file plan of a save (which tensor goes in which file at which offset), computed the same
way on every process.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import tensorstore as ts

from ..errors import SafetensorsError
from .sharding import Index
from .storage import Location

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a safetensors file: where its bytes are (``begin``/``end`` are
    absolute offsets in ``file``)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: str
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def dtype_name(dtype: np.dtype, where: str) -> str:
    name = NAMES.get(np.dtype(dtype))
    if name is None:
        raise SafetensorsError(
            f"{where}: dtype {dtype} has no safetensors name (supported: "
            f"{sorted(str(d) for d in DTYPES.values())}); cast it with a Cast transform"
        )
    return name


def read_header(kv: ts.KvStore, file: str, url: str) -> tuple[dict[str, TensorInfo], dict]:
    """The tensors and ``__metadata__`` of ``file`` (a key of ``kv``; ``url`` names it in
    errors), checked: offsets inside the file, sizes that match shapes and dtypes."""
    where = f"{url}/{file}"
    head = kv.read(file, byte_range=slice(0, 8)).result()
    if head.state != "value":
        raise SafetensorsError(
            f"{where} does not exist; check the path (or the index's weight_map)"
        )
    if len(head.value) < 8:
        raise SafetensorsError(
            f"{where} is truncated: {len(head.value)} bytes, not a safetensors file"
        )
    n = int.from_bytes(bytes(head.value), "little")
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise SafetensorsError(
            f"{where}: header length {n} is out of range; the file is corrupt or not safetensors"
        )
    raw = bytes(kv.read(file, byte_range=slice(8, 8 + n)).result().value)
    if len(raw) < n:
        raise SafetensorsError(f"{where} is truncated inside its {n}-byte header")
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise SafetensorsError(
            f"{where}: the header is not valid JSON ({e}); the file is corrupt"
        ) from e
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{where}: the header is not a JSON object")
    meta = doc.pop("__metadata__", None) or {}
    size = _size(kv, file)
    tensors = {}
    for name, entry in doc.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) + 8 + n for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsError(
                f"{where}: tensor {name!r} has a bad header entry {entry!r} ({e})"
            ) from e
        if end - begin != math.prod(shape) * dtype.itemsize or begin > end:
            raise SafetensorsError(
                f"{where}: tensor {name!r} has data_offsets {entry['data_offsets']} for shape "
                f"{list(shape)} {entry['dtype']}; the header is corrupt"
            )
        if end > size:
            raise SafetensorsError(
                f"{where} is truncated: tensor {name!r} ends at byte {end} of {size}; "
                "re-download or re-write the file"
            )
        tensors[name] = TensorInfo(name, dtype, shape, file, begin, end)
    return tensors, meta


def _size(kv: ts.KvStore, file: str) -> float:
    """The size of a local file; object stores have no cheap stat in TensorStore, so there
    a truncated file is found when a read comes back short (``checked``)."""
    spec = kv.spec().to_json()
    if spec.get("driver") == "file":
        return os.path.getsize(os.path.join(spec["path"], file))
    return math.inf


def checked(result, file: str, offset: int, length: int, url: str) -> memoryview:
    if result.state != "value":
        raise SafetensorsError(f"{url}/{file} disappeared while reading it")
    data = memoryview(result.value)
    if len(data) != length:
        raise SafetensorsError(
            f"{url}/{file} is truncated: {len(data)} of {length} bytes at offset {offset}; "
            "re-download or re-write the file"
        )
    return data


# --- where a box of a row-major tensor lies -------------------------------------------------


def runs(shape: Sequence[int], itemsize: int, box: Index) -> list[tuple[int, int]]:
    """The contiguous byte runs ``(offset, length)`` of ``box`` in a row-major array of
    ``shape``, in row-major order of the box."""
    if not shape:
        return [(0, itemsize)]
    if any(b <= a for a, b in box):
        return []
    # trailing dimensions the box covers whole are read together with the one before them
    k = len(shape) - 1
    while k > 0 and box[k] == (0, shape[k]):
        k -= 1
    inner = math.prod(shape[k + 1 :]) * itemsize
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    length = (box[k][1] - box[k][0]) * inner
    out = []
    for outer in np.ndindex(*(b - a for a, b in box[:k])):
        offset = sum((box[d][0] + outer[d]) * strides[d] for d in range(k))
        out.append((offset + box[k][0] * strides[k], length))
    return out


def coalesce(pieces: Iterable[tuple[int, int]], *, waste: float = 0.5, max_bytes: int = 64 << 20):
    """Groups sorted runs into reads ``(offset, length, [(run offset, run length)...])``,
    merging neighbours while the bytes read stay within ``1 + waste`` times those needed."""
    groups: list[list] = []
    for off, n in pieces:
        if groups:
            start, end, need, members = groups[-1]
            span = max(end, off + n) - start
            if off >= start and span <= (1 + waste) * (need + n) and span <= max_bytes:
                groups[-1] = [start, max(end, off + n), need + n, [*members, (off, n)]]
                continue
        groups.append([off, off + n, n, [(off, n)]])
    return [(start, end - start, members) for start, end, _, members in groups]


# --- the files of a save ---------------------------------------------------------------------


@dataclass(frozen=True)
class FilePlan:
    name: str
    header: bytes  # the 8-byte length and the padded JSON
    size: int  # header + data


def plan(
    tensors: Sequence[tuple[str, np.dtype, tuple[int, ...]]],
    max_file_bytes: float,
    metadata: dict[str, str] | None,
) -> tuple[list[FilePlan], dict[str, TensorInfo]]:
    """Assigns tensors, in the order given, to files of at most ``max_file_bytes`` of data
    (a tensor larger than that gets a file of its own) and lays out each file."""
    groups: list[list] = [[]]
    used = 0
    for name, dtype, shape in tensors:
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if groups[-1] and used + nbytes > max_file_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, dtype, tuple(shape), nbytes))
        used += nbytes
    count = len(groups)
    files, placed = [], {}
    for i, group in enumerate(groups):
        fname = SINGLE_FILE if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        doc: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        for name, dtype, shape, nbytes in group:
            doc[name] = {
                "dtype": dtype_name(dtype, name),
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        text = json.dumps(doc, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        header = len(text).to_bytes(8, "little") + text
        files.append(FilePlan(fname, header, len(header) + offset))
        for name, dtype, shape, _ in group:
            begin, end = (x + len(header) for x in doc[name]["data_offsets"])
            placed[name] = TensorInfo(name, dtype, shape, fname, begin, end)
    return files, placed


def create_files(directory: Location, files: Iterable[FilePlan]) -> None:
    """Creates the planned files in the local ``directory``: each its header, then zeros up to
    its size, for the data to be written in place."""
    directory.makedirs()
    for f in files:
        with open(os.path.join(directory.url, f.name), "wb") as fh:
            fh.write(f.header)
            fh.truncate(f.size)


def index_json(placed: dict[str, TensorInfo], metadata) -> bytes:
    total = sum(t.nbytes for t in placed.values())
    doc = {
        "metadata": {"total_size": total, **(metadata or {})},
        "weight_map": {name: t.file for name, t in placed.items()},
    }
    return json.dumps(doc, indent=2).encode()
