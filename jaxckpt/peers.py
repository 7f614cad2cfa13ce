"""Moving byte rows between processes through JAX collectives (one device per process).

Used for peer copies of local checkpoints (``ppermute``) and for handing missing slices to
the processes that need them on restore (``all_gather``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from . import arrays, multihost


def _row_mesh() -> Mesh:
    """One device per process, in process order."""
    first: dict[int, Any] = {}
    for d in sorted(jax.devices(), key=lambda d: d.id):
        first.setdefault(d.process_index, d)
    return Mesh(np.array([first[p] for p in range(jax.process_count())]), ("p",))


def exchange_rows(
    row: np.ndarray, *, name: str, timeout_s: float, shifts=(), gather: bool = False
) -> list[np.ndarray]:
    """Moves one uint8 row per process through a JAX collective (a collective call).

    ``shifts=(j, ...)``: returns, per j, the row of process ``(me - j) % count``
    (``ppermute``; each process holds 2 rows). ``gather=True``: returns every process's row
    (``all_gather``; each process holds ``count`` rows of the longest row's size).
    Rows are zero-padded to the longest one (lengths agreed through the key-value store).
    """
    count = jax.process_count()
    lengths = multihost.all_gather(f"{name}/len", str(row.size), timeout_s)
    width = max(int(n) for n in lengths)
    if width == 0:
        return [np.zeros(0, np.uint8)] * (count if gather else len(list(shifts)))
    mesh = _row_mesh()
    me = mesh.devices[jax.process_index()]
    if row.size == width and row.ctypes.data % 64 == 0:
        padded = row.reshape(1, width)  # the row itself: no copy
    else:
        padded = arrays.aligned_empty((1, width), np.dtype(np.uint8))
        padded[0, : row.size] = row
        padded[0, row.size :] = 0
    # may_alias: the device adopts the row instead of copying it (the caller drops the row;
    # collectives write their results into fresh buffers)
    x = jax.make_array_from_single_device_arrays(
        (count, width), NamedSharding(mesh, P("p")), [jax.device_put(padded, me, may_alias=True)]
    )
    if gather:
        rows = np.asarray(_gather_fn(mesh)(x).addressable_shards[0].data)
        return [rows[p] for p in range(count)]
    return [np.asarray(_permute_fn(mesh, j)(x).addressable_shards[0].data)[0] for j in shifts]


@functools.lru_cache(maxsize=16)
def _gather_fn(mesh: Mesh):
    return jax.jit(
        jax.shard_map(
            lambda b: jax.lax.all_gather(b, "p", tiled=True),
            mesh=mesh,
            in_specs=P("p"),
            out_specs=P(),
            check_vma=False,  # all_gather's result is the same on every process
        )
    )


@functools.lru_cache(maxsize=16)
def _permute_fn(mesh: Mesh, shift: int):
    count = mesh.devices.size
    perm = [(i, (i + shift) % count) for i in range(count)]
    return jax.jit(
        jax.shard_map(
            lambda b: jax.lax.ppermute(b, "p", perm),
            mesh=mesh,
            in_specs=P("p"),
            out_specs=P("p"),
        )
    )
