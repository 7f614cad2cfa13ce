"""Restoring one step from the copies in the processes' local directories (all processes).

Each process reads (and CRC-checks) the held slices anybody needs; a failed copy counts as
missing and the step is re-planned without it. Slices a process needs and lacks are sent
to it alone by the lowest verified holder: one ``ppermute`` of packed rows per shift
``(receiver - sender) % count`` the plan uses, each sender packing only its receiver's slices.
Slices are placed by global index, never by device id, so renumbered processes or a
different process count work when the copies cover every slice.

Who sends what is planned in :mod:`jaxckpt._src.emergency.planner`, leaves are cut out of
the slices at hand in :mod:`jaxckpt._src.emergency.recovery`; which step to restore is chosen
by :class:`jaxckpt.EmergencyCheckpointManager`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import Mesh

from .. import leaf_plan, multihost, steps
from .. import per_process as pp
from ..boxes import extent, from_text, to_text
from ..leaf_plan import Want
from ..monitoring import Stopwatch
from ..storage import Location
from . import local, wire
from .local import Copies, LocalStep, Slices
from .peers import send_rows
from .planner import (
    Bad,
    BadCopy,
    Holdings,
    Moves,
    PeerSlice,
    SliceKey,
    StepHolding,
    StepUnusable,
    keys_from_json,
    keys_to_json,
    plan_sends,
    sent_by,
    shift_rounds,
)
from .recovery import RecoveryReport, assemble, mappable, needed_slices

Needs = list[list[SliceKey]]  # per process: the saved slices it must have
Rows = dict[int, tuple[np.ndarray, Slices]]  # receiver -> a packed row, its slices' views
Moved = dict[SliceKey, tuple[int, int]]  # slice -> (holder, writer), for slices moved here


@dataclass(frozen=True)
class Request:
    """One emergency restore: what every step it tries is restored with."""

    directory: Location  # this process's local directory
    views: list[Holdings]  # what each process published it holds (``publish_holdings``)
    target: Any  # as in :func:`jaxckpt.restore`
    mesh: Mesh | None
    tag: str  # names the key-value exchanges (the same on every process)
    timeout_s: float
    fig: Stopwatch  # gets the phases' times: plan, read, move, place


def publish_holdings(
    directory: Location, remote_steps: list[int], *, tag: str, timeout_s: float, digits: int = 8
) -> tuple[dict[int, local.LocalStep], list[Holdings]]:
    """Reads this process's committed local steps and publishes what it holds of each (and
    ``remote_steps``) through the key-value store; every process calls it.

    Returns ({step: this process's copy}, every process's :class:`Holdings`).
    """
    mine = {
        s: ls
        for s in steps.committed(directory)
        if (ls := local.read_step(directory, s, digits)) is not None
    }
    published = Holdings(
        tuple(remote_steps),
        {
            s: StepHolding(
                ls.digest,
                {n: len(keys) for n, keys in ls.required.items()},
                frozenset(ls.held),
                tuple(sorted(int(q) for q in ls.per_process)),
            )
            for s, ls in mine.items()
        },
    )
    gathered = multihost.all_gather(f"{tag}/held", published.to_json(), timeout_s)
    return mine, [Holdings.from_json(text) for text in gathered]


def restore_step(
    req: Request, s: int, mine: LocalStep | None
) -> tuple[Any, RecoveryReport, tuple[pp.Record | None, ...]]:
    """Restores step ``s`` from the processes' local copies; every process calls it, with
    ``mine`` its own copy of ``s`` (None: it has none).

    The phases: agree on the step's ``local.json``; gather what each process needs; plan who
    sends what; read and verify (re-planning around failed copies); move what each process
    lacks; assemble the leaves; gather the per-process records. Returns the state, its
    report (its ``bad_copies``: those that failed on the way, from any process; ``rejected``
    is left to the caller) and every saved process's per-process record (None: it kept
    none). Raises :class:`StepUnusable` (with the bad copies) when the step cannot be
    assembled after all.
    """
    at = _Step(req, s, mine, [p for p, v in enumerate(req.views) if s in v.steps])
    doc = _agree_on_doc(at)
    wants = leaf_plan.wants(doc.leaves, doc.meshes, req.target, req.mesh, req.directory)
    needs = _gather_needs(at, wants, doc)
    needed = set(needs[at.pid])
    maps = {
        k: n
        for w in wants
        for k, n in mappable(w, needed_slices(w, doc.required.get(w.record.name, []))).items()
    }
    first = plan_sends(s, req.views, at.holders, needs, {})  # if no copy fails, the usual case
    rows = _rows_to_read_into(at, first, needed, doc)
    req.fig.lap("plan")
    data, copies, sends, bad = _read_verified(at, needs, first, rows, maps)
    req.fig.lap("read")
    moved = _move(at, needed, sends, first, rows, data)
    req.fig.lap("move")
    values = [assemble(w, doc.required.get(w.record.name, []), data, copies) for w in wants]
    records, records_from = _gather_records(at, doc.process_count)
    req.fig.lap("place")
    report = RecoveryReport(
        "local",
        s,
        multihost.process_count(),
        doc.process_count,
        from_peers=_from_peers(at, needed, moved),
        bad_copies=tuple(bad.values()),
        per_process_from=records_from,
    )
    return leaf_plan.result(req.target, wants, values), report, records


@dataclass(frozen=True)
class _Step:
    """The step being restored, as each phase of ``restore_step`` sees it."""

    req: Request
    s: int
    mine: LocalStep | None  # this process's copy (None: it has none)
    holders: list[int]  # the processes holding a copy, lowest first
    pid: int = field(default_factory=multihost.process_index)  # this process

    def name(self, what: str) -> str:
        """The name of one of this step's exchanges (the same on every process)."""
        return f"{self.req.tag}/{self.s}/{what}"

    def gather(self, what: str, value: Any) -> list[Any]:
        """Every process's ``value`` (JSON), in process order: one key-value round."""
        texts = multihost.all_gather(self.name(what), json.dumps(value), self.req.timeout_s)
        return [json.loads(text) for text in texts]


