"""Restoring one step from the copies in the processes' local directories (all processes).

Each process reads (and CRC-checks) the held slices anybody needs; a failed copy counts as
missing and the step is re-planned without it. Process 0 plans: it alone gathers what every
process holds and needs, and tells each process its own part (what to read, whom to send
what) and the ``ppermute`` rounds, so the key-value traffic grows with the processes, not
with their square (every process used to gather everything). Slices a process needs and lacks are sent
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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import Mesh

from ...errors import CoordinationError
from .. import gc_pause, leaf_plan, multihost, ring, steps
from .. import per_process as pp
from ..boxes import extent, from_text, to_text
from ..io import direct
from ..io.inflight import default_budget
from ..monitoring import Stopwatch
from ..storage import Location
from . import local, wire
from .local import Copies, LocalStep, Slices
from .peers import send_rows
from .planner import (
    BadCopy,
    Holdings,
    PeerSlice,
    Rejected,
    SliceKey,
    StepHolding,
    StepPlan,
    StepUnusable,
    by_sender,
    candidates,
    keys_from_json,
    keys_to_json,
    shift_rounds,
)
from .recovery import RecoveryReport, assemble, mappable, needed_slices

Rows = dict[int, tuple[np.ndarray, Slices]]  # receiver -> a packed row, its slices' views
Moved = dict[SliceKey, tuple[int, int]]  # slice -> (holder, writer), for slices moved here
Sends = dict[int, set[SliceKey]]  # this process's part of a plan: receiver -> the slices
Rounds = list[tuple[int, tuple[tuple[int, int], ...]]]  # ``shift_rounds``, on every process


@dataclass(frozen=True)
class Published:
    """What ``share_holdings`` tells every process: the local steps worth trying (newest
    first), those rejected and why, the remote tier's steps and the process count.
    ``views``, every process's :class:`Holdings`, only process 0 keeps: it plans."""

    tries: tuple[int, ...]
    rejected: tuple[Rejected, ...]
    remote: tuple[int, ...]
    count: int
    views: tuple[Holdings, ...] | None = None


@dataclass(frozen=True)
class Request:
    """One emergency restore: what every step it tries is restored with."""

    directory: Location  # this process's local directory
    published: Published  # what ``publish_holdings`` returned
    target: Any  # as in :func:`jaxckpt.restore`
    mesh: Mesh | None
    tag: str  # names the key-value exchanges (the same on every process)
    timeout_s: float
    fig: Stopwatch  # gets the phases' times: plan, read, move, place


