"""Restoring from copies held by several processes: who sends what, and assembling leaves.

Slices are identified by their global index, never by device id: ``plan_sends`` picks, for
every slice a process needs and lacks, the lowest process holding a verified copy (sent to
that process alone, in ``shift_rounds`` of ``ppermute``);
``fill``/``assemble`` cut any needed region out of whatever saved slices cover it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .. import arrays
from ..boxes import Index, from_slices, intersect
from ..leaf_plan import Want, place_key
from ..placement import Placement
from .planner import BadCopy, PeerSlice, Rejected


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
    """The saved slices this process must have to build ``w``."""
    rec = w.record
    if not rec.has_array or not math.prod(rec.shape):
        return []
    if rec.kind == "prng_key" or w.sharding is None:
        return list(required)
    shape = tuple(rec.shape)
    targets = {
        from_slices(i, shape) for i in w.sharding.addressable_devices_indices_map(shape).values()
    }
    return [s for s in required if any(intersect(s, t) is not None for t in targets)]


def fill(index: Index, required: list[Index], data: dict, name: str, dtype) -> np.ndarray:
    exact = data.get((name, index))
    if exact is not None:  # the held buffer itself, no copy
        return exact if exact.dtype == dtype else exact.view(dtype)
    out = arrays.aligned_empty(tuple(b - a for a, b in index), np.dtype(dtype))
    for s in required:
        part = intersect(s, index)
        if part is None:
            continue
        src = data[(name, s)]
        if src.dtype != dtype:
            src = src.view(dtype)
        dst_sl = tuple(
            slice(lo - t0, hi - t0) for (lo, hi), (t0, _) in zip(part, index, strict=True)
        )
        src_sl = tuple(slice(lo - s0, hi - s0) for (lo, hi), (s0, _) in zip(part, s, strict=True))
        out[dst_sl] = src[src_sl]
    return out


def assemble(w: Want, required: list[Index], data: dict) -> Any:
    rec = w.record
    if not rec.has_array:
        return rec.value
    shape = tuple(rec.shape)
    saved = rec.data_dtype
    want = w.dtype or saved
    whole = tuple((0, d) for d in shape)
    if rec.kind == "prng_key" or w.sharding is None:
        full = fill(whole, required, data, rec.name, saved).astype(want, copy=False)
        if rec.kind == "prng_key":
            key = jax.random.wrap_key_data(full, impl=rec.prng_impl)
            return key if w.sharding is None else place_key(full, w, rec)
        return full[()] if rec.kind == "numpy" and rec.scalar else full
    out = Placement(w.sharding, shape, want)
    for index in out.indices:  # ``data`` is dropped after the restore: buffers may be adopted
        out.put(index, fill(index, required, data, rec.name, saved).astype(want, copy=False))
    return out.array()