def _agree_on_doc(at: _Step) -> LocalStep:
    """The step's ``local.json`` as its lowest holder has it, sent to every process."""
    elected = at.holders[0]
    mine = at.mine if at.pid == elected else None
    doc = at.gather("doc", None if mine is None else mine.to_json())[elected]
    return mine or LocalStep.from_json(doc, where=f"process {elected}'s step {at.s}")


def _gather_needs(at: _Step, wants: list[Want], doc: LocalStep) -> Needs:
    """The saved slices each process must have to build its part of ``wants``."""
    mine = [
        SliceKey(w.record.name, box)
        for w in wants
        for box in needed_slices(w, doc.required.get(w.record.name, []))
    ]
    return [keys_from_json(theirs) for theirs in at.gather("needs", keys_to_json(mine))]


def _rows_to_read_into(at: _Step, first: Moves, needed: set[SliceKey], doc: LocalStep) -> Rows:
    """The packed rows for the receivers that this process, under the first plan, sends
    only slices it sends to nobody else and does not need: those are read straight into
    the row, which then moves without another copy.
    """
    if at.mine is None:
        return {}
    mine_first = {r: keys for (a, r), keys in first.items() if a == at.pid}
    times = Counter(key for keys in mine_first.values() for key in keys)
    dtypes = {r.name: r.storage_dtype for r in doc.leaves}
    held = at.mine.held
    return {
        r: wire.pack_layout({k: (dtypes[k.leaf], extent(k.box), held[k]) for k in sorted(keys)})
        for r, keys in sorted(mine_first.items())
        if all(times[k] == 1 for k in keys) and not needed.intersection(keys)
    }


def _read_verified(
    at: _Step, needs: Needs, first: Moves, rows: Rows, maps: dict[SliceKey, int]
) -> tuple[Slices, Copies, Moves, Bad]:
    """Reads (and CRC-checks) the held slices this process needs and those it sends.

    A copy failing re-plans without it, and a new sender reads in another round. Every
    process computes the same plan from the same published facts, so all run the same
    number of rounds. Senders under the ``first`` plan read what they send in the first
    round, into ``rows`` where there is one; slices of ``maps`` may become mappings
    (``local.read_slices``). Returns (the slices read that the final plan uses, the
    replicas mapped of those, the final plan, the failed copies of every process).
    """
    views, pid = at.req.views, at.pid
    read_by = [
        {k for k in need if views[p].holds(at.s, k)} | sent_by(first, p)
        for p, need in enumerate(needs)
    ]
    to_read = set(read_by[pid])
    into = {key: v for _, row_views in rows.values() for key, v in row_views.items()}
    data: Slices = {}
    copies: Copies = {}
    bad: Bad = {}
    for round_ in range(len(views) + 2):
        got, got_copies, failed = (
            local.read_slices(at.mine, to_read, into, maps) if at.mine and to_read else ({}, {}, [])
        )
        data.update(got)
        copies.update(got_copies)
        failed_json = [[key.leaf, to_text(key.box), why] for key, why in failed]
        for p, theirs in enumerate(at.gather(f"bad{round_}", failed_json)):
            for leaf, index, why in theirs:
                bad[(p, SliceKey(leaf, from_text(index)))] = BadCopy(p, leaf, index, why)
        sends = plan_sends(at.s, views, at.holders, needs, bad)
        unread = [sent_by(sends, p) - read_by[p] for p in range(len(views))]
        if not any(unread):
            break
        to_read = unread[pid]
        for p, more in enumerate(unread):
            read_by[p] |= more
    else:
        raise StepUnusable("copies kept failing verification", tuple(bad.values()))
    used = set(needs[pid]) | sent_by(sends, pid)  # not what a plan a failed copy changed read
    kept = {k: v for k, v in data.items() if k in used}
    return kept, {k: v for k, v in copies.items() if k in used}, sends, bad