def publish_holdings(
    directory: Location,
    remote_steps: list[int],
    *,
    tag: str,
    timeout_s: float,
    digits: int = 8,
    step: int | None = None,
) -> tuple[dict[int, local.LocalStep], Published]:
    """Reads this process's committed local steps and publishes what it holds of each (and
    ``remote_steps``) to process 0, which chooses the steps to try (``step``: that one
    only, as ``candidates``); every process calls it.

    Returns ({step: this process's copy}, :class:`Published`).
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
    return mine, share_holdings(published, tag=tag, timeout_s=timeout_s, step=step)


def share_holdings(
    held: Holdings, *, tag: str, timeout_s: float, step: int | None = None
) -> Published:
    """``held`` (this process's) to process 0, which keeps every process's and publishes
    the steps to try: one round, O(processes) key-value traffic."""
    views: list[Holdings] = []

    def decide(texts: list[str]) -> str:
        with gc_pause.paused():  # (N processes' slice keys: collections would walk them all)
            views.extend(Holdings.from_json(t) for t in texts)
            tries, rejected = candidates(views, step)
        return json.dumps({"tries": tries, "rejected": rejected, "remote": views[0].remote})

    doc = json.loads(multihost.decided(f"{tag}/held", held.to_json(), _safe(decide), timeout_s))
    _raise_error(doc)
    return Published(
        tuple(doc["tries"]),
        tuple(Rejected(s, why) for s, why in doc["rejected"]),
        tuple(doc["remote"]),
        multihost.process_count(),
        tuple(views) if views else None,
    )


def restore_step(
    req: Request, s: int, mine: LocalStep | None
) -> tuple[Any, RecoveryReport, tuple[pp.Record | None, ...]]:
    """Restores step ``s`` from the processes' local copies; every process calls it, with
    ``mine`` its own copy of ``s`` (None: it has none).

    The phases: the step's ``local.json`` (its lowest holder's, sent to the processes
    without a copy); what each process needs, to process 0, which plans who sends what;
    read and verify (re-planning around failed copies); move what each process lacks;
    assemble the leaves; gather the per-process records. Returns the state, its report
    (its ``bad_copies``: those that failed on the way, from any process; ``rejected`` is
    left to the caller) and every saved process's per-process record (None: it kept none).
    Raises :class:`StepUnusable` (with the bad copies) when the step cannot be assembled
    after all.
    """
    at = _Step(req, s, mine)
    doc = _agree_on_doc(at)
    wants = leaf_plan.wants(doc.leaves, doc.meshes, req.target, req.mesh, req.directory)
    need = [
        SliceKey(w.record.name, box)
        for w in wants
        for box in needed_slices(w, doc.required.get(w.record.name, []))
    ]
    needed = set(need)
    maps = {
        k: n
        for w in wants
        for k, n in mappable(w, needed_slices(w, doc.required.get(w.record.name, []))).items()
    }
    first = _first_plan(at, need)  # if no copy fails, the usual case
    rows = _rows_to_read_into(at, first, needed, doc)
    req.fig.lap("plan")
    data, copies, final, bad = _read_verified(at, need, first, rows, maps)
    req.fig.lap("read")
    moved = _move(at, needed, final, first, rows, data)
    req.fig.lap("move")
    devices = {d for w in wants if w.sharding is not None for d in w.sharding.device_set}
    with ring.for_restore(default_budget(direct.reader_threads()), devices) as host:
        values = [
            assemble(w, doc.required.get(w.record.name, []), data, copies, host) for w in wants
        ]
    records, records_from = _gather_records(at, final, doc.process_count)
    req.fig.lap("place")
    report = RecoveryReport(
        "local",
        s,
        multihost.process_count(),
        doc.process_count,
        from_peers=_from_peers(at, needed, moved),
        bad_copies=bad,
        per_process_from=records_from,
    )
    return leaf_plan.result(req.target, wants, values), report, records


@dataclass
class _Step:
    """The step being restored, as each phase of ``restore_step`` sees it; ``plan``:
    process 0's :class:`StepPlan`, once it made one."""

    req: Request
    s: int
    mine: LocalStep | None  # this process's copy (None: it has none)
    pid: int = field(default_factory=lambda: multihost.process_index())  # this process
    plan: StepPlan | None = None

    def name(self, what: str) -> str:
        """The name of one of this step's exchanges (the same on every process)."""
        return f"{self.req.tag}/{self.s}/{what}"

    def gather(self, what: str, value: Any) -> list[Any]:
        """Every process's ``value`` (JSON), in process order: one key-value round."""
        texts = multihost.all_gather(self.name(what), json.dumps(value), self.req.timeout_s)
        return [json.loads(text) for text in texts]

    def views(self) -> tuple[Holdings, ...]:
        """Every process's holdings (process 0 only)."""
        views = self.req.published.views
        if views is None:
            raise AssertionError("only process 0 keeps the holdings (a bug: please report it)")
        return views

    def round(
        self, what: str, value: Any, decide: Callable[[list[Any]], tuple[dict, list[Any]]]
    ) -> tuple[dict, Any]:
        """One round through process 0: every process's ``value`` (JSON) goes to process 0,
        which ``decide``s a part every process reads and a part for each process alone
        (left under its own key, read once and deleted): O(processes) keys and bytes.
        Returns (the common part, this process's part). StepUnusable on process 0 is
        raised on every process."""
        name = self.name(what)
        own: list[str] = []

        def on_first(texts: list[str]) -> str:
            common, parts = decide([json.loads(t) for t in texts])
            for q, part in enumerate(parts):
                if q == 0:
                    own.append(json.dumps(part))
                else:
                    multihost.send_text(name, q, json.dumps(part))
            return json.dumps(common)

        text = multihost.decided(name, json.dumps(value), _safe(on_first), self.req.timeout_s)
        common = json.loads(text)
        _raise_error(common)
        if self.pid == 0:
            return common, json.loads(own[0])
        return common, json.loads(multihost.receive_text(name, 0, self.req.timeout_s))


