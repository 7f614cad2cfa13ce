"""Which array leaves a committed step changed against the one before it, from the leaves'
fingerprints (format 1.10), and the warning when a step changed none: a stale save.

Async saves that keep a cached structure can write the first step's tensors again and
again (NVIDIA-NeMo/RL#3312: steps 90, 110 and 120 bit-identical, found only on resume);
every chunk is intact, so no checksum notices. A manager asks :class:`Changes` after each
commit (process 0, with the manifest it wrote) and records the count in the run log.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .manifest import Manifest, read_manifest
from .storage import Location

log = logging.getLogger("jaxckpt")

Fingerprints = dict[str, tuple[tuple[int, ...], str | None, str]]  # name: shape, dtype, print


def fingerprints(manifest: Manifest) -> Fingerprints | None:
    """Every array leaf's shape, dtype and fingerprint; None when one has no fingerprint
    (written before format 1.10)."""
    out: Fingerprints = {}
    for rec in manifest.leaves:
        if rec.has_array:
            if rec.fingerprint is None:
                return None
            out[rec.name] = (tuple(rec.shape), rec.dtype, rec.fingerprint)
    return out


def changed(now: Fingerprints, before: Fingerprints) -> int:
    """The array leaves of ``now`` that ``before`` lacks or holds other values of."""
    return sum(1 for name, value in now.items() if before.get(name) != value)


@dataclass
class Changes:
    """One manager's memory of its last committed step's fingerprints, and whether it has
    warned of a stale save yet (once per manager)."""

    where: str
    last: tuple[int, Fingerprints] | None = None
    warned: bool = False

    def committed(
        self, step: int, manifest: Manifest, previous: tuple[int, Location] | None
    ) -> int | None:
        """The number of array leaves committed ``step`` (whose ``manifest`` process 0 just
        wrote) changed against the ``previous`` committed step (its number and path; None:
        the first); None when unknown (no previous step, or one written before 1.10 or
        whose manifest does not read: the save itself has committed, and a warning is no
        reason to fail it)."""
        now = fingerprints(manifest)
        before = self._before(previous)
        self.last = None if now is None else (step, now)
        if now is None or before is None or previous is None:
            return None
        count = changed(now, before)
        if count == 0 and now and not self.warned:
            self.warned = True
            log.warning(
                "jaxckpt: step %d in %s holds exactly the arrays of step %d (all %d array "
                "leaves have the same fingerprints) although the step moved on: is the "
                "state given to save() stale (an old reference, a cached structure, a "
                "copy taken before training went on)? Not repeated; the run log counts "
                "leaves_changed for every save",
                step,
                self.where,
                previous[0],
                len(now),
            )
        return count

    def _before(self, previous: tuple[int, Location] | None) -> Fingerprints | None:
        if previous is None:
            return None
        if self.last is not None and self.last[0] == previous[0]:
            return self.last[1]
        try:
            return fingerprints(read_manifest(previous[1]))
        except Exception:  # noqa: BLE001 - deleted meanwhile, or damaged: unknown
            return None