def _move(
    at: _Step, needed: set[SliceKey], sends: Moves, first: Moves, rows: Rows, data: Slices
) -> Moved:
    """Sends each receiver only the slices the plan gives it, one ``ppermute`` round per
    shift ``(receiver - sender) % count`` in use (the same rounds on every process), so a
    process holds at most the row it sends and the row it receives of one round (and the
    slices it read to send). ``rows``: rows already read into, used when the plan for
    their receiver is still the first one. Received slices go into ``data``; returns
    {slice: (holder, writer)} for them.
    """
    pid, count = at.pid, multihost.process_count()
    writers = at.mine.held if at.mine else {}
    rounds = shift_rounds(sends, count)
    # slices read only to send: dropped after the last round that sends them
    last = {
        k: r for r, (j, _) in enumerate(rounds) for k in sends.get((pid, (pid + j) % count), ())
    }
    moved: Moved = {}
    for r, (j, pairs) in enumerate(rounds):
        dst = (pid + j) % count
        keys = sorted(sends.get((pid, dst), ()))
        if keys and dst in rows and sends[(pid, dst)] == first.get((pid, dst)):
            row = rows.pop(dst)[0]  # read into already
        else:
            row = wire.pack({k: data[k] for k in keys}, writers)  # no keys: not sent, unread
        (got,) = send_rows(row, [pairs], name=at.name(f"move{j}"), timeout_s=at.req.timeout_s)
        del row
        for key, at_round in last.items():
            if at_round == r and key not in needed:
                del data[key]
        got_slices, got_writers = wire.unpack(got)
        for key, value in got_slices.items():
            if key in needed:
                data[key] = value
                moved[key] = ((pid - j) % count, got_writers[key])
    rows.clear()  # rows of a plan that a failed copy changed
    return moved


def _from_peers(at: _Step, needed: set[SliceKey], moved: Moved) -> tuple[PeerSlice, ...]:
    """The slices this process used that it did not write itself: those ``moved`` to it,
    and the peer copies on its own disk."""
    writers = at.mine.held if at.mine else {}
    own = at.mine.process_index if at.mine else None
    on_disk = {k: (at.pid, writers[k]) for k in needed if writers.get(k, own) != own}
    used = {**on_disk, **moved}  # moved here wins over read here
    return tuple(sorted(PeerSlice(k.leaf, to_text(k.box), *hw) for k, hw in used.items()))


def _gather_records(at: _Step, saved_count: int) -> tuple[tuple[pp.Record | None, ...], int | None]:
    """Every saved process's per-process record of the step, each sent by the lowest
    process holding a copy of it (its own, or one a peer sent it), and which process sent
    this process's own record. No round when nobody holds one."""
    holder: dict[int, int] = {}
    for p in at.holders:
        for q in at.req.views[p].steps[at.s].per_process:
            holder.setdefault(q, p)
    records: list[pp.Record | None] = [None] * saved_count
    if holder:
        per_process = at.mine.per_process if at.mine else {}
        mine = {q: per_process[str(q)] for q, p in holder.items() if p == at.pid}
        for p, theirs in enumerate(at.gather("per_process", mine)):
            for q, doc in theirs.items():
                if int(q) < saved_count:
                    records[int(q)] = pp.Record.from_json(doc, where=f"process {p}'s copy")
    return tuple(records), holder.get(at.pid)
