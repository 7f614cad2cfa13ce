"""Converting checkpoints: Orbax or safetensors to jaxckpt, jaxckpt to safetensors.

Both stream a few leaves at a time (``BATCH_BYTES``, or the largest leaf, in host memory):
``to_safetensors`` lays out the files from the manifest first, then fills them;
``to_jaxckpt`` writes each batch in one OCDBT transaction, then the manifest.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from ...errors import CheckpointExistsError, SafetensorsError, UnsupportedLeafError
from .. import multihost, saving, steps
from .. import tree as tree_lib
from ..io import arrays
from ..manifest import COMMIT_FILE, MANIFEST_FILE, LeafRecord, read_manifest
from ..orbax import checkpoint as orbax
from ..restoring import restore
from ..safetensors import load as st
from ..safetensors.format import INDEX_FILE, batches, create_files, index_json, plan, write_in_place
from ..safetensors.mapping import dotted
from ..staging import StagedLeaf, describe
from ..storage import Location, location
from ..tree import PathJson

BATCH_BYTES = 256 << 20  # host memory of a conversion: leaves read and written together
Path = str | os.PathLike | Location


def to_jaxckpt(src: Path, dst: Path) -> None:
    """An Orbax checkpoint, or safetensors files, as a jaxckpt checkpoint at ``dst``: a few
    leaves at a time (at most ``BATCH_BYTES`` of them in memory), each batch one OCDBT
    transaction, then the manifest and the commit (one process)."""
    s, d = location(src), location(dst)
    item = orbax.item_dir(s)
    if item is not None:
        source = orbax.read(item)
        leaves: list[tuple[PathJson, Any]] = [(r.path, r) for r in source.manifest.leaves]
        custom = source.manifest.metadata

        def read(batch: list[tuple[PathJson, Any]]) -> Any:
            return tree_lib.unflatten_paths(
                [(r.path, v) for r, v in host_leaves(s, [r for _, r in batch])]
            )
    else:
        leaves = [([["k", name]], t) for name, t in st.metadata(s.url).items()]
        custom = None

        def read(batch: list[tuple[PathJson, Any]]) -> Any:
            return st.load(s.url, {p[0][1]: _numpy_spec(t.shape, t.dtype) for p, t in batch})

    if d.exists(COMMIT_FILE) or os.path.exists(d.url):
        raise CheckpointExistsError(f"{d.url} already exists; choose a new path or delete it")
    staged: list[StagedLeaf] = []
    total = 0
    with steps.committing(d) as work:
        db = arrays.database_dir(work, None)
        db.makedirs()
        for batch in batches(leaves, lambda leaf: leaf[1].nbytes, BATCH_BYTES):
            written, nbytes = _write_batch(db, read(batch))
            staged += written
            total += nbytes
        order = {tree_lib.path_name(p): k for k, (p, _) in enumerate(leaves)}
        staged.sort(key=lambda leaf: order[leaf.record.name])
        manifest = saving.manifest_of(staged, [], [multihost.host_name()], [total], custom, None)
        work.write_bytes(MANIFEST_FILE, manifest.to_json().encode(), create_dir=False)


def _write_batch(db: Location, tree: Any) -> tuple[list[StagedLeaf], int]:
    """Writes the leaves of ``tree`` into the database ``db`` (one transaction); returns
    their records, without their data (freed on return: one batch in memory at a time), and
    the bytes written."""
    described = describe(tree).leaves
    writes = [leaf.write for leaf in described if leaf.write is not None]
    arrays.write(db, writes)
    return [StagedLeaf(leaf.record, None) for leaf in described], sum(w.nbytes for w in writes)


def _numpy_spec(shape: Sequence[int], dtype: Any) -> np.ndarray:
    """A NumPy target leaf (NumPy result) that takes no memory: a zero-stride view."""
    return np.broadcast_to(np.zeros((), dtype), tuple(shape))


def _host_leaf(rec: LeafRecord) -> Any:
    """The target leaf that restores ``rec`` on the host (NumPy), whatever the saved mesh."""
    if rec.kind in ("array", "numpy"):
        return _numpy_spec(rec.shape, rec.dtype)
    if rec.kind == "prng_key":  # the target has the key's shape, the record its data's
        return _numpy_spec(rec.shape[:-1], np.uint32)
    return rec.value


def host_leaves(src: Path, records: Sequence[LeafRecord]) -> Iterator[tuple[LeafRecord, Any]]:
    """``(record, value)`` for each of ``records`` (of the checkpoint at ``src``), in order,
    restored on the host a batch (``BATCH_BYTES``) at a time: arrays as NumPy, PRNG keys as
    their key data, Python values as they are."""
    loc = location(src)
    for recs in batches(records, lambda r: r.nbytes, BATCH_BYTES):
        tree = restore(
            loc.url, target=tree_lib.unflatten_paths([(r.path, _host_leaf(r)) for r in recs])
        )
        values = {tree_lib.path_name(p): v for p, v in tree_lib.flatten(tree)}
        for r in recs:
            v = values[r.name]
            yield r, np.asarray(jax.random.key_data(v)) if r.kind == "prng_key" else v


def to_safetensors(src: Path, dst: Path, *, max_file_bytes: float = 5e9) -> None:
    """A jaxckpt checkpoint as safetensors files at ``dst`` (HF layout, tensor names: the
    leaf paths joined by "."), a batch of leaves (``BATCH_BYTES``) in memory at a time."""
    s, d = location(src), location(dst)
    if not d.is_local:
        raise SafetensorsError(f"{d.url}: convert writes to a local or shared filesystem")
    if os.path.exists(d.url):
        raise CheckpointExistsError(f"{d.url} already exists; choose a new directory or delete it")
    manifest = read_manifest(s)
    keys = [r.name for r in manifest.leaves if r.kind == "prng_key"]
    if keys:
        raise UnsupportedLeafError(
            f"{s.url}: leaf {keys[0]!r} is a PRNG key, which safetensors cannot hold"
        )
    leaves = [r for r in manifest.leaves if r.kind in ("array", "numpy")]
    specs = [(dotted(r.path), np.dtype(r.dtype), tuple(r.shape)) for r in leaves]
    files, placed = plan(specs, max_file_bytes, {"format": "jaxckpt"})
    tensors = [placed[name] for name, _, _ in specs]
    writes = (  # each leaf read as it is written
        (t.file, t.begin, np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
        for t, (_, data) in zip(tensors, host_leaves(s, leaves), strict=True)
    )
    with steps.committing(d, marker=False) as work:
        create_files(work, files)
        write_in_place(work, files, writes)
        if len(files) > 1:
            work.write_bytes(INDEX_FILE, index_json(placed, {"format": "jaxckpt"}))
