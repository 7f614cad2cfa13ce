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
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import ml_dtypes
import numpy as np
import tensorstore as ts

from ...errors import SafetensorsError
from ..boxes import Index, extent
from ..storage import Location

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100 << 20  # the reference implementation's limit
T = TypeVar("T")

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


def read(
    kv: ts.KvStore, file: str, start: int, stop: int, url: str, *, exact: bool = False
) -> Callable[[], Any]:
    """Starts reading bytes ``[start, stop)`` of ``file``; call the result for the
    ReadResult, or with ``exact`` for the bytes (a memoryview), all of them. (Typed Any: load
    reuses the name it binds for NumPy buffers.) Errors name the file."""
    try:
        future = kv.read(file, byte_range=slice(start, stop))
    except ValueError as e:
        raise SafetensorsError(f"{url}/{file} cannot be read ({e})") from None

    def result() -> Any:
        try:
            got = future.result()
        except ValueError as e:  # TensorStore: OUT_OF_RANGE for a range past the end
            raise SafetensorsError(
                f"{url}/{file} is truncated or unreadable: bytes [{start}, {stop}) ({e}); "
                "re-download or re-write the file"
            ) from None
        if not exact:
            return got
        if got.state != "value":
            raise SafetensorsError(f"{url}/{file} disappeared while reading it")
        data = memoryview(got.value)
        if len(data) != stop - start:
            raise SafetensorsError(
                f"{url}/{file} is truncated: {len(data)} of {stop - start} bytes at offset "
                f"{start}; re-download or re-write the file"
            )
        return data

    return result


def index_files(raw: bytes, where: str) -> list[str]:
    """The files an index's ``weight_map`` names, checked: plain relative names of
    ``.safetensors`` files inside its directory (never ``..``, absolute or empty parts)."""
    try:
        doc = json.loads(raw.decode("utf-8"))
        weight_map = doc["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise SafetensorsError(
            f"{where} is not a valid index ({type(e).__name__}: {e}); it must be JSON with a "
            "'weight_map' of tensor name -> file name"
        ) from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SafetensorsError(
            f"{where}: 'weight_map' is {type(weight_map).__name__} {weight_map!r:.80}, not a "
            "non-empty object of tensor name -> file name"
        )
    for name, file in weight_map.items():
        parts = file.split("/") if isinstance(file, str) else [""]
        if (
            any(p in ("", ".", "..") for p in parts)
            or any(c in file for c in "\\\0:")
            or not file.endswith(".safetensors")
        ):
            raise SafetensorsError(
                f"{where}: tensor {name!r} is in file {file!r}, which is not a .safetensors "
                "file inside the index's directory (no '..', absolute paths, '\\' or ':'); "
                "the index is corrupt or hostile: fix its weight_map"
            )
    return sorted(set(weight_map.values()))


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the key {dup!r} appears twice")
    return dict(pairs)


def _nat(x: Any) -> bool:
    return type(x) is int and 0 <= x < 1 << 64


def read_header(
    kv: ts.KvStore, file: str, url: str
) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors and ``__metadata__`` of ``file`` (a key of ``kv``; ``url`` names it in
    errors), checked as the reference implementation checks them: a UTF-8 JSON object,
    known dtypes, tensors that tile the data exactly (no gap, no overlap, none past the end)."""
    where = f"{url}/{file}"
    head = read(kv, file, 0, 8, url)()
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
    size = _size(kv, file)
    if 8 + n > size:
        raise SafetensorsError(
            f"{where} is truncated inside its {n}-byte header ({size} bytes in all)"
        )
    raw = bytes(read(kv, file, 8, 8 + n, url)().value)
    if len(raw) < n:
        raise SafetensorsError(f"{where} is truncated inside its {n}-byte header")
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SafetensorsError(
            f"{where}: the header is not valid JSON ({type(e).__name__}: {e}); the file is corrupt"
        ) from None
    if not isinstance(doc, dict):
        raise SafetensorsError(f"{where}: the header is not a JSON object")
    meta = doc.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise SafetensorsError(
            f"{where}: __metadata__ is {meta!r:.80}, not an object of strings; the header is "
            "corrupt"
        )
    tensors = {name: _entry(name, entry, where, file, 8 + n) for name, entry in doc.items()}
    _check_tiling(tensors, where, 8 + n, size)
    return tensors, meta


def _entry(name: str, entry: Any, where: str, file: str, start: int) -> TensorInfo:
    fields = entry if isinstance(entry, dict) else {}  # a missing field is None: refused
    dtype, shape, offsets = (fields.get(k) for k in ("dtype", "shape", "data_offsets"))
    if not (
        isinstance(dtype, str)
        and isinstance(shape, list)
        and all(_nat(d) for d in shape)
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(_nat(x) for x in offsets)
    ):
        raise SafetensorsError(
            f"{where}: tensor {name!r} has a bad header entry {entry!r:.200}: it must be "
            '{"dtype": str, "shape": [int >= 0, ...], "data_offsets": [begin, end]}; the '
            "header is corrupt"
        )
    if dtype not in DTYPES:
        raise SafetensorsError(
            f"{where}: tensor {name!r} has dtype {dtype!r}, which jaxckpt does not read "
            f"(it reads {sorted(DTYPES)}); convert the file with the safetensors package"
        )
    begin, end = offsets
    nbytes = math.prod(shape) * DTYPES[dtype].itemsize
    if end < begin or end - begin != nbytes:
        raise SafetensorsError(
            f"{where}: tensor {name!r} has data_offsets {offsets} for shape {shape} {dtype} "
            f"({nbytes} bytes); the header is corrupt"
        )
    return TensorInfo(name, DTYPES[dtype], tuple(shape), file, start + begin, start + end)


def _check_tiling(tensors: dict[str, TensorInfo], where: str, start: int, size: float) -> None:
    """The tensors' bytes follow each other from the data's ``start``, with no gap or
    overlap, to the file's last byte (its ``size``, where known)."""
    pos = start
    for t in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if t.begin != pos:
            raise SafetensorsError(
                f"{where}: tensor {t.name!r} has data_offsets from {t.begin - start} but the "
                f"tensor before it ends at {pos - start}: the tensors "
                f"{'overlap' if t.begin < pos else 'leave a gap'}; the header is corrupt"
            )
        pos = t.end
    if pos != size and size != math.inf:
        what = "is truncated" if pos > size else "is corrupt (bytes after its last tensor)"
        raise SafetensorsError(
            f"{where} {what}: its tensors hold {pos - start} bytes of data but the file has "
            f"{size - start} after the header; re-download or re-write it"
        )


