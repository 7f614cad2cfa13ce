"""Building leaves out of the saved slices at hand, and the report of an emergency restore.

Slices are identified by their global index, never by device id: ``needed_slices`` says
which saved slices a process needs for its part of a leaf, ``fill``/``assemble`` cut any
needed region out of whatever saved slices cover it and place the leaf. (Who sends which
slice to whom is planned in :mod:`jaxckpt._src.emergency.planner`.)
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from numpy.typing import DTypeLike

from ..boxes import Index, extent, from_slices, intersect, whole, within
from ..io import arrays
from ..leaf_plan import Want, whole_on_host
from ..placement import Placement, cpu_replicas
from ..ring import Ring
from .local import Copies, Slices
from .planner import BadCopy, PeerSlice, Rejected, SliceKey


@dataclass(frozen=True)
class RecoveryReport:
    """What the last :meth:`EmergencyCheckpointManager.restore` used (this process's view;
    tier and step agree everywhere).

    from_peers: a :class:`PeerSlice` (leaf, index, holder, writer) for each slice this
        process used that it did not read from a copy it wrote itself: ``holder`` read it
        from its local directory (this process, for a peer copy on its own disk), ``writer``
        held it at save time.
    rejected: a :class:`Rejected` (step, why) for each newer step that was not used.
    bad_copies: a :class:`BadCopy` (process, leaf, index, why) for each local copy that
        failed to read or verify.
    per_process_from: the process whose local copy gave this process's ``per_process``
        value (itself, or a peer for a replaced host); None when none was saved.
    """

    tier: str
    step: int
    process_count: int
    saved_process_count: int | None = None
    from_peers: tuple[PeerSlice, ...] = ()
    rejected: tuple[Rejected, ...] = ()
    bad_copies: tuple[BadCopy, ...] = ()
    per_process_from: int | None = None


def needed_slices(w: Want, required: list[Index]) -> list[Index]:
    """The saved slices this process must have to build ``w``, of its leaf's ``required``
    (none for a leaf without array data: ``LocalStep.required`` leaves those out)."""
    rec = w.record
    if rec.kind == "prng_key" or w.sharding is None:
        return list(required)
    return list(_needed(w.sharding, tuple(rec.shape), tuple(required)))


@functools.lru_cache(maxsize=1024)
def _needed(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], required: tuple[Index, ...]
) -> tuple[Index, ...]:
    """``needed_slices`` for a leaf of ``shape`` on ``sharding``. Remembered: the leaves of a
    state share a few shardings, shapes and saved slices, and each leaf intersected every
    saved slice with every device's (docs/MEASURED.md)."""
    indices = sharding.addressable_devices_indices_map(shape).values()
    targets = {from_slices(i, shape) for i in indices if i is not None}
    return tuple(s for s in required if any(intersect(s, t) is not None for t in targets))


def mappable(w: Want, needed: list[Index]) -> dict[SliceKey, int]:
    """The slices of ``needed`` that a restore may map rather than read (``mapped``), each
    with its replicas' count: those that are exactly the slice of CPU devices of a leaf
    restored uncast (``placement.cpu_replicas``), so that the devices adopt the mappings
    as they are (``assemble``)."""
    rec = w.record
    if (
        rec.kind != "array"
        or w.sharding is None
        or np.dtype(w.dtype or rec.data_dtype) != rec.data_dtype
    ):
        return {}
    copies = cpu_replicas(w.sharding, tuple(rec.shape), rec.data_dtype)
    return {SliceKey(rec.name, box): copies[box] for box in needed if box in copies}


def fill(
    box: Index,
    required: list[Index],
    data: Slices,
    name: str,
    dtype: DTypeLike,
    host: Ring | None = None,
) -> np.ndarray:
    """The region ``box`` of leaf ``name``, cut out of the saved slices in ``data`` that
    cover it (the held buffer itself when one is exactly ``box``), viewed as ``dtype``;
    put together in a slot of ``host`` where it has one (``ring``: devices that copy)."""
    exact = data.get(SliceKey(name, box))
    if exact is not None:  # the held buffer itself, no copy
        return exact if exact.dtype == dtype else exact.view(dtype)
    shape, dt = extent(box), np.dtype(dtype)
    slot = host.take(math.prod(shape) * dt.itemsize) if host is not None else None
    out = arrays.aligned_empty(shape, dt) if slot is None else slot.view(dt).reshape(shape)
    for s in required:
        part = intersect(s, box)
        if part is not None:
            out[within(part, box)] = data[SliceKey(name, s)].view(dtype)[within(part, s)]
    return out


def assemble(
    w: Want,
    required: list[Index],
    data: Slices,
    copies: Copies | None = None,
    host: Ring | None = None,
) -> Any:
    """The value of ``w``'s leaf, built from the saved slices in ``data`` and placed as
    ``w`` asks; ``copies``: for slices read as mappings (``mappable``), their replicas'
    mappings, which the devices adopt as they are. ``host``: where slices cut out of
    several saved ones are put together on their way to devices that copy them (each slot
    given back once its copy is under way)."""
    rec = w.record
    if not rec.has_array:
        return rec.value
    shape = tuple(rec.shape)
    saved = rec.data_dtype
    want = w.dtype or saved
    if rec.kind == "prng_key" or w.sharding is None:
        full = fill(whole(shape), required, data, rec.name, saved).astype(want, copy=False)
        return whole_on_host(w, full)
    out = Placement(w.sharding, shape, want)
    for index in out.indices:  # ``data`` is dropped after the restore: buffers may be adopted
        raw = fill(index, required, data, rec.name, saved, host)
        value = raw.astype(want, copy=False)
        more = (copies or {}).get(SliceKey(rec.name, index)) if want == saved else None
        given = [m.view(saved) for m in more] if more else None
        if host is None or not host.holds(raw):
            out.put(index, value, given)
        else:
            host.give_back(raw, out.put(index, value, given, borrowed=True))
    return out.array()
