"""The local tier of emergency checkpoints: one process's own copy of a step, on its own disk.

``<local_directory>/<step:08d>/`` holds an OCDBT database (``arrays/``) with one zarr v3
array per leaf at its *global* shape, into which the process wrote every distinct shard it
held (its own, deduplicated by global index) plus the shards peers sent it; ``local.json``
says which global slices are in there and which process originally wrote each; ``COMMITTED``
is written last. A step is written in ``<step>.tmp-<id>``, renamed into place (parent
fsynced), then marked; TensorStore's file driver fsyncs the data files it writes. Every chunk
carries a CRC32C (zarr codec), checked on read.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import FormatVersionError, ManifestError
from .. import steps
from ..boxes import Index, from_text, to_text
from ..fields import MAX_PROCESSES, Fields, parse_json
from ..io import arrays, ocdbt_write, slices
from ..manifest import (
    COMMIT_FILE,
    FORMAT_VERSION,
    LeafRecord,
    check_format_version,
    leaves_from_json,
    meshes_from_json,
)
from ..storage import Location
from .planner import SliceKey

log = logging.getLogger("jaxckpt")

LOCAL_FILE = "local.json"
LOCAL_FORMAT = "jaxckpt-local"
# Local chunks are at most this big: TensorStore reads and CRC-checks a chunk into a
# temporary buffer of its size before copying it out, so shard-sized chunks (hundreds of MiB)
# double the fresh host memory a restore touches and serialize the checks of a shard.
LOCAL_CHUNK_BYTES = 16 << 20

Slices = dict[SliceKey, np.ndarray]  # held slices' host data, in the stored dtype
Copies = dict[SliceKey, tuple[np.ndarray, ...]]  # mapped slices' replicas (``read_slices``)
Writers = dict[SliceKey, int]  # the process that held each slice when the step was saved


def tree_digest(records: Iterable[LeafRecord]) -> str:
    """What must match for copies of a step to be combined: names, kinds, shapes, dtypes."""
    docs = [r.to_dict() for r in records]
    summary = [(d["name"], d["kind"], d.get("shape"), d.get("dtype")) for d in docs]
    return hashlib.sha256(json.dumps(summary).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class LocalStep:
    """One process's copy of a step, as its ``local.json`` describes it (docs/FORMAT.md).

    held: the slices in ``arrays/`` and the process that held each at save time;
    required: {leaf: [global index]}, every slice the step needs, from any process
    (``slices`` in the file);
    per_process: {process index: its ``per_process.Record`` as JSON}, this process's own
    and those its peers sent with their copies (1.4).
    """

    step: int
    process_index: int
    process_count: int
    digest: str
    meshes: list[dict]
    leaves: tuple[LeafRecord, ...]
    held: Writers
    required: dict[str, list[Index]]
    replication: int = 0
    hosts: list[str] = field(default_factory=list)
    sends_to: list[int] = field(default_factory=list)
    receives_from: list[int] = field(default_factory=list)
    per_process: dict[str, dict] = field(default_factory=dict)
    format_version: tuple[int, int] = FORMAT_VERSION
    path: Location | None = field(default=None, compare=False)  # where it was read from

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"format": LOCAL_FORMAT, **vars(self)}
        held: dict[str, dict[str, int]] = {}
        for key, writer in self.held.items():
            held.setdefault(key.leaf, {})[to_text(key.box)] = writer
        doc.update(
            format_version=list(self.format_version),
            leaves=[r.to_dict() for r in self.leaves],
            held=held,
            slices={n: [to_text(i) for i in idx] for n, idx in self.required.items()},
        )
        del doc["required"], doc["path"]  # ``slices`` in local.json; where it was read from
        return doc

    @classmethod
    def from_json(cls, doc: Any, *, where: str, path: Location | None = None) -> LocalStep:
        """The step in ``doc``, checked field by field (leaves and meshes as in a manifest;
        ``held`` and ``slices`` against the leaves; the digest recomputed); fields a newer
        minor version added are ignored, a newer major raises :class:`FormatVersionError`
        and anything damaged :class:`ManifestError` naming ``where`` and the field."""
        if not isinstance(doc, dict) or doc.get("format") != LOCAL_FORMAT:
            raise ManifestError(
                f"{where}: not a jaxckpt local step (no 'format': '{LOCAL_FORMAT}')"
            )
        version = check_format_version(doc, where=where, legacy_key="version")
        f = Fields(where)
        count = f.integer(f.need(doc, "process_count"), "process_count", lo=1, hi=MAX_PROCESSES)
        process_id = functools.partial(f.integer, hi=count - 1)  # (value, at): a process index
        process = process_id(f.need(doc, "process_index"), "process_index")
        meshes = meshes_from_json(f, f.need(doc, "meshes"), count)
        leaves = leaves_from_json(f, f.need(doc, "leaves"), meshes, count)
        digest = f.text(f.need(doc, "digest"), "digest")
        if digest != tree_digest(leaves):
            f.bad("digest", f"must be the leaves' digest {tree_digest(leaves)!r}", digest)
        shapes = {r.name: r.shape for r in leaves if r.has_array and math.prod(r.shape) > 0}
        required = {
            name: f.items(keys, f"slices[{name!r}]", functools.partial(_index, f, shapes[name]))
            for name, keys in _by_leaf(f, f.need(doc, "slices"), "slices", shapes).items()
        }
        held: Writers = {}
        for name, by in _by_leaf(f, f.need(doc, "held"), "held", shapes).items():
            listed = set(required.get(name, ()))
            for k, w in f.obj(by, f"held[{name!r}]").items():
                box = _index(f, shapes[name], k, f"held[{name!r}]")
                if box not in listed:
                    f.bad(f"held[{name!r}]", "holds a slice its 'slices' does not list", sorted(by))
                held[SliceKey(name, box)] = process_id(w, f"held[{name!r}][{k!r}]")
        hosts = doc.get("hosts", [])  # one per process (absent: none recorded)
        records = f.obj(doc.get("per_process", {}), "per_process")
        for k, rec in records.items():
            if not (k.isdigit() and int(k) < count):
                f.bad("per_process", f"has a key that is no process index below {count}", k)
            f.obj(rec, f"per_process[{k!r}]")
        return cls(
            step=f.integer(f.need(doc, "step"), "step"),
            process_index=process,
            process_count=count,
            digest=digest,
            meshes=meshes,
            leaves=leaves,
            held=held,
            required=required,
            replication=f.integer(doc.get("replication", 0), "replication"),
            hosts=f.items(hosts, "hosts", f.text, length=count if hosts else None),
            sends_to=f.items(doc.get("sends_to", []), "sends_to", process_id),
            receives_from=f.items(doc.get("receives_from", []), "receives_from", process_id),
            per_process=records,
            format_version=version,
            path=path,
        )


def _by_leaf(f: Fields, v: Any, at: str, shapes: dict[str, list[int]]) -> dict[str, Any]:
    """``v``, an object keyed by names of leaves with array data."""
    for name in f.obj(v, at):
        if name not in shapes:
            f.bad(at, "names a leaf without array data in 'leaves'", name)
    return v


def _index(f: Fields, shape: list[int], key: Any, at: str) -> Index:
    """The global index that an index key (``0:16,0:8``, ``-`` for 0-d) inside ``shape``
    names; only the form ``to_text`` writes is one."""
    got = _box(f.text(key, at), tuple(shape))
    if isinstance(got, str):
        f.bad(at, got, key)
    return got


@functools.lru_cache(maxsize=1 << 16)
def _box(key: str, shape: tuple[int, ...]) -> Index | str:
    """``_index``'s box, or why there is none (cached: a step names the same few slices for
    many leaves, and a restore reads several steps)."""
    try:
        index = from_text(key)
    except ValueError:
        index = None
    if index is None or to_text(index) != key:
        return "has an index that is not 'a:b,c:d'"
    if len(index) != len(shape) or any(
        not 0 <= a < b <= n for (a, b), n in zip(index, shape, strict=False)
    ):
        return f"has an index outside the leaf's shape {list(shape)}"
    return index


def parse_step(text: bytes, *, where: str, path: Location | None = None) -> LocalStep:
    """A ``local.json`` file's bytes as a :class:`LocalStep` (:meth:`LocalStep.from_json`)."""
    return LocalStep.from_json(
        parse_json(text, where=where, what=LOCAL_FILE), where=where, path=path
    )


