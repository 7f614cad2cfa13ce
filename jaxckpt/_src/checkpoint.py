"""Writing one checkpoint directory (``save``) and reading its description (``metadata``).

A save goes: flatten the tree and describe each leaf -> each process writes the shards it
owns (``arrays.write``) -> barrier -> process 0 merges the per-process databases, writes
``manifest.json``, renames the temporary directory into place and writes ``COMMITTED``.

Reading a checkpoint back is :mod:`jaxckpt.restore`, which also reads the manifest
(``read_manifest``, used by ``metadata`` here). ``restore`` is re-exported, so
``checkpoint.restore`` (the manager, serving) keeps working; the import goes one way only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import uuid
import warnings
from typing import Any

import jax

from ..errors import (
    CheckpointExistsError,
    ManifestError,
    OptionsError,
    UnsupportedLeafError,
)
from . import arrays, multihost, steps
from . import per_process as pp
from . import tree as tree_lib
from .manifest import COMMIT_FILE, MANIFEST_FILE, Manifest, array_info
from .monitoring import Figures
from .restoring import any_manifest, read_manifest
from .restoring import restore as restore  # re-export: checkpoint.restore
from .staging import StagedLeaf, describe
from .storage import (
    Location,
    location,
)

DEFAULT_TIMEOUT_S = 600.0


# --- save ----------------------------------------------------------------------------------


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
    metadata: Any = None,
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
    by :func:`per_process`. (``metadata=`` is the deprecated name of ``custom_metadata=``.)

    Shards held by several processes are written in parts, one part by each (see
    ``sharding.write_split``), so save time falls with the number of hosts. Returns this
    process's figures (``monitoring.Figures``: phases, bytes, GB/s), also reported through
    ``jax.monitoring``.

    >>> jaxckpt.save("/ckpt/run1/step_100", {"params": params, "step": 100})
    """
    loc = location(path)
    metadata = renamed_metadata(custom_metadata, metadata)
    if compression not in (None, "zstd"):
        raise OptionsError(
            f"{loc.url}: compression={compression!r} is not supported; pass None or 'zstd'"
        )
    check_json(metadata, "custom_metadata", loc)
    check_json(metrics, "metrics", loc)
    if loc.exists(COMMIT_FILE):
        raise CheckpointExistsError(
            f"{loc.url} already holds a committed checkpoint; choose a new path or delete it first"
        )
    if chunk_bytes is not None and chunk_bytes < 1:
        raise OptionsError(f"{loc.url}: chunk_bytes={chunk_bytes!r}; pass None or a positive size")
    record = pp.encode(per_process, where=loc.url)
    fig = Figures("save", loc.url)
    with fig.phase("describe"):
        staged = describe(tree, compression=compression, chunk_bytes=chunk_bytes)
    leaves, meshes = list(staged.leaves), staged.meshes
    _check_unique_names(leaves, loc)
    writes = [leaf.write for leaf in leaves if leaf.write is not None]
    fig.bytes = sum(w.nbytes for w in writes)
    pid, count = multihost.process_index(), multihost.process_count()
    my_id = uuid.uuid4().hex[:12]
    # Process 0's temporary directory exists, locked, before the others learn its name and
    # make their parts in it (steps.committing); removed if anything fails or they disagree.
    lead = steps.committing(loc, my_id) if pid == 0 else contextlib.nullcontext()
    with lead:
        # One round before any data is written: the same path, tree, shapes and dtypes on
        # every process? Who runs where, and process 0's id for this save (temporary
        # directory and barrier names, so a restarted job never meets a stale one).
        agreed = multihost.agree(
            multihost.unique_name("save"),
            _summary(loc, leaves),
            timeout_s,
            what=loc.url,
            extra=f"{multihost.host_name()} {my_id} {fig.bytes} {int(record is not None)}",
        )
        save_id = agreed.first.rsplit(" ", 3)[1]
        got = [e.rsplit(" ", 3) for e in agreed.all or []]  # process 0 only
        hosts = [g[0] for g in got]
        bytes_per_process = [int(g[2]) for g in got]
        with_records = [p for p, g in enumerate(got) if g[3] == "1"]
        work = steps.work_dir(loc, save_id)
        db = arrays.database_dir(work, None if count == 1 else pid)
        db.makedirs()
        with fig.phase("write"):
            arrays.write(db, writes)
            if record is not None:
                work.join(pp.DIRECTORY).write_bytes(
                    pp.file_name(pid), json.dumps(record.to_json()).encode()
                )
        with fig.phase("commit"):
            multihost.barrier(f"jaxckpt/{save_id}/written", timeout_s, what=loc.url)
            if pid == 0:
                if count > 1:
                    arrays.merge(work, count)
                manifest = manifest_of(leaves, meshes, hosts, bytes_per_process, metadata, metrics)
                manifest = dataclasses.replace(manifest, per_process=with_records or None)
                work.write_bytes(MANIFEST_FILE, manifest.to_json().encode(), create_dir=False)
    with fig.phase("commit"):
        multihost.barrier(f"jaxckpt/{save_id}/committed", timeout_s, what=loc.url)
    return fig.done()


