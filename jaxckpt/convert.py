"""Converting checkpoints: Orbax or safetensors to jaxckpt, jaxckpt to safetensors.

``to_safetensors`` streams: it lays out the files from the manifest, then reads and writes
one leaf at a time, so host memory is the largest leaf. ``to_jaxckpt`` restores the source
on the host and saves it (host memory: the state), since one jaxckpt save commits the
whole tree in one transaction.
"""

from __future__ import annotations

import os
import uuid

import jax
import numpy as np

from . import checkpoint, orbax
from . import safetensors as st
from . import tree as tree_lib
from .errors import CheckpointExistsError, UnsupportedLeafError
from .restoring import read_manifest, restore
from .safetensors_format import INDEX_FILE, SafetensorsError, index_json, plan
from .storage import fsync_dir, location, rename_dir


def to_jaxckpt(src, dst) -> None:
    """An Orbax checkpoint, or safetensors files, as a jaxckpt checkpoint at ``dst``."""
    s = location(src)
    if orbax.item_dir(s) is not None:
        tree = restore(s, target=_host_target(orbax.read(orbax.item_dir(s)).manifest))
    else:
        info = st.metadata(s)
        target = {
            name: _numpy_spec(jax.ShapeDtypeStruct(t.shape, t.dtype))
            for name, t in info.items()
            if name != "__metadata__"
        }
        tree = st.load(s, target)
    checkpoint.save(dst, tree)


def _numpy_spec(sds: jax.ShapeDtypeStruct) -> np.ndarray:
    """A NumPy target leaf (NumPy result) that takes no memory: a zero-stride view."""
    return np.lib.stride_tricks.as_strided(np.zeros(1, sds.dtype), sds.shape, (0,) * len(sds.shape))


def _host_target(manifest):
    """A target that restores every leaf on the host (NumPy), whatever the saved mesh."""
    items = []
    for rec in manifest.leaves:
        if rec.kind in ("array", "numpy"):
            spec = jax.ShapeDtypeStruct(tuple(rec.shape), jax.numpy.dtype(rec.dtype))
            items.append((rec.path, _numpy_spec(spec)))
        else:
            items.append((rec.path, rec.value))
    return tree_lib.unflatten_paths(items)


def to_safetensors(src, dst, *, max_file_bytes: float = 5e9) -> None:
    """A jaxckpt checkpoint as safetensors files at ``dst`` (HF layout, tensor names: the
    leaf paths joined by "."), one leaf in memory at a time."""
    s, d = location(src), location(dst)
    if not d.is_local:
        raise SafetensorsError(f"{d.url}: convert writes to a local or shared filesystem")
    if os.path.exists(d.url):
        raise CheckpointExistsError(f"{d.url} already exists; choose a new directory or delete it")
    manifest = read_manifest(s)
    leaves = [r for r in manifest.leaves if r.kind in ("array", "numpy")]
    if any(r.kind == "prng_key" for r in manifest.leaves):
        name = next(r.name for r in manifest.leaves if r.kind == "prng_key")
        raise UnsupportedLeafError(
            f"{s.url}: leaf {name!r} is a PRNG key, which safetensors cannot hold"
        )
    names = {r.name: ".".join(str(k) for _, k in r.path) for r in leaves}
    specs = [(names[r.name], jax.numpy.dtype(r.dtype), tuple(r.shape)) for r in leaves]
    files, placed = plan(specs, max_file_bytes, {"format": "jaxckpt"})
    work = d.parent().join(f"{d.name}.tmp-{uuid.uuid4().hex[:8]}")
    work.makedirs()
    try:
        for f in files:
            with open(os.path.join(work.url, f.name), "wb") as fh:
                fh.write(f.header)
                fh.truncate(f.size)
        for rec in leaves:
            t = placed[names[rec.name]]
            target = tree_lib.unflatten_paths(
                [(rec.path, _numpy_spec(jax.ShapeDtypeStruct(t.shape, t.dtype)))]
            )
            (data,) = jax.tree.leaves(restore(s, target=target))
            with open(os.path.join(work.url, t.file), "r+b") as fh:
                fh.seek(t.begin)
                fh.write(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        for f in files:
            fd = os.open(os.path.join(work.url, f.name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
        if len(files) > 1:
            work.write_bytes(INDEX_FILE, index_json(files, placed, {"format": "jaxckpt"}))
        rename_dir(work, d)
        fsync_dir(d.parent().url)
    except BaseException:
        work.remove()
        raise