def read_step(directory: Location, step: int, digits: int = 8) -> LocalStep | None:
    """The committed step's document, or None when it is missing or damaged.
    A newer major format version raises :class:`FormatVersionError`."""
    path = steps.step_dir(directory, step, digits)
    if not path.exists(COMMIT_FILE):
        return None
    where = f"{path.url}/{LOCAL_FILE}"
    try:
        text = path.read_bytes(LOCAL_FILE)
        if text is None:
            raise ManifestError(f"{where} is missing")
        got = parse_step(text, where=where, path=path)
        if got.step != step:
            raise ManifestError(f"{where}: field step is {got.step}, but it is step {step}'s")
        return got
    except FormatVersionError:
        raise  # never guess at a layout we don't know
    except ManifestError as e:
        log.warning("jaxckpt: %s; ignoring the copy of step %d in %s", e, step, path.url)
        return None


def write_step(
    directory: Location,
    doc: LocalStep,
    slices: Slices,
    digits: int = 8,
    *,
    drop_page_cache: bool = False,
    direct_io: bool = False,
) -> Location:
    """Writes one committed local step (tmp dir, rename, marker last) holding ``slices``
    (``doc.held`` lists them); returns its path. ``drop_page_cache``, ``direct_io``: see
    ``ocdbt_write.write``."""
    final = steps.step_dir(directory, doc.step, digits)
    by_leaf: dict[str, list[tuple[Index, Callable[[], np.ndarray]]]] = {}
    for key, data in slices.items():
        by_leaf.setdefault(key.leaf, []).append((key.box, data.view))  # the data, uncopied
    writes = []
    for rec in doc.leaves:
        if not rec.has_array or not math.prod(rec.shape):
            continue
        dtype = rec.storage_dtype
        chunks = local_chunks(rec.chunk_shape or rec.shape, dtype.itemsize)
        meta = arrays.zarr_metadata(rec.shape, dtype.name, chunks, None)
        pieces = by_leaf.get(rec.name, [])
        nbytes = sum(get().nbytes for _, get in pieces)
        writes.append(arrays.ArrayWrite(rec.name, meta, pieces, True, nbytes))
    with steps.committing(final, replace_committed=True) as work:  # saved again: replaced
        db = work.join("arrays")
        db.makedirs()
        ocdbt_write.write(db, writes, direct_io=direct_io, drop_page_cache=drop_page_cache)
        work.write_bytes(LOCAL_FILE, json.dumps(doc.to_json()).encode())
    return final