def _safe(decide: Callable[[list[str]], str]) -> Callable[[list[str]], str]:
    """``decide`` on process 0, its failure made a decision (the others would wait for
    nothing): StepUnusable as such, anything else as an error every process raises."""

    def run(texts: list[str]) -> str:
        try:
            return decide(texts)
        except StepUnusable as e:
            return json.dumps({"unusable": str(e), "bad": [list(b) for b in e.bad_copies]})
        except Exception as e:  # a bug: every process fails with it, none waits
            return json.dumps({"error": f"process 0 failed to plan: {e!r}"})

    return run


def _raise_error(common: dict) -> None:
    if "unusable" in common:
        raise StepUnusable(common["unusable"], tuple(BadCopy(*b) for b in common["bad"]))
    if "error" in common:
        raise CoordinationError(common["error"])


def _agree_on_doc(at: _Step) -> LocalStep:
    """The step's ``local.json``: this process's own, or (without a copy) its lowest
    holder's, which process 0 names (``_elect``) and which sends it to those processes
    alone."""
    common, send_to = at.round("doc", None, _elect(at))
    elected = common["elected"]
    if at.pid == elected and at.mine is not None:
        text = json.dumps(at.mine.to_json())
        for q in send_to:
            multihost.send_text(at.name("doc/text"), q, text)
    if at.mine is not None:
        return at.mine
    text = multihost.receive_text(at.name("doc/text"), elected, at.req.timeout_s)
    return LocalStep.from_json(json.loads(text), where=f"process {elected}'s step {at.s}")


def _elect(at: _Step) -> Callable[[list[Any]], tuple[dict, list[Any]]]:
    """Process 0's choice of the process whose ``local.json`` the others use (the lowest
    holder), told to every process; the holder alone is told who has no copy."""

    def decide(_: list[Any]) -> tuple[dict, list[Any]]:
        views = at.views()
        holders = [p for p, v in enumerate(views) if at.s in v.steps]
        parts: list[Any] = [[] for _ in views]
        parts[holders[0]] = [p for p, v in enumerate(views) if at.s not in v.steps]
        return {"elected": holders[0]}, parts

    return decide


def _first_plan(at: _Step, need: list[SliceKey]) -> Sends:
    """What each process needs, to process 0, which plans who sends what; returns this
    process's part of the first plan (every copy assumed good)."""

    def decide(needs: list[Any]) -> tuple[dict, list[Any]]:
        at.plan = StepPlan.start(at.s, at.views(), [keys_from_json(n) for n in needs])
        senders = by_sender(at.plan.sends)
        return {}, [_sends_to_json(senders.get(p, {})) for p in range(len(needs))]

    _, part = at.round("needs", keys_to_json(need), decide)
    return _sends_from_json(part)


def _sends_to_json(sends: Sends) -> dict[str, dict[str, list[str]]]:
    return {str(r): keys_to_json(sorted(keys)) for r, keys in sends.items()}


def _sends_from_json(doc: dict[str, dict[str, list[str]]]) -> Sends:
    return {int(r): set(keys_from_json(keys)) for r, keys in doc.items()}


def _rows_to_read_into(at: _Step, first: Sends, needed: set[SliceKey], doc: LocalStep) -> Rows:
    """The packed rows for the receivers that this process, under the first plan, sends
    only slices it sends to nobody else and does not need: those are read straight into
    the row, which then moves without another copy.
    """
    if at.mine is None:
        return {}
    times = Counter(key for keys in first.values() for key in keys)
    dtypes = {r.name: r.storage_dtype for r in doc.leaves}
    held = at.mine.held
    return {
        r: wire.pack_layout({k: (dtypes[k.leaf], extent(k.box), held[k]) for k in sorted(keys)})
        for r, keys in sorted(first.items())
        if all(times[k] == 1 for k in keys) and not needed.intersection(keys)
    }


@dataclass(frozen=True)
class _Final:
    """This process's part of the final plan: what it sends to whom, the rounds (the same
    on every process), and the per-process records it sends (and who sends its own)."""

    sends: Sends
    rounds: Rounds
    records: list[int]
    records_any: bool
    records_from: int | None


