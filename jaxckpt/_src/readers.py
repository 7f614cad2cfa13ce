"""What a committed checkpoint holds, without reading array data: its manifest (jaxckpt's,
or an Orbax checkpoint's read into the same records), the leaf tree of :class:`ArrayInfo`,
the custom metadata and the per-process values.
"""

from __future__ import annotations

import os
from typing import Any

from . import per_process as pp
from . import tree as tree_lib
from .manifest import Manifest, array_info, read_manifest
from .orbax import checkpoint as orbax
from .storage import Location, location


def any_manifest(loc: Location) -> tuple[orbax.OrbaxCheckpoint | None, Manifest]:
    """jaxckpt's manifest, or an Orbax checkpoint described as one (``jaxckpt._src.orbax.checkpoint``)."""
    item = orbax.item_dir(loc)
    if item is None:
        return None, read_manifest(loc)
    source = orbax.read(item)
    return source, source.manifest


def metadata(path: str | os.PathLike) -> Any:
    """The tree of :class:`ArrayInfo` (shape, dtype, saved mesh and spec, bytes); no data read.
    Reads Orbax checkpoints too (``jaxckpt._src.orbax.checkpoint``)."""
    _, manifest = any_manifest(location(path))
    items = [(leaf.path, array_info(leaf, manifest.meshes)) for leaf in manifest.leaves]
    return tree_lib.unflatten_paths(items)


def custom_metadata(path: str | os.PathLike) -> Any:
    """The ``custom_metadata=`` value given to :func:`jaxckpt.save` (None if none was)."""
    return read_manifest(path).metadata


def per_process(
    path: str | os.PathLike,
    *,
    process: int | None = None,
    all: bool = False,  # noqa: A002 - the keyword users write
) -> Any:
    """The ``per_process=`` value this process gave :func:`jaxckpt.save` (None if it gave
    none).

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