def local_chunks(chunk_shape: Iterable[int], itemsize: int) -> list[int]:
    """``chunk_shape`` halved until <= LOCAL_CHUNK_BYTES, leading dimensions first (chunks
    stay contiguous row blocks) and only where it stays a divisor: shards remain whole
    numbers of chunks, so writing or reading a shard touches no partial chunk.
    """
    chunks = list(chunk_shape)
    while math.prod(chunks) * itemsize > LOCAL_CHUNK_BYTES:
        d = next((d for d, n in enumerate(chunks) if n % 2 == 0), None)
        if d is None:
            break
        chunks[d] //= 2
    return chunks


def read_slices(
    step: LocalStep,
    wanted: Iterable[SliceKey],
    into: Slices | None = None,
    maps: Mapping[SliceKey, int] | None = None,
    budget: int | None = None,
) -> tuple[Slices, Copies, list[tuple[SliceKey, str]]]:
    """Reads the slices in ``wanted`` that ``step`` holds, verifying checksums, through the
    engine's one way of reading slices (``io.slices.read``: its budget, residency probe,
    direct reads and error wording).

    Returns (slices read, replicas mapped, [(slice, why)] for copies that failed to read:
    those count as missing, their data is never used). A slice with a buffer in ``into``
    (its shape, of the stored dtype, e.g. a view into a ``wire.pack_layout`` buffer) is
    read into it. One of ``maps`` (slice: its replicas' count) becomes private mappings of
    its chunks where ``mapped.choose`` allows, checked as they are mapped: the slice and
    that many replicas, each a mapping of its own (``direct.Reader.map``). ``budget``: at
    most this many bytes read but not yet taken (None: ``inflight.default_budget``).
    """
    assert step.path is not None  # a step read from a directory
    db = step.path.join("arrays")
    records = {rec.name: rec for rec in step.leaves}
    into, maps = into or {}, maps or {}
    out: Slices = {}
    copies: Copies = {}
    bad: list[tuple[SliceKey, str]] = []

    def consume(key: SliceKey, data: np.ndarray, replicas: Sequence[np.ndarray] | None) -> None:
        out[key] = data
        if replicas is not None:  # mapped: its replicas, each a mapping of its own
            copies[key] = tuple(replicas)

    def failed(r: slices.Request, err: Exception) -> None:
        assert isinstance(r.key, SliceKey)
        bad.append((r.key, f"{type(err).__name__}: {err}"))

    requests = [
        slices.Request(
            records[key.leaf],
            key.box,
            functools.partial(consume, key),
            into=into.get(key),
            maps=maps.get(key) if key not in into else None,
            key=key,
        )
        for key in sorted(k for k in wanted if k in step.held)
    ]
    ctx = arrays.new_context()
    opener = functools.partial(arrays.open_leaf, db, ctx=ctx)
    slices.read(db, requests, opener, budget=budget, failed=failed)
    return out, copies, bad
