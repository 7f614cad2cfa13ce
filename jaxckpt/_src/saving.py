"""Writing one checkpoint directory: ``save`` = ``prepare`` + ``commit``.

``prepare`` checks everything a save is given (before anything is written) and describes
the tree: each leaf's manifest record and the pieces this process writes
(``staging.describe``). ``commit`` agrees with the other processes in one key-value round
(the same tree everywhere? who runs where?), writes this process's pieces into its own
OCDBT database (``ocdbt_write.write``, which leaves to ``arrays.write`` what it does not
write itself), and process 0 merges the databases, writes
``manifest.json`` and commits the directory (``steps.committing``). A
``CheckpointManager`` prepares on the calling thread (with a host snapshot, for an
asynchronous save) and commits on its writer thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from ..errors import CheckpointExistsError, ManifestError, OptionsError, UnsupportedLeafError
from . import gc_pause, multihost, staging, steps, writer
from . import per_process as pp
from .io import arrays, codecs, fingerprint, ocdbt_write
from .manifest import COMMIT_FILE, MANIFEST_FILE, Manifest
from .monitoring import Figures, Stopwatch
from .options import Options
from .staging import HostCopies, Staged, StagedLeaf, describe, snapshot
from .storage import Location, location, storage_error

DEFAULT_TIMEOUT_S = 600.0


def save(
    path: str | os.PathLike,
    tree: Any,
    *,
    custom_metadata: Any = None,
    metrics: dict | None = None,
    compression: str | None = None,
    chunk_bytes: int | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    per_process: Any = None,
) -> Figures:
    """Writes ``tree`` as one checkpoint directory at ``path``; blocks until committed.

    Every process must call it with the same tree structure. Each writes only the shards it
    owns, one replica of each. ``custom_metadata`` is any JSON-serializable value kept in
    the manifest (read back by :func:`custom_metadata`); ``metrics`` a dict of numbers (used
    by the manager to rank steps). ``tree`` may be a handle from :func:`jaxckpt.stage`.
    Refuses to overwrite a committed checkpoint. ``chunk_bytes``: store each shard as chunks
    of at most that many bytes (split along the largest dimension first, so chunks stay
    close to cubes): a restore that needs a thin slice of a shard reads only the chunks it
    touches. ``per_process``: this process's own value (a data iterator's ``get_state()``,
    bytes, JSON, or a pytree of NumPy arrays), which may differ between processes; read back
    by :func:`per_process`. ``compression``: None, ``"zstd"`` or ``"blosc"`` (byte
    shuffle by the element's size, then zstd: fits float weights), a level after a colon
    (``"blosc:5"``); see :class:`jaxckpt.Options`. A local save's files are written with
    O_DIRECT where the directory is on a disk filesystem (``Options.direct_io``'s default;
    a manager's ``Options`` choose otherwise: ``direct_io``, ``drop_page_cache``). Every
    array leaf's fingerprint goes into the manifest (format 1.10, ``io/fingerprint.py``).

    Shards held by several processes are written in parts, one part by each (see
    ``sharding.write_split``), so save time falls with the number of hosts. Returns this
    process's figures (:class:`jaxckpt.Figures`: phases, bytes, GB/s), also reported through
    ``jax.monitoring``.

    >>> jaxckpt.save("/ckpt/run1/step_100", {"params": params, "step": 100})
    """
    with gc_pause.paused():  # the caller waits: dozens of collections otherwise
        prepared = prepare(
            path,
            tree,
            custom_metadata=custom_metadata,
            metrics=metrics,
            per_process=per_process,
            compression=compression,
            chunk_bytes=chunk_bytes,
        )
        return commit(prepared, timeout_s)


@dataclass(frozen=True)
class Writes:
    """How a save writes its local files past the page cache: ``Options.direct_io`` and
    ``Options.drop_page_cache`` (the defaults for :func:`save`; a manager passes its
    options' with :meth:`of`)."""

    direct_io: bool | None = None
    drop_page_cache: bool = False

    @classmethod
    def of(cls, options: Options) -> Writes:
        return cls(options.direct_io, options.drop_page_cache)


DEFAULT_WRITES = Writes()  # O_DIRECT where the filesystem takes it, else the page cache


@dataclass(frozen=True)
class Prepared:
    """A save checked and described, ready to ``commit`` (on another thread, maybe)."""

    loc: Location
    staged: Staged
    custom_metadata: Any
    metrics: dict | None
    record: pp.Record | None  # this process's per-process value, encoded
    clock: Stopwatch
    writes: Writes = DEFAULT_WRITES

    def snapshot(self, host: HostCopies) -> Prepared:
        """The same save with the pieces this process writes copied to the host now."""
        with self.clock.phase("describe"):
            return dataclasses.replace(self, staged=snapshot(self.staged, host))


def prepare(
    path: str | os.PathLike,
    tree: Any,
    *,
    custom_metadata: Any = None,
    metrics: dict | None = None,
    per_process: Any = None,
    compression: str | None = None,
    chunk_bytes: int | None = None,
    writes: Writes = DEFAULT_WRITES,
) -> Prepared:
    """Checks a save's arguments and describes ``tree`` (see :func:`save`); writes nothing
    and reads no storage (``commit`` checks the path is free)."""
    loc = location(path)
    try:
        codecs.parse(compression)
    except OptionsError as e:
        raise OptionsError(f"{loc.url}: {e}") from None
    if chunk_bytes is not None and chunk_bytes < 1:
        raise OptionsError(f"{loc.url}: chunk_bytes={chunk_bytes!r}; pass None or a positive size")
    check_json(custom_metadata, "custom_metadata", loc)
    check_json(metrics, "metrics", loc)
    record = pp.encode(per_process, where=loc.url)
    clock = Stopwatch("save", loc.url)
    with clock.phase("describe"):
        staged = describe(tree, compression=compression, chunk_bytes=chunk_bytes)
    _check_unique_names(staged.leaves, loc)
    return Prepared(loc, staged, custom_metadata, metrics, record, clock, writes)


@dataclass(frozen=True)
class _Writer:
    """What each process tells process 0 in the save's agreement round (as JSON)."""

    host: str
    save_id: str  # process 0's names the temporary directory and the barriers
    nbytes: int
    has_record: bool  # wrote a per-process value


def commit(
    prepared: Prepared, timeout_s: float = DEFAULT_TIMEOUT_S, cancel: writer.Cancel | None = None
) -> Figures:
    """Writes a prepared save on every process and commits it; blocks until committed
    (:func:`committed`, its figures only)."""
    return committed(prepared, timeout_s, cancel)[0]


def committed(
    prepared: Prepared, timeout_s: float = DEFAULT_TIMEOUT_S, cancel: writer.Cancel | None = None
) -> tuple[Figures, Manifest | None]:
    """Writes a prepared save on every process and commits it; blocks until committed.
    Returns this process's figures and, on process 0, the manifest it wrote (a manager
    compares its fingerprints with the previous step's without reading it back).

    ``cancel`` (default: that of the manager's job running this, ``writer.current``, or
    ``writer.NEVER`` outside one) is checked between phases and while waiting for the other
    processes; process 0 claims the commit right before the rename and the marker, so a
    cancel either wins (nothing is committed; SaveCancelledError) or loses (the step
    commits). On a local disk process 0
    removes the temporary directory when cancelled; on object stores the step's objects
    stay until the next manager's ``steps.clean_leftovers``.
    """
    loc, leaves, clock = prepared.loc, prepared.staged.leaves, prepared.clock
    manifest: Manifest | None = None
    cancel = cancel or writer.current() or writer.NEVER
    check = cancel.waits_check()
    # first, so that every process takes the same name even if it stops below
    name = multihost.unique_name("save")
    pid, count = multihost.process_index(), multihost.process_count()
    if count > 1:
        cancel.bind(f"{name}/decision")
    cancel.check()
    # checked here, not in prepare: a manager's calling thread never waits on storage
    if loc.exists(COMMIT_FILE):
        raise CheckpointExistsError(
            f"{loc.url} already holds a committed checkpoint; choose a new path or delete it first"
        )
    writes = [leaf.write for leaf in leaves if leaf.write is not None]
    clock.bytes = sum(w.nbytes for w in writes)
    me = _Writer(
        multihost.host_name(), uuid.uuid4().hex[:12], clock.bytes, prepared.record is not None
    )
    # Process 0's temporary directory exists, locked, before the others learn its name and
    # make their parts in it (steps.committing); removed if anything fails or they disagree.
    with steps.committing(loc, me.save_id) if pid == 0 else contextlib.nullcontext():
        # One round before any data is written: the same path, tree, shapes and dtypes on
        # every process? Who runs where, and process 0's id for this save (temporary
        # directory and barrier names, so a restarted job never meets a stale one).
        agreed = multihost.agree(
            name,
            _summary(loc, leaves),
            timeout_s,
            what=loc.url,
            extra=json.dumps(dataclasses.asdict(me)),
            check=check,
        )
        save_id = _Writer(**json.loads(agreed.first)).save_id
        work = steps.work_dir(loc, save_id)
        db = arrays.database_dir(work, None if count == 1 else pid)
        db.makedirs()
        with clock.phase("write"):
            cancel.check()
            if cancel.follows_cancel and not db.is_local and pid > 0:
                # the cancelled save of this step may have written here after process 0
                # cleared the step's objects: a leftover database would refuse ``create``
                db.remove()
            sums = fingerprint.Sums()
            try:
                ocdbt_write.write(
                    db,
                    writes,
                    direct_io=prepared.writes.direct_io,
                    drop_page_cache=prepared.writes.drop_page_cache,
                    fetch=staging.to_host_all,
                    sums=sums,
                )
            except OSError as e:  # a StorageError too: named by the step, not its work dir
                raise storage_error(e, loc, "saving") from e
            cancel.check()
            if prepared.record is not None:
                work.join(pp.DIRECTORY).write_bytes(
                    pp.file_name(pid), json.dumps(prepared.record.to_json()).encode()
                )
        with clock.phase("commit"):
            cancel.check()
            # each process's fingerprint sums reach process 0 once every process has written
            sums_of = multihost.gather(
                f"jaxckpt/{save_id}/written", json.dumps(sums.texts()), timeout_s,
                what=loc.url, check=check,
            )  # fmt: skip
            if pid == 0:
                if count > 1:
                    arrays.merge(work, count)
                got = [_Writer(**json.loads(e)) for e in agreed.all or []]
                manifest = manifest_of(
                    with_fingerprints(leaves, [json.loads(t) for t in sums_of]),
                    prepared.staged.meshes,
                    [w.host for w in got],
                    [w.nbytes for w in got],
                    prepared.custom_metadata,
                    prepared.metrics,
                )
                with_records = [p for p, w in enumerate(got) if w.has_record]
                manifest = dataclasses.replace(manifest, per_process=with_records or None)
                work.write_bytes(MANIFEST_FILE, manifest.to_json().encode(), create_dir=False)
                cancel.claim()  # the commit point: leaving ``committing`` publishes
    with clock.phase("commit"):
        multihost.barrier(f"jaxckpt/{save_id}/committed", timeout_s, what=loc.url, check=check)
    return clock.done(), manifest


def with_fingerprints(
    leaves: Sequence[StagedLeaf], sums: Sequence[dict[str, str]]
) -> list[StagedLeaf]:
    """``leaves`` with each array leaf's fingerprint: the sum of what the processes that
    write it added up (``sums``, one dict a process); a leaf no process wrote a byte of is
    empty. Where the record lists the chunks' writers (not a named sharding), only theirs:
    a single-device array of each process's own is written by each, and read back as one."""
    out = []
    for leaf in leaves:
        name, listed = leaf.record.name, leaf.record.chunk_writers
        if leaf.record.has_array:
            writers = None if listed is None else {int(p) for _, p in listed}
            value = fingerprint.combine(
                fingerprint.from_text(s[name])
                for p, s in enumerate(sums)
                if name in s and (writers is None or p in writers)
            )
            record = dataclasses.replace(leaf.record, fingerprint=fingerprint.to_text(value))
            leaf = dataclasses.replace(leaf, record=record)
        out.append(leaf)
    return out


def check_json(value: Any, what: str, loc: Location) -> None:
    """Fails before anything is written if ``value`` cannot go into the manifest."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ManifestError(
            f"{loc.url}: {what} must be JSON-serializable (dicts, lists, str, int, float, bool, "
            f"None): {e}. Convert arrays with float()/int()/.tolist() first"
        ) from e


def _summary(loc: Location, leaves: tuple[StagedLeaf, ...]) -> dict:
    """What every process must agree on before a multi-process save writes anything."""
    return {
        "path": loc.url,
        "leaves": len(leaves),
        "tree": [
            (r.name, r.kind, list(r.shape), r.dtype) for r in (leaf.record for leaf in leaves)
        ],
    }


def _check_unique_names(leaves: tuple[StagedLeaf, ...], loc: Location) -> None:
    seen: dict[str, list] = {}
    for leaf in leaves:
        other = seen.setdefault(leaf.record.name, leaf.record.path)
        if other is not leaf.record.path:
            raise UnsupportedLeafError(
                f"{loc.url}: leaves {other} and {leaf.record.path} both map to the name "
                f"{leaf.record.name!r}; rename one of the keys"
            )


def manifest_of(
    leaves: Sequence[StagedLeaf],
    meshes: list[dict],
    hosts: list[str],
    bytes_per_process: list[int],
    metadata: Any,
    metrics: dict | None,
) -> Manifest:
    from .. import __version__

    return Manifest(
        leaves=tuple(leaf.record for leaf in leaves),
        meshes=meshes,
        process_count=len(hosts),
        process_hosts=hosts,
        bytes_per_process=bytes_per_process,
        metadata=metadata,
        metrics=metrics,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        writer={
            "jaxckpt": __version__,
            "jax": jax.__version__,
            "tensorstore": package_version("tensorstore"),
        },
    )


def package_version(name: str) -> str:
    """The installed version of the distribution ``name`` ("?" when it is not installed)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "?"