def _read_verified(
    at: _Step, need: list[SliceKey], first: Sends, rows: Rows, maps: dict[SliceKey, int]
) -> tuple[Slices, Copies, _Final, tuple[BadCopy, ...]]:
    """Reads (and CRC-checks) the held slices this process needs and those it sends.

    A copy failing re-plans without it (process 0, ``StepPlan.replan``), and a new sender
    reads in another round; every process runs the same number of rounds. Senders under the
    ``first`` plan read what they send in the first round, into ``rows`` where there is
    one; slices of ``maps`` may become mappings (``local.read_slices``). Returns (the
    slices read that the final plan uses, the replicas mapped of those, this process's
    part of the final plan, the failed copies of every process).
    """
    held = at.mine.held if at.mine else {}
    to_read = {k for k in need if k in held}.union(*first.values())
    into = {key: v for _, row_views in rows.values() for key, v in row_views.items()}
    data: Slices = {}
    copies: Copies = {}
    bad: list[list[Any]] = []  # the failed copies so far, as process 0 tells them
    for round_ in range(multihost.process_count() + 2):
        got, got_copies, failed = (
            local.read_slices(at.mine, to_read, into, maps) if at.mine and to_read else ({}, {}, [])
        )
        data.update(got)
        copies.update(got_copies)
        failed_json = [[key.leaf, to_text(key.box), why] for key, why in failed]
        common, part = at.round(f"bad{round_}", failed_json, _replan(at))
        bad = common["bad"]
        if common["done"]:
            break
        to_read = set(keys_from_json(part))
    else:
        raise StepUnusable("copies kept failing verification", tuple(BadCopy(*b) for b in bad))
    final = _Final(
        _sends_from_json(part["sends"]),
        [(j, tuple((a, b) for a, b in pairs)) for j, pairs in common["rounds"]],
        part["records"],
        common["records"],
        part["records_from"],
    )
    used = set(need).union(*final.sends.values())  # not what a plan a failed copy changed read
    kept = {k: v for k, v in data.items() if k in used}
    failed_copies = tuple(BadCopy(*b) for b in bad)
    return kept, {k: v for k, v in copies.items() if k in used}, final, failed_copies


def _replan(at: _Step) -> Callable[[list[Any]], tuple[dict, list[Any]]]:
    """Process 0's decision after a read round: the plan without the copies that failed;
    more to read for some processes, or the final plan's parts and rounds."""

    def decide(failed: list[Any]) -> tuple[dict, list[Any]]:
        plan = at.plan
        if plan is None:
            raise AssertionError("no plan to revise (a bug: please report it)")
        reports = [[(SliceKey(leaf, from_text(i)), why) for leaf, i, why in f] for f in failed]
        unread = plan.replan(reports)
        bad = [list(b) for b in plan.bad.values()]
        if any(unread):
            return {"done": False, "bad": bad}, [keys_to_json(sorted(u)) for u in unread]
        senders = by_sender(plan.sends)
        holder = plan.record_holders()
        parts = [
            {
                "sends": _sends_to_json(senders.get(p, {})),
                "records": sorted(q for q, h in holder.items() if h == p),
                "records_from": holder.get(p),
            }
            for p in range(len(failed))
        ]
        rounds = shift_rounds(plan.sends, len(failed))
        return {"done": True, "bad": bad, "rounds": rounds, "records": bool(holder)}, parts

    return decide


def _move(
    at: _Step, needed: set[SliceKey], final: _Final, first: Sends, rows: Rows, data: Slices
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
    sends = final.sends
    # slices read only to send: dropped after the last round that sends them
    last = {k: r for r, (j, _) in enumerate(final.rounds) for k in sends.get((pid + j) % count, ())}
    moved: Moved = {}
    for r, (j, pairs) in enumerate(final.rounds):
        dst = (pid + j) % count
        keys = sorted(sends.get(dst, ()))
        if keys and dst in rows and sends[dst] == first.get(dst):
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


def _gather_records(
    at: _Step, final: _Final, saved_count: int
) -> tuple[tuple[pp.Record | None, ...], int | None]:
    """Every saved process's per-process record of the step, each sent by the lowest
    process holding a copy of it (its own, or one a peer sent it, as process 0 planned),
    and which process sent this process's own record. No round when nobody holds one;
    else every process gets every record (what ``per_process(all=True)`` returns)."""
    records: list[pp.Record | None] = [None] * saved_count
    if final.records_any:
        per_process = at.mine.per_process if at.mine else {}
        mine = {q: per_process[str(q)] for q in final.records}
        for p, theirs in enumerate(at.gather("per_process", mine)):
            for q, doc in theirs.items():
                if int(q) < saved_count:
                    records[int(q)] = pp.Record.from_json(doc, where=f"process {p}'s copy")
    return tuple(records), final.records_from
