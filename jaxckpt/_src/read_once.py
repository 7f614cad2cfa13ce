"""Read once, then move device to device: restores that don't re-read replicated slices.

In a data-parallel job a parameter is replicated over a 'data' axis that spans the hosts:
every process needs the same slices, and reading them from storage on each of N hosts
reads the state N times. Instead the leaf is read with a *read sharding*, its target's
PartitionSpec with the mesh axes it is replicated over added to dimensions they divide (so
each slice is read by one device, on one process, and the processes share the reading),
and then moved onto the target sharding in one ``jax.device_put`` of every such leaf
(XLA's collectives, device to device), as unsigned integers of the leaf's width
(``bits``), so no bit of a value changes on the way.

The plain per-process read is kept where it is as fast or the only safe way: one process, a
target that no two hosts need the same slice of (processes on one host share its page
cache, so the second read of a slice costs a memory copy, less than a transfer between
processes; object stores have no such cache, so there every process counts as its own
host), shardings other than ``NamedSharding``, NumPy results, PRNG keys and 1- and 2-bit
integers (see ``read_sharding`` and ``movable``). A host is ``multihost.host_name()``: the
hostname, or ``$JAXCKPT_HOST``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
from jax.sharding import NamedSharding, PartitionSpec
from numpy.typing import DTypeLike

from . import bits
from .sharding import entry_axes, holders


def shared_across_processes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> bool:
    """True when some slice of a NamedSharding is needed by devices of two processes."""
    return bool(_sharing_processes(sharding, shape))


@functools.lru_cache(maxsize=4096)
def _sharing_processes(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[tuple[int, ...], ...]:
    """The sets of processes (two or more) that need the same slice."""
    if jax.process_count() == 1 or not isinstance(sharding, NamedSharding) or not shape:
        return ()
    if sharding.memory_kind not in (None, jax.local_devices()[0].default_memory().kind):
        return ()  # pinned host memory, say: placed per process, from the host
    return tuple(sorted({p for p in holders(sharding, shape).values() if len(p) > 1}))


@functools.lru_cache(maxsize=4096)
def read_sharding(
    sharding: jax.sharding.Sharding,
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    hosts: tuple[str, ...],
) -> NamedSharding | None:
    """The sharding to read a leaf with before moving it onto ``sharding``, or None when
    reading straight into ``sharding`` is as good (see the module docstring). An axis is
    added to a dimension only where the slices stay whole ``chunks`` (a slice of a chunk
    costs the whole chunk's read); small shards, one chunk each, are read per process.
    ``hosts``: every process's host."""
    if not isinstance(sharding, NamedSharding):  # no processes share its slices either
        return None
    if not any(len({hosts[p] for p in ps}) > 1 for ps in _sharing_processes(sharding, shape)):
        return None
    spec = read_spec(sharding.spec, dict(sharding.mesh.shape), shape, chunks)
    return None if spec is None else NamedSharding(sharding.mesh, spec)


def read_spec(
    spec: PartitionSpec, axis_sizes: dict[str, int], shape: tuple[int, ...], chunks: tuple[int, ...]
) -> PartitionSpec | None:
    """``spec`` with the mesh axes it leaves out (the ones the leaf is replicated over)
    added, largest first, each to the dimension with the largest slices that it divides
    into whole chunks; None when no axis can be added."""
    entries = [entry_axes(e) for e in spec] + [()] * (len(shape) - len(spec))
    used = {a for entry in entries for a in entry}
    free = sorted(
        (a for a, k in axis_sizes.items() if a not in used and k > 1), key=lambda a: -axis_sizes[a]
    )
    parts = [math.prod(axis_sizes[a] for a in entry) for entry in entries]
    changed = False
    for axis in free:
        k = axis_sizes[axis]
        # the dimensions it divides into slices of whole chunks
        fits = [d for d in range(len(shape)) if shape[d] % (parts[d] * k * chunks[d]) == 0]
        if not fits:
            continue
        d = max(fits, key=lambda d: shape[d] // parts[d])
        entries[d], parts[d], changed = (*entries[d], axis), parts[d] * k, True
    if not changed:
        return None
    return PartitionSpec(*(None if not e else (e[0] if len(e) == 1 else e) for e in entries))


def movable(dtype: DTypeLike) -> bool:
    """Whether a leaf of ``dtype`` can be read once and moved (not 1- and 2-bit integers:
    see ``bits``)."""
    return bits.carrier(dtype) is not None


def move(
    arrays: Sequence[jax.Array], shardings: Sequence[jax.sharding.Sharding]
) -> list[jax.Array]:
    """``arrays`` moved onto ``shardings`` (collectives across processes, ``bits.transfer``),
    as bits: every byte arrives as it left (``bits``). ``arrays`` are given up
    (floating-point ones donated to their bitcasts)."""
    if not arrays:
        return []
    dtypes = [a.dtype for a in arrays]
    moved = bits.transfer(bits.to_bits(arrays), list(shardings))
    return bits.from_bits(moved, dtypes)
