"""The emergency restore's plan, as pure functions of what the processes published (no jax):
which step every slice of which some process holds, who sends which slice to whom, and in
which ``ppermute`` rounds. Every process computes the same plan from the same facts.

Also the one key of a slice in memory, :class:`SliceKey`, and its JSON form for the
key-value exchanges (``keys_to_json`` / ``keys_from_json``)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
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
    """The slices ``keys_to_json`` wrote, in its order. (Leaves sharded alike share their
    indices: each distinct text is parsed once.)"""
    parsed: dict[str, Index] = {}
    out = []
    for leaf, texts in doc.items():
        for text in texts:
            box = parsed.get(text)
            if box is None:
                box = parsed[text] = from_text(text)
            out.append(SliceKey(leaf, box))
    return out


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
    a verified copy sends it. The lowest holders are found for those slices only, in one
    pass over the holders (``first_holders``): the plan costs the slices needed plus at most
    the slices held, not their product with the process count.
    """
    lacking = [
        (q, key)
        for q, need in enumerate(needs)
        for held in [_held(views[q], s)]
        for key in need
        if key not in held or (q, key) in bad
    ]
    first = first_holders(s, views, holders, bad, {key for _, key in lacking})
    sends: Moves = {}
    for q, key in lacking:
        sender = first.get(key)
        if sender is None:
            raise StepUnusable(
                f"no verified copy of {key.leaf}[{to_text(key.box)}] is left (bad copies: "
                f"{sorted(b[:3] for b in bad.values())})",
                tuple(bad.values()),
            )
        sends.setdefault((sender, q), set()).add(key)
    return sends


def _held(view: Holdings, s: int) -> frozenset[SliceKey]:
    entry = view.steps.get(s)
    return entry.held if entry is not None else frozenset()


def first_holders(
    s: int, views: Sequence[Holdings], holders: Sequence[int], bad: Bad, keys: set[SliceKey]
) -> dict[SliceKey, int]:
    """{slice of ``keys``: the lowest of ``holders`` with a verified copy of it in step
    ``s``}. Each holder's copies are met with the slices still unplaced (a set
    intersection walks the smaller side): the cost is the slices held, or less."""
    first: dict[SliceKey, int] = {}
    left = set(keys)
    for p in sorted(holders):
        if not left:
            break
        found = [key for key in left & _held(views[p], s) if (p, key) not in bad]
        first.update((key, p) for key in found)
        left.difference_update(found)
    return first


def sent_by(sends: Moves, p: int) -> set[SliceKey]:
    """Every slice process ``p`` sends, to anybody."""
    return set().union(*(keys for (a, _), keys in sends.items() if a == p))


def by_sender(sends: Moves) -> dict[int, dict[int, set[SliceKey]]]:
    """The plan per sender: {sender: {receiver: {slice}}}, in one pass (what each process
    is told of the plan: its own sends)."""
    out: dict[int, dict[int, set[SliceKey]]] = {}
    for (a, b), keys in sends.items():
        out.setdefault(a, {})[b] = keys
    return out


@dataclass
class StepPlan:
    """Process 0's plan of one step, kept across the read rounds of a restore.

    Process 0 alone holds every process's ``Holdings`` and needs; the others are told only
    their own part (what to read, whom to send what) and the ``ppermute`` rounds, so the
    restore's exchanges grow with the processes, not with their square.
    ``read_by[p]``: the slices process ``p`` has been told to read (its own needs it holds,
    and what it sends), kept once a copy failed.
    """

    s: int
    views: Sequence[Holdings]
    holders: list[int]
    needs: list[list[SliceKey]]
    sends: Moves
    bad: Bad = field(default_factory=dict)
    read_by: list[set[SliceKey]] | None = None  # made when a copy first fails

    @classmethod
    def start(cls, s: int, views: Sequence[Holdings], needs: list[list[SliceKey]]) -> StepPlan:
        """The first plan: every copy assumed good (raises StepUnusable if one is missing)."""
        holders = [p for p, v in enumerate(views) if s in v.steps]
        return cls(s, views, holders, needs, plan_sends(s, views, holders, needs, {}))

    def replan(self, failed: Sequence[Iterable[tuple[SliceKey, str]]]) -> list[set[SliceKey]]:
        """Adds the copies each process ``failed`` to read or verify, plans again without
        them (StepUnusable if a slice has no verified copy left) and returns what each
        process must read in addition (all empty: the plan is final)."""
        count = len(self.needs)
        new = [(p, key, why) for p, theirs in enumerate(failed) for key, why in theirs]
        if not new:  # nothing failed: the plan stands, and everybody read what it needs
            return [set() for _ in range(count)]
        if self.read_by is None:  # what the first plan had each process read
            senders = by_sender(self.sends)
            self.read_by = [
                {k for k in need if k in _held(self.views[p], self.s)}.union(
                    *senders.get(p, {}).values()
                )
                for p, need in enumerate(self.needs)
            ]
        for p, key, why in new:
            self.bad[(p, key)] = BadCopy(p, key.leaf, to_text(key.box), why)
        self.sends = plan_sends(self.s, self.views, self.holders, self.needs, self.bad)
        senders = by_sender(self.sends)
        unread = [set().union(*senders.get(p, {}).values()) - self.read_by[p] for p in range(count)]
        for p, more in enumerate(unread):
            self.read_by[p] |= more
        return unread

    def record_holders(self) -> dict[int, int]:
        """{saved process: the lowest holder whose copy has its per-process record}."""
        holder: dict[int, int] = {}
        for p in self.holders:
            for q in self.views[p].steps[self.s].per_process:
                holder.setdefault(q, p)
        return holder


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
