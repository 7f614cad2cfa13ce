"""Checking a committed checkpoint end to end: every chunk the manifest implies exists, and
reads back with its CRC32C intact (TensorStore checks the checksum as it decodes a chunk),
and every leaf's values have the fingerprint its record gives (1.10).

Reads run concurrently through TensorStore's thread pool (every core), at most
``budget`` bytes in flight, one chunk at a time per read: a corrupt chunk is named alone,
with the data file and byte range its value occupies (from TensorStore's OCDBT dump).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import tensorstore as ts

from .. import per_process as pp
from ..boxes import chunks_in, volume, whole
from ..io import arrays, fingerprint
from ..io.inflight import READ_BUDGET_BYTES, InFlight
from ..manifest import LeafRecord, Manifest, read_manifest
from ..sharding import saved_writers
from ..storage import Location, location


@dataclass(frozen=True)
class Problem:
    """One thing wrong: the leaf, the chunk (grid position, or ``None`` for the whole leaf)
    and where its bytes live (``location``: the data file and range, when the B-tree has it)."""

    leaf: str
    chunk: tuple[int, ...] | None
    where: str
    why: str
    location: arrays.ChunkBytes | None = None


@dataclass
class Report:
    path: str
    chunks: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _key(leaf: str, coords: Sequence[int]) -> str:
    """A chunk's key in the OCDBT database (zarr v3's default key encoding)."""
    return "/".join([leaf, "c", *map(str, coords)])


def verify(path: str | os.PathLike, *, progress: Callable[[int], None] | None = None) -> Report:
    """Reads every chunk of the checkpoint at ``path``; ``progress(nbytes)`` after each."""
    loc = location(path)
    manifest = read_manifest(loc)
    report = Report(loc.url)
    db = arrays.database_dir(loc, None)
    ctx = arrays.new_context()
    try:
        kv = ts.KvStore.open(arrays.kvstore_spec(db), context=ctx).result()
        present = {k.decode() for k in kv.list().result()}
    except Exception as e:  # the B-tree itself is damaged or gone: nothing can be read
        report.problems.append(
            Problem("*", None, db.url, f"cannot list the arrays: {_first_line(e)}")
        )
        return report
    leaves = [r for r in manifest.leaves if r.has_array and r.nbytes]
    # before 1.3, chunks equal to the fill value (all zeros) were not stored
    every_chunk_stored = tuple(manifest.format_version) >= (1, 3)
    progress = progress or (lambda nbytes: None)

    def damaged(rec: LeafRecord, coords: tuple[int, ...], why: str) -> None:
        report.problems.append(Problem(rec.name, coords, _where(rec, coords, manifest, db), why))

    sums = fingerprint.Sums()

    def check(rec: LeafRecord, coords: tuple[int, ...], box: Any, nbytes: int, fut: Any) -> None:
        try:
            data = fut.result()
            if rec.fingerprint is not None:
                sums.add(rec.name, data, box, rec.shape)
            report.chunks += 1
            report.bytes += nbytes
        except Exception as e:
            damaged(rec, coords, _first_line(e))
        progress(nbytes)

    reads = InFlight[Any](READ_BUDGET_BYTES)
    for rec in leaves:
        try:
            store = arrays.open_leaf(db, rec.name, ctx).result()
        except Exception as e:
            report.problems.append(
                Problem(rec.name, None, db.url, f"cannot open its array: {_first_line(e)}")
            )
            continue
        itemsize = rec.nbytes // volume(whole(rec.shape))
        for coords in chunks_in(whole(rec.shape), rec.chunk_shape or ()):
            box = tuple(
                (i * c, min((i + 1) * c, s))
                for i, c, s in zip(coords, rec.chunk_shape or (), rec.shape, strict=True)
            )
            nbytes = volume(box) * itemsize
            if every_chunk_stored and _key(rec.name, coords) not in present:
                damaged(rec, coords, "the chunk is missing")
                progress(nbytes)
                continue
            reads.add(
                nbytes,
                functools.partial(arrays.read_slice, store, box),
                functools.partial(check, rec, coords, box, nbytes),
            )
    reads.drain()
    _check_fingerprints(leaves, sums.texts(), report, db)
    report.problems[:] = _with_bytes(report.problems, kv, db)
    for i in manifest.per_process or ():  # 1.4: each process's record and its checksum
        try:
            pp.decode(pp.read_record(loc, i), where=loc.url)
        except Exception as e:
            where = loc.join(pp.DIRECTORY).join(pp.file_name(i)).url
            report.problems.append(Problem(f"per_process[{i}]", None, where, _first_line(e)))
    return report


def _check_fingerprints(
    leaves: Sequence[LeafRecord], got: dict[str, str], report: Report, db: Location
) -> None:
    """A problem for each leaf read whole whose values' fingerprint is not its record's."""
    damaged = {p.leaf for p in report.problems}
    for rec in leaves:
        if rec.fingerprint is None or rec.name in damaged:
            continue
        have = got.get(rec.name, fingerprint.to_text((0,) * fingerprint.LANES))
        if have != rec.fingerprint:
            report.problems.append(
                Problem(
                    rec.name,
                    None,
                    db.url,
                    f"its values' fingerprint is {have}, the manifest records "
                    f"{rec.fingerprint}: every chunk is intact, so the arrays are not the ones "
                    "that were saved (the manifest belongs to other arrays, or they were "
                    "rewritten since)",
                )
            )


def _where(rec: LeafRecord, coords: tuple[int, ...], manifest: Manifest, db: Location) -> str:
    writer = saved_writers(rec, manifest.meshes).get(tuple(coords))
    if writer is None or manifest.process_count == 1:
        return f"{db.url}/d/ (the data files)"
    return f"{db.url}/p{writer}/d/ (process {writer}'s data files)"


def _with_bytes(problems: list[Problem], kv: ts.KvStore, db: Location) -> list[Problem]:
    """``problems`` with each chunk's data file and byte range added (where the B-tree has
    the chunk's key; a missing chunk has none), and named in ``where``."""
    keys = {_key(p.leaf, p.chunk) for p in problems if p.chunk is not None}
    if not keys:
        return problems
    try:
        assert kv.base is not None  # an OCDBT kvstore has one
        found = arrays.chunk_bytes(kv.base, db, keys)
    except Exception:  # the B-tree can't be walked: keep naming the data directory
        return problems
    out = []
    for p in problems:
        at = None if p.chunk is None else found.get(_key(p.leaf, p.chunk))
        if at is not None:  # "(process N's data files)" only where the file is process N's
            whose = re.search(r"/(p\d+)/d/ \((process \d+'s data files)\)$", p.where)
            suffix = f" ({whose[2]})" if whose and f"/{whose[1]}/" in at.file else ""
            p = dataclasses.replace(p, where=f"{at}{suffix}", location=at)
        out.append(p)
    return out


def _first_line(e: Exception) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:400]
