"""Per-process values saved with a step: each process's own data-iterator position (what
``grain`` iterators' ``get_state()`` returns), host RNG state, a sampler's offset.

Unlike the pytree's leaves, these differ from process to process. Each process's value is
one :class:`Record`: a JSON value, bytes, or a small pytree of NumPy arrays, with a SHA-256
of its canonical JSON so a damaged record is never returned. A checkpoint keeps them as
``per_process/<index:05d>.json`` (docs/FORMAT.md); the emergency tier keeps them in
``local.json`` and sends them with the peer copies.

Reading one back is matched by process index, and only while the process count is
unchanged: after a change, :func:`choose` refuses the plain call (the records must be
redistributed by the caller, who knows what they mean) and gives one (``process=i``) or all
(``all=True``).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ChecksumError, ProcessCountChangedError, UnsupportedLeafError
from . import multihost
from . import tree as tree_lib
from .fields import Fields
from .manifest import path_entry
from .storage import Location

DIRECTORY = "per_process"
KINDS = ("json", "bytes", "numpy")


@dataclass(frozen=True)
class Record:
    """One process's value as stored: ``kind`` says how ``value`` encodes it."""

    process_index: int
    process_count: int
    kind: str
    value: Any
    sha256: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict, *, where: str) -> Record:
        try:
            return cls(*(doc[f.name] for f in dataclasses.fields(cls)))
        except (KeyError, TypeError) as e:
            raise ChecksumError(f"{where}: a per-process record without its field {e}") from e


def file_name(process: int) -> str:
    return f"{process:05d}.json"


def read_record(checkpoint: Location, process: int) -> Record:
    """Process ``process``'s record in a checkpoint directory; a missing or unreadable one
    raises :class:`ChecksumError` (its checksum is checked by :func:`decode`)."""
    where = f"{checkpoint.url}/{DIRECTORY}/{file_name(process)}"
    data = checkpoint.join(DIRECTORY).read_bytes(file_name(process))
    if data is None:
        raise ChecksumError(f"{where}: the per-process record of process {process} is missing")
    try:
        return Record.from_json(json.loads(data), where=where)
    except ValueError as e:
        raise ChecksumError(f"{where}: damaged per-process record ({e})") from e


