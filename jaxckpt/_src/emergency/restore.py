"""Restoring one step from the copies in the processes' local directories (all processes).

Each process reads (and CRC-checks) the held slices anybody needs; a failed copy counts as
missing and the step is re-planned without it. Slices a process needs and lacks are sent
to it alone by the lowest verified holder: one ``ppermute`` of packed rows per shift
``(receiver - sender) % count`` the plan uses, each sender packing only its receiver's slices.
Slices are placed by global index, never by device id, so renumbered processes or a
different process count work when the copies cover every slice.

Who sends what is planned in :mod:`jaxckpt._src.emergency.recovery`; which step to restore is chosen by
:class:`jaxckpt.EmergencyCheckpointManager`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax.sharding import Mesh

from .. import multihost, restoring, steps
from .. import per_process as pp
from ..boxes import extent, from_text, to_text
from ..monitoring import Figures
from ..storage import Location
from . import local, wire
from .peers import send_rows
from .planner import (
    Bad,
    BadCopy,
    Holdings,
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
from .recovery import assemble, needed_slices

_EMPTY = np.zeros(0, np.uint8)


@dataclass(frozen=True)
class Restored:
    """What ``restore_step`` built: the state, and where its slices came from.

    from_peers: as in :class:`jaxckpt.RecoveryReport`.
    """

    state: Any
    saved_process_count: int | None
    from_peers: tuple[PeerSlice, ...]
    bad_copies: tuple[BadCopy, ...]  # copies that failed on the way, from any process
    per_process: tuple[pp.Record | None, ...] = ()  # every saved process's record
    per_process_from: int | None = None  # the process whose copy gave this one's record


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
    directory: Location,
    s: int,
    views: list[Holdings],
    mine: local.LocalStep | None,
    target: Any,
    mesh: Mesh | None,
    *,
    tag: str,
    timeout_s: float,
    fig: Figures,
) -> Restored:
    """Restores step ``s`` from the processes' local copies; every process calls it.

    ``views``: what each process published it holds; ``mine``: this process's copy of ``s``
    in ``directory`` (None: it has none). ``tag`` names the key-value exchanges (the same on
    every process); ``fig`` gets the phases' times (plan, read, move, place). Returns the
    state with where its slices came from and the copies that failed to verify. Raises
    :class:`StepUnusable` (with the bad copies) when the step cannot be assembled after all.
    """
    pid = multihost.process_index()
    tag = f"{tag}/{s}"
    holders = [p for p, v in enumerate(views) if s in v.steps]
    elected = holders[0]
    docs = multihost.all_gather(
        f"{tag}/doc", json.dumps(mine.to_json()) if pid == elected else "", timeout_s
    )
    doc = local.LocalStep.from_json(
        json.loads(docs[elected]), where=f"process {elected}'s step {s}"
    )
    by_name = {r.name: r for r in doc.leaves}
    wants = restoring.wants(doc.leaves, doc.meshes, target, mesh, directory)
    required = doc.required
    needs = [
        SliceKey(w.record.name, i)
        for w in wants
        for i in needed_slices(w, required.get(w.record.name, []))
    ]
    all_needs = [
        keys_from_json(json.loads(v))
        for v in multihost.all_gather(f"{tag}/needs", json.dumps(keys_to_json(needs)), timeout_s)
    ]
    my_needs = set(needs)
    # Each process reads (and CRC-checks) the held slices it needs and those it sends; the
    # lowest process with a verified copy sends each slice somebody lacks. A copy failing
    # re-plans, and a new sender reads in another round. Every process computes the same
    # plan from the same published facts, so all run the same number of rounds.
    read_by = [{k for k in need if views[p].holds(s, k)} for p, need in enumerate(all_needs)]
    # The plan with no failed copies (the usual case) is known now: senders read what
    # they send in the same round as what they need.
    first = plan_sends(s, views, holders, all_needs, {})
    for p in range(len(views)):
        read_by[p] |= sent_by(first, p)
    to_read = set(read_by[pid])
    rows = _rows_to_read_into(first, my_needs, mine, by_name)
    into = {key: v for _, views in rows.values() for key, v in views.items()}
    data: local.Slices = {}
    bad: Bad = {}
    fig.lap("plan")
    for round_ in range(len(views) + 2):
        got, failed = (
            ({}, []) if mine is None or not to_read else local.read_slices(mine, to_read, into)
        )
        data.update(got)
        failed_json = [[k.leaf, to_text(k.box), why] for k, why in failed]
        gathered = multihost.all_gather(f"{tag}/bad{round_}", json.dumps(failed_json), timeout_s)
        for p, text in enumerate(gathered):
            for name, key, why in json.loads(text):
                bad[(p, SliceKey(name, from_text(key)))] = BadCopy(p, name, key, why)
        sends = plan_sends(s, views, holders, all_needs, bad)
        unread = [sent_by(sends, p) - read_by[p] for p in range(len(views))]
        if not any(unread):
            break
        to_read = unread[pid]
        for p, more in enumerate(unread):
            read_by[p] |= more
    else:
        raise StepUnusable("copies kept failing verification", tuple(bad.values()))
    fig.lap("read")
    origins_mine = mine.held if mine else {}
    del into
    sending = sent_by(sends, pid)
    for key in [k for k in data if k not in my_needs and k not in sending]:
        del data[key]  # read for a plan that a failed copy changed
    used_from = _move(tag, sends, data, origins_mine, my_needs, first, rows, timeout_s)
    own_pid = mine.process_index if mine else None
    for key in my_needs:
        if key not in used_from and origins_mine.get(key, own_pid) != own_pid:
            used_from[key] = (pid, origins_mine[key])
    fig.lap("move")
    values = [assemble(w, required.get(w.record.name, []), data) for w in wants]
    records, records_from = _gather_records(s, views, mine, doc.process_count, tag, timeout_s)
    fig.lap("place")
    return Restored(
        restoring.result(target, wants, values),
        doc.process_count,
        tuple(sorted(PeerSlice(n, to_text(i), h, w) for (n, i), (h, w) in used_from.items())),
        tuple(bad.values()),
        records,
        records_from,
    )


def _gather_records(s, views, mine, saved_count, tag, timeout_s):
    """Every saved process's per-process record of step ``s``, each sent by the lowest
    process holding a copy of it (its own, or one a peer sent it), and which process sent
    this process's own record. No round when nobody holds one."""
    holder: dict[int, int] = {}
    for p, view in enumerate(views):
        entry = view.steps.get(s)
        for q in entry.per_process if entry else ():
            holder.setdefault(q, p)
    records: list[pp.Record | None] = [None] * saved_count
    pid = multihost.process_index()
    if holder:
        mine_to_send = {q: mine.per_process[str(q)] for q, p in holder.items() if p == pid}
        gathered = multihost.all_gather(f"{tag}/per_process", json.dumps(mine_to_send), timeout_s)
        for p, text in enumerate(gathered):
            for q, doc in json.loads(text).items():
                if int(q) < saved_count:
                    records[int(q)] = pp.Record.from_json(doc, where=f"process {p}'s copy")
    return tuple(records), holder.get(pid)


