"""The emergency restore's plan, as pure functions of what the processes published (no jax):
which step every slice of which some process holds, who sends which slice to whom, and in
which ``ppermute`` rounds. Every process computes the same plan from the same facts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class StepHolding:
    """What one process holds of one local step (published before a restore)."""

    digest: str  # of the step's tree: copies of different trees are never combined
    need: dict[str, int]  # leaf -> how many slices the step has
    held: dict[str, frozenset[str]]  # leaf -> index keys of the slices in this copy
    per_process: tuple[int, ...] = ()  # processes whose per-process records the copy has


@dataclass(frozen=True)
class Holdings:
    """What one process publishes before a restore: its local steps and the remote ones."""

    remote: tuple[int, ...]
    steps: dict[int, StepHolding]

    def holds(self, s: int, leaf: str, key: str) -> bool:
        """Whether this process's copy of step ``s`` has slice ``key`` of ``leaf``."""
        entry = self.steps.get(s)
        return entry is not None and key in entry.held.get(leaf, ())

    def to_json(self) -> str:
        steps = {
            s: {
                "digest": h.digest,
                "need": h.need,
                "held": {n: sorted(keys) for n, keys in h.held.items()},
                "per_process": h.per_process,
            }
            for s, h in self.steps.items()
        }
        return json.dumps({"remote": self.remote, "steps": steps})

    @classmethod
    def from_json(cls, text: str) -> Holdings:
        doc = json.loads(text)
        steps = {}
        for s, h in doc["steps"].items():
            held = {n: frozenset(keys) for n, keys in h["held"].items()}
            steps[int(s)] = StepHolding(h["digest"], h["need"], held, tuple(h["per_process"]))
        return cls(tuple(doc["remote"]), steps)


class PeerSlice(NamedTuple):
    """A slice this process used that it did not read from a copy it wrote itself."""

    leaf: str
    index: str  # the global index, "0:16,0:8"
    holder: int  # the process that read it from its local directory
    writer: int  # the process that held it at save time


class Rejected(NamedTuple):
    """A newer step that was not used, and why."""

    step: int
    why: str


class BadCopy(NamedTuple):
    """A local copy that failed to read or verify."""

    process: int
    leaf: str
    index: str
    why: str


class StepUnusable(Exception):
    """A local step cannot be assembled after verification; try the next one."""

    def __init__(self, why: str, bad_copies: tuple[BadCopy, ...] = ()):
        super().__init__(why)
        self.bad_copies = bad_copies


Moves = dict[tuple[int, int], set[tuple[str, str]]]


def plan_sends(
    s: int,
    views: list[Holdings],
    holders: list[int],
    all_needs: list[dict[str, list[str]]],
    bad_set: set[tuple[int, str, str]],
    bad_all: list[BadCopy],
) -> Moves:
    """Who sends what to whom: {(sender, receiver): {(leaf, index key)}}.

    For every slice a process needs and has no verified copy of, the lowest process holding
    a verified copy sends it. Every process computes the same plan from the same facts.
    """
    sends: Moves = {}
    for q, need in enumerate(all_needs):
        for name, keys in need.items():
            for key in keys:
                if views[q].holds(s, name, key) and (q, name, key) not in bad_set:
                    continue
                ok = [
                    p
                    for p in holders
                    if views[p].holds(s, name, key) and (p, name, key) not in bad_set
                ]
                if not ok:
                    raise StepUnusable(
                        f"no verified copy of {name}[{key}] is left (bad copies: "
                        f"{sorted(b[:3] for b in bad_all)})",
                        tuple(bad_all),
                    )
                sends.setdefault((ok[0], q), set()).add((name, key))
    return sends


def sent_by(sends: Moves, p: int) -> set[tuple[str, str]]:
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
    for name, count in entries[0].need.items():
        held = set().union(*(e.held.get(name, ()) for e in entries))
        if len(held) < count:
            return (
                f"{count - len(held)} of {count} slices of leaf {name!r} are held by none of "
                f"the {len(views)} processes"
            )
    return None


def candidates(views: list[Holdings], step: int | None = None) -> tuple[list[int], list[Rejected]]:
    """The local steps worth trying, newest first (every slice held somewhere), and the ones
    rejected before any read: not coverable, or older than the newest remote step (unless
    ``step`` asks for one)."""
    newest_remote = max(views[0].remote, default=None)
    steps = sorted({s for v in views for s in v.steps}, reverse=True)
    if step is not None:
        steps = [s for s in steps if s == step]
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
