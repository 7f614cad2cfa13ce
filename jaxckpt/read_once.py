"""Read once, then move device to device: restores that don't re-read replicated slices.

In a data-parallel job a parameter is replicated over a 'data' axis that spans the hosts:
every process needs the same slices, and reading them from storage on each of N hosts
reads the state N times. Instead the leaf is read with a *read sharding*, its target's
PartitionSpec with the mesh axes it is replicated over added to dimensions they divide (so
each slice is read by one device, on one process, and the processes share the reading),
and then moved onto the target sharding in one ``jax.device_put`` of every such leaf
(XLA's collectives, device to device).

The plain per-process read is kept where it is as fast: one process, a target that no two
processes need the same slice of, shardings other than ``NamedSharding``, NumPy results and
PRNG keys (see ``read_sharding``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .sharding import normalize_index


def _axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


@functools.lru_cache(maxsize=4096)
def _shared_across_processes(sharding: NamedSharding, shape: tuple[int, ...]) -> bool:
    """True when some slice is needed by devices of two or more processes."""
    first: dict = {}
    for device, index in sharding.devices_indices_map(shape).items():
        p = first.setdefault(normalize_index(index, shape), device.process_index)
        if p != device.process_index:
            return True
    return False


@functools.lru_cache(maxsize=4096)
def read_sharding(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], chunks: tuple[int, ...]
) -> NamedSharding | None:
    """The sharding to read a leaf with before moving it onto ``sharding``, or None when
    reading straight into ``sharding`` is as good (see the module docstring). An axis is
    added to a dimension only where the slices stay whole ``chunks`` (a slice of a chunk
    costs the whole chunk's read); small shards, one chunk each, are read per process."""
    if jax.process_count() == 1 or not isinstance(sharding, NamedSharding) or not shape:
        return None
    if not _shared_across_processes(sharding, shape):
        return None
    mesh = sharding.mesh
    spec = [_axes(e) for e in sharding.spec] + [()] * (len(shape) - len(sharding.spec))
    used = {a for entry in spec for a in entry}
    free = sorted(
        (a for a in mesh.axis_names if a not in used and mesh.shape[a] > 1),
        key=lambda a: -mesh.shape[a],
    )
    parts = [math.prod(mesh.shape[a] for a in entry) for entry in spec]
    changed = False
    for axis in free:
        k = mesh.shape[axis]
        fits = [
            d
            for d in range(len(shape))
            if shape[d] % (parts[d] * k) == 0 and (shape[d] // (parts[d] * k)) % chunks[d] == 0
        ]
        if not fits:
            continue
        d = max(fits, key=lambda d: shape[d] // parts[d])
        spec[d], parts[d], changed = (*spec[d], axis), parts[d] * k, True
    if not changed:
        return None
    entries = [None if not e else (e[0] if len(e) == 1 else e) for e in spec]
    return NamedSharding(mesh, PartitionSpec(*entries))


def move(arrays: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]) -> list:
    """``arrays`` moved onto ``shardings`` in one transfer (collectives across processes)."""
    if not arrays:
        return []
    return list(jax.device_put(list(arrays), list(shardings), donate=True))