def _rows_to_read_into(first, my_needs, mine, by_name) -> dict:
    """{receiver: packed row, its slices' views} for the receivers that this process,
    under the first plan, sends only slices it sends to nobody else and does not need:
    those are read straight into the row, which then moves without another copy.
    """
    pid = multihost.process_index()
    mine_first = {r: keys for (a, r), keys in first.items() if a == pid}
    times: dict[SliceKey, int] = {}
    for keys in mine_first.values():
        for key in keys:
            times[key] = times.get(key, 0) + 1
    rows = {}
    for r, keys in sorted(mine_first.items()):
        if mine is None or any(times[k] > 1 for k in keys) or my_needs.intersection(keys):
            continue
        rows[r] = wire.pack_layout(
            {k: (by_name[k.leaf].storage_dtype, extent(k.box), mine.held[k]) for k in sorted(keys)}
        )
    return rows


def _move(tag, sends, data, origins_mine, my_needs, first, rows, timeout_s) -> dict:
    """Sends each receiver only the slices the plan gives it, one ``ppermute`` round per
    shift ``(receiver - sender) % count`` in use (the same rounds on every process), so a
    process holds at most the row it sends and the row it receives of one round (and the
    slices it read to send). ``rows``: rows already read into, used when the plan for
    their receiver is still the first one. Received slices go into ``data``; returns
    {slice: (holder, writer)} for them.
    """
    pid, count = multihost.process_index(), multihost.process_count()
    rounds = shift_rounds(sends, count)
    # slices read only to send: dropped after the last round that sends them
    last: dict[SliceKey, int] = {}
    for r, (j, _) in enumerate(rounds):
        for k in sends.get((pid, (pid + j) % count), ()):
            last[k] = r
    used_from: dict[SliceKey, tuple[int, int]] = {}
    for r, (j, pairs) in enumerate(rounds):
        dst = (pid + j) % count
        keys = sorted(sends.get((pid, dst), ()))
        if keys and dst in rows and sends[(pid, dst)] == first.get((pid, dst)):
            row = rows.pop(dst)[0]  # read into already
        else:
            out = {key: data[key] for key in keys}
            row = wire.pack(out, {key: origins_mine[key] for key in out}) if out else _EMPTY
            del out
        (got,) = send_rows(row, [pairs], name=f"{tag}/move{j}", timeout_s=timeout_s)
        del row
        for key, at in last.items():
            if at == r and key not in my_needs:
                del data[key]
        if got is None:
            continue
        sender = (pid - j) % count
        got_slices, got_origins = wire.unpack(got)
        for key, value in got_slices.items():
            if key in my_needs:
                data[key] = value
                used_from[key] = (sender, got_origins[key])
    rows.clear()  # rows of a plan that a failed copy changed
    return used_from