def _digest(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def encode(value: Any, *, where: str) -> Record | None:
    """This process's ``value`` as a :class:`Record` (None for None); refuses, before anything
    is written, a value that is neither JSON, bytes nor a pytree of NumPy arrays."""
    if value is None or isinstance(value, Record):
        return value
    pid = multihost.process_index()
    stored: Any  # JSON: base64 text, a list of arrays or the value itself
    if isinstance(value, (bytes, bytearray, memoryview)):
        kind, stored = "bytes", base64.b64encode(bytes(value)).decode()
    elif _is_numpy_tree(value):
        stored = [_array_json(p, leaf, where, pid) for p, leaf in tree_lib.flatten(value)]
        kind = "numpy"
    else:
        try:
            stored = json.loads(json.dumps(value, allow_nan=True))
        except (TypeError, ValueError) as e:
            raise UnsupportedLeafError(
                f"{where}: per_process of process {pid} is of type {type(value).__name__}, "
                f"neither JSON, bytes nor a pytree of NumPy arrays ({e}); pass e.g. a grain "
                "iterator's get_state(), bytes, a JSON dict, or {name: np.ndarray}"
            ) from None
        kind = "json"
    return Record(pid, multihost.process_count(), kind, stored, _digest(stored))


def decode(record: Record, *, where: str) -> Any:
    """The value ``record`` holds; a checksum mismatch raises :class:`ChecksumError`."""
    if record.kind not in KINDS:
        raise ChecksumError(f"{where}: unknown per-process record kind {record.kind!r}")
    if _digest(record.value) != record.sha256:
        raise ChecksumError(
            f"{where}: the per-process record of process {record.process_index} fails its "
            "checksum (the file was changed or damaged); restore an earlier step"
        )
    if record.kind == "bytes":
        return base64.b64decode(record.value)
    if record.kind == "numpy":
        f = Fields(f"{where}: process {record.process_index}'s per-process record")
        arrays = f.items(record.value, "value", lambda a, at: _array(f, a, at))
        return tree_lib.unflatten_paths(arrays)
    return record.value


def choose(
    record: Callable[[int], Record | None],
    *,
    saved_count: int,
    where: str,
    process: int | None = None,
    all: bool = False,  # noqa: A002 - the keyword users write
) -> Any:
    """The value for this process (matched by index), for ``process``, or every process's
    (``all=True``, a list with None where a process saved none). ``record(i)`` gives process
    i's record; only the records asked for are fetched."""
    if all:
        records = [record(i) for i in range(saved_count)]
        return [None if r is None else decode(r, where=where) for r in records]
    if process is None:
        count = multihost.process_count()
        if count != saved_count:
            raise ProcessCountChangedError(
                f"{where}: saved by {saved_count} processes, this job has {count}; per-process "
                "values cannot be matched by index. Read them with per_process(..., all=True) "
                "(or process=i) and redistribute them yourself, e.g. restart each data "
                "iterator from the saved position of the shard it now reads"
            )
        process = multihost.process_index()
    if not 0 <= process < saved_count:
        raise ProcessCountChangedError(
            f"{where}: process={process}, but the step was saved by {saved_count} processes"
        )
    found = record(process)
    return None if found is None else decode(found, where=where)


def _is_numpy_tree(value: Any) -> bool:
    leaves = tree_lib.leaves(value)
    return bool(leaves) and all(isinstance(x, (np.ndarray, np.generic)) for x in leaves)


def _array_json(path: list, leaf: np.ndarray | np.generic, where: str, pid: int) -> dict:
    arr = np.asarray(leaf)
    little = arr.dtype.newbyteorder("<")
    if arr.dtype.kind not in "biufc" or not _plain(little):
        raise UnsupportedLeafError(
            f"{where}: per_process of process {pid}: the NumPy leaf "
            f"{tree_lib.path_name(path)} has dtype {arr.dtype}; only NumPy's own bool, integer, "
            "float and complex arrays can be saved per process (not ml_dtypes' bfloat16, float8, "
            "int4...: cast them or pass bytes; convert strings to a JSON value)"
        )
    return {
        "path": path,
        "dtype": little.str,
        "shape": list(arr.shape),
        "scalar": isinstance(leaf, np.generic),
        # .data: the same bytes, as a memoryview (numpy's stubs type ndarray as a buffer only
        # for Python >= 3.12)
        "data": base64.b64encode(np.ascontiguousarray(arr, little).data).decode(),
    }


def _plain(little: np.dtype) -> bool:
    """NumPy reads the little-endian dtype back from its ``str`` (ml_dtypes' float8_e5m2
    says kind 'f', but '<f1' names nothing)."""
    try:
        return np.dtype(little.str) == little
    except TypeError:
        return False


def _array(f: Fields, doc: Any, at: str) -> tuple[list, np.ndarray | np.generic]:
    """One array of a record, each field checked (the checksum sits in the same file, so a
    forged record passes it): (path, value)."""
    doc = f.obj(doc, at)
    path = f.items(f.need(doc, "path", at), at + ".path", lambda e, a: path_entry(f, e, a))
    dtype = f.dtype(f.need(doc, "dtype", at), at + ".dtype")
    shape = f.shape(f.need(doc, "shape", at), at + ".shape")
    try:
        data = base64.b64decode(f.text(f.need(doc, "data", at), at + ".data"), validate=True)
    except ValueError:
        f.bad(at + ".data", "must be base64", doc["data"])
    if len(data) != math.prod(shape) * dtype.itemsize:
        f.bad(at + ".data", f"must hold {math.prod(shape)} {dtype} values", len(data))
    arr = np.frombuffer(data, dtype).reshape(shape).astype(dtype.newbyteorder("="))
    if doc.get("scalar") not in (None, False, True) or doc.get("scalar") and shape:
        f.bad(at + ".scalar", "must be true (only for shape []) or false", doc.get("scalar"))
    return path, arr[()] if doc.get("scalar") else arr
