"""Moving byte rows between processes through JAX collectives (one device per process).

Used for peer copies of local checkpoints (``exchange_rows``: a ``ppermute`` per shift) and
for handing missing slices to the processes that need them on restore (``send_rows``: a
``ppermute`` of a partial permutation, so a process receives only the row meant for it).
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


def exchange_rows(row: np.ndarray, *, name: str, timeout_s: float, shifts=()) -> list[np.ndarray]:
    """Moves one uint8 row per process through a JAX collective (a collective call).

    Returns, per ``j`` in ``shifts``, the row of process ``(me - j) % count`` (a full
    ``ppermute`` per shift; each process holds 2 rows at a time). Rows are zero-padded to the
    longest one (lengths agreed through the key-value store).
    """
    count = jax.process_count()
    shifts = list(shifts)
    width = _width(row, name, timeout_s)
    if width == 0:
        return [np.zeros(0, np.uint8)] * len(shifts)
    mesh = _row_mesh()
    x = _global_row(mesh, row, width)
    out = []
    for j in shifts:
        perm = tuple((i, (i + j) % count) for i in range(count))
        out.append(np.asarray(_permute_fn(mesh, perm)(x).addressable_shards[0].data)[0])
    return out


def send_rows(
    row: np.ndarray, pairs: tuple[tuple[int, int], ...], *, name: str, timeout_s: float
) -> np.ndarray | None:
    """One ``ppermute`` round of a partial permutation (a collective call: every process
    calls it with the same ``pairs``).

    ``pairs`` = ((sender, receiver), ...), each process at most once on each side. A sender
    passes the row for its receiver (the others pass an empty row, never read); returns the
    row this process receives (zero-padded to the round's longest row), or None when it
    receives nothing. Only the pairs' rows move; each process holds at most 2 rows.
    """
    width = _width(row, name, timeout_s)
    me = jax.process_index()
    if width == 0:
        return np.zeros(0, np.uint8) if any(b == me for _, b in pairs) else None
    mesh = _row_mesh()
    x = _global_row(mesh, row, width, zero=any(a == me for a, _ in pairs))
    y = _permute_fn(mesh, tuple(pairs))(x)
    del x
    if not any(b == me for _, b in pairs):
        return None
    return np.asarray(y.addressable_shards[0].data)[0]


def _width(row: np.ndarray, name: str, timeout_s: float) -> int:
    lengths = multihost.all_gather(f"{name}/len", str(row.size), timeout_s)
    return max(int(n) for n in lengths)


def _global_row(mesh: Mesh, row: np.ndarray, width: int, zero: bool = True) -> jax.Array:
    """This process's row, padded to ``width``, as its shard of a (count, width) array.

    ``zero=False``: the row is never read (not a sender), so its padding is left unwritten
    (the memory is never touched).
    """
    me = mesh.devices[jax.process_index()]
    if row.size == width and row.ctypes.data % 64 == 0:
        padded = row.reshape(1, width)  # the row itself: no copy
    else:
        padded = arrays.aligned_empty((1, width), np.dtype(np.uint8))
        if row.size:
            padded[0, : row.size] = row
        if zero:
            padded[0, row.size :] = 0
    # may_alias: the device adopts the row instead of copying it (the caller drops the row;
    # collectives write their results into fresh buffers)
    return jax.make_array_from_single_device_arrays(
        (mesh.devices.size, width),
        NamedSharding(mesh, P("p")),
        [jax.device_put(padded, me, may_alias=True)],
    )


@functools.lru_cache(maxsize=32)
def _permute_fn(mesh: Mesh, perm: tuple[tuple[int, int], ...]):
    return jax.jit(
        jax.shard_map(
            lambda b: jax.lax.ppermute(b, "p", list(perm)),
            mesh=mesh,
            in_specs=P("p"),
            out_specs=P("p"),
        )
    )
