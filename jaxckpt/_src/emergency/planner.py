"""The emergency restore's plan, as pure functions of what the processes published (no jax):
which step every slice of which some process holds, who sends which slice to whom, and in
which ``ppermute`` rounds. Every process computes the same plan from the same facts.

Also the one key of a slice in memory, :class:`SliceKey`, and its JSON form for the
key-value exchanges (``keys_to_json`` / ``keys_from_json``)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..boxes import Index, from_text, to_text


class SliceKey(NamedTuple):
    """A slice of a leaf: the leaf's name and the slice's global index. The one key of a
    slice in memory; as text (``0:16,0:8``) only in JSON and in reports."""

    leaf: str
    box: Index


def keys_to_json(keys: Iterable[SliceKey]) -> dict[str, list[str]]:
    """Slices as they travel in the key-value exchanges: {leaf: [index key, ...]}."""
    out: dict[str, list[str]] = {}
    for key in keys:
        out.setdefault(key.leaf, []).append(to_text(key.box))
    return out


def keys_from_json(doc: dict[str, list[str]]) -> list[SliceKey]:
    """The slices ``keys_to_json`` wrote, in its order."""
    return [SliceKey(leaf, from_text(text)) for leaf, texts in doc.items() for text in texts]


@dataclass(frozen=True)
class StepHolding:
    """What one process holds of one local step (published before a restore)."""

    digest: str  # of the step's tree: copies of different trees are never combined
    need: dict[str, int]  # leaf -> how many slices the step has
    held: frozenset[SliceKey]  # the slices in this copy
    per_process: tuple[int, ...] = ()  # processes whose per-process records the copy has


@dataclass(frozen=True)
class Holdings:
    """What one process publishes before a restore: its local steps and the remote ones."""

    remote: tuple[int, ...]
    steps: dict[int, StepHolding]

    def holds(self, s: int, key: SliceKey) -> bool:
        """Whether this process's copy of step ``s`` has the slice ``key``."""
        entry = self.steps.get(s)
        return entry is not None and key in entry.held

    def to_json(self) -> str:
        """One JSON text: each step's fields as they are, its held slices as ``keys_to_json``."""
        steps = {
            s: {**vars(h), "held": keys_to_json(sorted(h.held))} for s, h in self.steps.items()
        }
        return json.dumps({"remote": self.remote, "steps": steps})

    @classmethod
    def from_json(cls, text: str) -> Holdings:
        doc = json.loads(text)
        steps: dict[int, StepHolding] = {}
        for s, h in doc["steps"].items():
            held = frozenset(keys_from_json(h["held"]))
            steps[int(s)] = StepHolding(h["digest"], h["need"], held, tuple(h["per_process"]))
        return cls(tuple(doc["remote"]), steps)


# PeerSlice and BadCopy are public (``RecoveryReport``) and have a field ``index``, which
# shadows tuple.index: mypy refuses that in the class form (an incompatible override), not in
# the functional one.

# A slice this process used that it did not read from a copy it wrote itself: ``index`` its
# global index ("0:16,0:8"), ``holder`` the process that read it from its local directory,
# ``writer`` the process that held it at save time.
PeerSlice = NamedTuple(  # noqa: UP014
    "PeerSlice", [("leaf", str), ("index", str), ("holder", int), ("writer", int)]
)


class Rejected(NamedTuple):
    """A newer step that was not used, and why."""

    step: int
    why: str


# A local copy that failed to read or verify: the ``process`` holding it, the slice (``leaf``,
# ``index`` as "0:16,0:8") and ``why``.
BadCopy = NamedTuple(  # noqa: UP014
    "BadCopy", [("process", int), ("leaf", str), ("index", str), ("why", str)]
)


class StepUnusable(Exception):
    """A local step cannot be assembled after verification; try the next one."""

    def __init__(self, why: str, bad_copies: tuple[BadCopy, ...] = ()) -> None:
        super().__init__(why)
        self.bad_copies = bad_copies


Moves = dict[tuple[int, int], set[SliceKey]]  # (sender, receiver) -> the slices sent
Bad = dict[tuple[int, SliceKey], BadCopy]  # (process, slice) -> why that copy failed


def plan_sends(
    s: int,
    views: Sequence[Holdings],
    holders: Sequence[int],
    needs: Sequence[Iterable[SliceKey]],
    bad: Bad,
) -> Moves:
    """Who sends what to whom: {(sender, receiver): {slice}}, for the slices each process
    ``needs``, without the copies in ``bad``.

    For every slice a process needs and has no verified copy of, the lowest process holding
    a verified copy sends it. Every process computes the same plan from the same facts.
    """
    sends: Moves = {}
    for q, need in enumerate(needs):
        for key in need:
            if views[q].holds(s, key) and (q, key) not in bad:
                continue
            ok = [p for p in holders if views[p].holds(s, key) and (p, key) not in bad]
            if not ok:
                raise StepUnusable(
                    f"no verified copy of {key.leaf}[{to_text(key.box)}] is left (bad copies: "
                    f"{sorted(b[:3] for b in bad.values())})",
                    tuple(bad.values()),
                )
            sends.setdefault((ok[0], q), set()).add(key)
    return sends


def sent_by(sends: Moves, p: int) -> set[SliceKey]:
    """Every slice process ``p`` sends, to anybody."""
    return set().union(*(keys for (a, _), keys in sends.items() if a == p))


def shift_rounds(sends: Moves, count: int) -> list[tuple[int, tuple[tuple[int, int], ...]]]:
    """The plan as ``ppermute`` rounds: [(shift, ((sender, receiver), ...))], one per distinct
    ``(receiver - sender) % count`` used, in order; in a round each process sends at most one
    row and receives at most one (a partial permutation). The same list on every process.
    """
    rounds: dict[int, list[tuple[int, int]]] = {}
    for a, b in sends:
        if sends[(a, b)]:
            rounds.setdefault((b - a) % count, []).append((a, b))
    return [(j, tuple(sorted(pairs))) for j, pairs in sorted(rounds.items())]


def uncovered(s: int, views: list[Holdings]) -> str | None:
    """Why step ``s`` cannot be assembled from what the processes say they hold (or None)."""
    entries = [v.steps[s] for v in views if s in v.steps]
    if len({e.digest for e in entries}) > 1:
        return "processes hold different trees under this step"
    held = Counter(key.leaf for key in set().union(*(e.held for e in entries)))
    for name, count in entries[0].need.items():
        if held[name] < count:
            return (
                f"{count - held[name]} of {count} slices of leaf {name!r} are held by none of "
                f"the {len(views)} processes"
            )
    return None


def candidates(views: list[Holdings], step: int | None = None) -> tuple[list[int], list[Rejected]]:
    """The local steps worth trying, newest first (every slice held somewhere), and the ones
    rejected before any read: not coverable, or older than the newest remote step (unless
    ``step`` asks for one)."""
    newest_remote = max(views[0].remote, default=None)
    steps = sorted({s for v in views for s in v.steps if step in (None, s)}, reverse=True)
    out: list[int] = []
    rejected: list[Rejected] = []
    for s in steps:
        if step is None and newest_remote is not None and newest_remote > s:
            rejected.append(Rejected(s, f"the remote tier has a newer step {newest_remote}"))
            break
        why = uncovered(s, views)
        if why:
            rejected.append(Rejected(s, why))
        else:
            out.append(s)
    return out, rejected