def _size(kv: ts.KvStore, file: str) -> float:
    """The size of a local file; object stores have no cheap stat in TensorStore, so there
    a truncated file is found when a read comes back short (``read``, ``exact``)."""
    spec = kv.spec().to_json()
    if spec.get("driver") == "file":
        return os.path.getsize(os.path.join(spec["path"], file))
    return math.inf


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
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape))]
    length = (box[k][1] - box[k][0]) * strides[k]
    out = []
    for outer in np.ndindex(*extent(box[:k])):
        offset = sum((box[d][0] + outer[d]) * strides[d] for d in range(k))
        out.append((offset + box[k][0] * strides[k], length))
    return out


def coalesce(
    pieces: Iterable[tuple[int, int]], *, waste: float = 0.5, max_bytes: int = 64 << 20
) -> list[tuple[int, int, list[tuple[int, int]]]]:
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
    sized = [
        (name, np.dtype(dtype), tuple(shape), math.prod(shape) * np.dtype(dtype).itemsize)
        for name, dtype, shape in tensors
    ]
    groups = list(batches(sized, lambda t: t[3], max_file_bytes)) or [[]]  # one file, at least
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


def batches(items: Iterable[T], nbytes: Callable[[T], int], limit: float) -> Iterator[list[T]]:
    """Consecutive ``items`` in lists of at most ``limit`` bytes (an item larger than that
    alone): the files of a save, the leaves a conversion holds in memory together."""
    batch: list[T] = []
    size = 0
    for item in items:
        if batch and size + nbytes(item) > limit:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes(item)
    if batch:
        yield batch


def create_files(directory: Location, files: Iterable[FilePlan]) -> None:
    """Creates the planned files in the local ``directory``: each its header, then zeros up to
    its size, for the data to be written in place."""
    directory.makedirs()
    for f in files:
        with open(os.path.join(directory.url, f.name), "wb") as fh:
            fh.write(f.header)
            fh.truncate(f.size)


def write_in_place(
    directory: Location, files: Iterable[FilePlan], writes: Iterable[tuple[str, int, memoryview]]
) -> None:
    """Makes the ``(file, offset, bytes)`` writes into the files ``create_files`` made in the
    local ``directory``, then syncs the files."""
    fds = {f.name: os.open(os.path.join(directory.url, f.name), os.O_WRONLY) for f in files}
    try:
        for file, offset, data in writes:
            while data:  # one pwrite moves at most about 2 GiB (Linux)
                done = os.pwrite(fds[file], data, offset)
                data, offset = data[done:], offset + done
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)


def index_json(placed: dict[str, TensorInfo], metadata: dict[str, str] | None) -> bytes:
    """``model.safetensors.index.json``: the total data size, ``metadata`` and which file
    holds each tensor."""
    total = sum(t.nbytes for t in placed.values())
    doc = {
        "metadata": {"total_size": total, **(metadata or {})},
        "weight_map": {name: t.file for name, t in placed.items()},
    }
    return json.dumps(doc, indent=2).encode()