def check_json(value: Any, what: str, loc: Location) -> None:
    """Fails before anything is written if ``value`` cannot go into the manifest."""
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ManifestError(
            f"{loc.url}: {what} must be JSON-serializable (dicts, lists, str, int, float, bool, "
            f"None): {e}. Convert arrays with float()/int()/.tolist() first"
        ) from e


def _summary(loc: Location, leaves: list[StagedLeaf]) -> dict:
    """What every process must agree on before a multi-process save writes anything."""
    return {
        "path": loc.url,
        "leaves": len(leaves),
        "tree": [
            (r.name, r.kind, list(r.shape), r.dtype) for r in (leaf.record for leaf in leaves)
        ],
    }


def _check_unique_names(leaves: list[StagedLeaf], loc: Location) -> None:
    seen: dict[str, list] = {}
    for leaf in leaves:
        other = seen.setdefault(leaf.record.name, leaf.record.path)
        if other is not leaf.record.path:
            raise UnsupportedLeafError(
                f"{loc.url}: leaves {other} and {leaf.record.path} both map to the name "
                f"{leaf.record.name!r}; rename one of the keys"
            )


def manifest_of(
    leaves: list[StagedLeaf],
    meshes: list[dict],
    hosts: list[str],
    bytes_per_process: list[int],
    metadata: Any,
    metrics: dict | None,
) -> Manifest:
    from .. import __version__  # imported here: jaxckpt/__init__ imports this module

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
            "tensorstore": _dist_version("tensorstore"),
        },
    )


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


# --- what a committed checkpoint holds, no array data read ---------------------------------


def metadata(path: str | os.PathLike) -> Any:
    """The tree of :class:`ArrayInfo` (shape, dtype, saved mesh and spec, bytes); no data read.
    Reads Orbax checkpoints too (``jaxckpt._src.orbax``)."""
    _, manifest = any_manifest(location(path))
    items = [(leaf.path, array_info(leaf, manifest.meshes)) for leaf in manifest.leaves]
    return tree_lib.unflatten_paths(items)


def custom_metadata(path: str | os.PathLike) -> Any:
    """The ``custom_metadata=`` value given to :func:`save` (None if none was)."""
    return read_manifest(path).metadata


def per_process(
    path: str | os.PathLike,
    *,
    process: int | None = None,
    all: bool = False,  # noqa: A002 - the keyword users write
) -> Any:
    """The ``per_process=`` value this process gave :func:`save` (None if it gave none).

    Matched by process index, so only while the process count is unchanged; otherwise
    :class:`~jaxckpt.errors.ProcessCountChangedError`. ``process=i``: process i's value;
    ``all=True``: every process's, as a list, to redistribute after a count change.

    >>> it.set_state(jaxckpt.per_process("/ckpt/step_100"))  # a grain iterator
    """
    loc = location(path)
    manifest = read_manifest(loc)
    saved = set(manifest.per_process or ())

    def record(i: int) -> pp.Record | None:  # read only the records asked for
        return pp.read_record(loc, i) if i in saved else None

    return pp.choose(
        record, saved_count=manifest.process_count, where=loc.url, process=process, all=all
    )


def user_metadata(path: str | os.PathLike) -> Any:
    """Deprecated name of :func:`custom_metadata`."""
    warnings.warn(
        "jaxckpt.user_metadata is deprecated; use jaxckpt.custom_metadata",
        DeprecationWarning,
        stacklevel=2,
    )
    return custom_metadata(path)


def renamed_metadata(custom: Any, old: Any) -> Any:
    """``custom_metadata=``, or the deprecated ``metadata=`` with a warning (0.x only)."""
    if old is None:
        return custom
    if custom is not None:
        raise TypeError("pass custom_metadata= only (metadata= is its deprecated name)")
    warnings.warn(
        "save(metadata=...) is deprecated: 'metadata' names the leaf tree (jaxckpt.metadata); "
        "pass custom_metadata= instead",
        DeprecationWarning,
        stacklevel=3,
    )
    return old
