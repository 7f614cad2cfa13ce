"""Saving one local step of the emergency tier (for :class:`EmergencyCheckpointManager`).

On the calling thread only what cannot wait (:meth:`LocalSaver.start`): host snapshots of
every distinct shard this process holds (views on CPU) and the dispatch of the peer copies,
device to device, with this process's per-process record beside them. The writer thread
(:meth:`LocalSaver.finish`) waits for what the peers send, describes the leaves from their metadata and
writes the step (:func:`local.write_step`). The restore side is
:mod:`jaxckpt._src.emergency.restore`.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from .. import multihost, writer
from .. import per_process as pp
from .. import tree as tree_lib
from ..boxes import Index, whole
from ..monitoring import Stopwatch
from ..records import PY_TYPES, check_alive, check_numpy, leaf_records, unsupported
from ..sharding import layout
from ..staging import HostCopies
from ..storage import Location
from . import local, wire
from .peers import PeerCopies, send_rows, send_shards
from .planner import SliceKey


@dataclass
class Pending:
    """A local step between :meth:`LocalSaver.start` and :meth:`LocalSaver.finish`."""

    named: list[tuple[tree_lib.PathJson, str, Any]]  # the tree (``tree.flatten_named``)
    key_data: dict[int, jax.Array]  # PRNG keys' data, by leaf position
    slices: local.Slices
    writers: local.Writers  # the process that held each slice when saved
    doc: Callable[..., local.LocalStep]  # local.LocalStep, less what ``finish`` works out
    records: dict[int, pp.Record]  # per-process records kept with the step
    senders: list[int]  # the processes whose peer copies this one receives
    peers: PeerCopies | None = None  # peer copies in flight to this process
    records_tag: str = ""  # where the senders' records are left for this process


class LocalSaver:
    """Saves local steps into ``directory`` (step numbers ``digits`` wide), keeping the host
    buffers they reuse from one save to the next; every wait is bounded by ``timeout_s``."""

    def __init__(
        self,
        directory: Location,
        timeout_s: float,
        digits: int,
        drop_page_cache: bool = False,
        direct_io: bool = False,
    ) -> None:
        self.directory, self.timeout_s, self.digits = directory, timeout_s, digits
        self.drop_page_cache, self.direct_io = drop_page_cache, direct_io
        self.host = HostCopies()  # snapshots of NumPy leaves and accelerator shards
        self.received: PeerCopies | None = None  # the last peer copies: they receive the next
        self.pack_buffer: np.ndarray | None = None  # the packed peer-exchange row

    def start(
        self,
        step: int,
        state: Any,
        record: pp.Record | None,
        *,
        shifts: tuple[int, ...],
        hosts: list[str],
        tag: Callable[[str], str],
        fig: Stopwatch,
    ) -> Pending:
        """Snapshots ``state`` and dispatches its peer copies to ``p + j`` for each shift;
        ``tag`` names key-value exchanges (the same on every process)."""
        named = tree_lib.flatten_named(state)
        slices, required, on_devices, key_data = self._snapshot(named)
        pid, count = multihost.process_index(), multihost.process_count()
        senders = [(pid - j) % count for j in shifts]
        doc = functools.partial(
            local.LocalStep,
            step=step,
            process_index=pid,
            process_count=count,
            required=required,
            replication=len(shifts),
            hosts=hosts,
            sends_to=[(pid + j) % count for j in shifts],
            receives_from=senders,
        )
        records = {} if record is None else {pid: record}
        out = Pending(named, key_data, slices, dict.fromkeys(slices, pid), doc, records, senders)
        if shifts:
            with fig.phase("peer_exchange"):
                # each receiver gets this process's record (or nothing): a few hundred bytes
                # through the key-value store, taken by its writer thread
                out.records_tag = tag("per_process")
                text = "" if record is None else json.dumps(record.to_json())
                for j in shifts:
                    multihost.send_text(out.records_tag, (pid + j) % count, text)
                # the last peer copies receive these; reused again once ``finish`` collected
                # them (a cancelled save's may still be in flight when the next one starts)
                out.peers, as_rows = send_shards(on_devices, shifts, reuse=self.received)
                self.received = None
                if as_rows:  # the same leaves on every process
                    self._exchange_rows(set(as_rows), out, shifts, tag("peers"))
        return out

    def finish(self, pending: Pending, fig: Stopwatch, write: bool = True) -> None:
        """Takes what the peers sent (their shards and records) and writes the step (unless
        ``write`` is False: a step already committed here is not written again).

        A cancel of the writer's job (``writer.current``) stops the wait for the peers'
        records; the transfers are still collected (every process dispatched them), and the
        step is written only if the cancel came after the write began."""
        p, cancel = pending, writer.current()
        if p.peers is not None:  # the senders' records, then their shards
            with fig.phase("peer_wait"):
                try:
                    for q in p.senders:
                        check = cancel.check if cancel is not None else None
                        text = multihost.receive_text(p.records_tag, q, self.timeout_s, check)
                        if text:
                            where = f"process {q}"
                            p.records[q] = pp.Record.from_json(json.loads(text), where=where)
                finally:
                    _keep_new(p, *p.peers.collect())  # waits for the transfers
                    self.received = p.peers
        if not write:
            return
        if cancel is not None:
            cancel.claim()
        with fig.phase("write"):
            records, meshes = leaf_records(p.named, p.key_data)
            doc = p.doc(
                digest=local.tree_digest(records),
                meshes=meshes,
                leaves=tuple(records),
                held=p.writers,
                per_process={str(q): r.to_json() for q, r in sorted(p.records.items())},
            )
            local.write_step(
                self.directory,
                doc,
                p.slices,
                self.digits,
                drop_page_cache=self.drop_page_cache,
                direct_io=self.direct_io,
            )
            fig.bytes = sum(v.nbytes for v in p.slices.values())

    def _exchange_rows(
        self, names: set[str], out: Pending, shifts: tuple[int, ...], name: str
    ) -> None:
        """Peer copies of the leaves ``send_shards`` cannot move: packed into one byte row
        per process, exchanged and unpacked here (blocking)."""
        mine = {key: v for key, v in out.slices.items() if key.leaf in names}
        row = wire.pack(mine, out.writers, reuse=self.pack_buffer)  # (all this process's)
        if self.pack_buffer is None or row.size > self.pack_buffer.size:
            self.pack_buffer = row  # a new, bigger (aligned) buffer: keep it for next time
        count = multihost.process_count()
        rounds = [tuple((p, (p + j) % count) for p in range(count)) for j in shifts]
        for got in send_rows(row, rounds, name=name, timeout_s=self.timeout_s):
            _keep_new(out, *wire.unpack(got))

    def _snapshot(
        self, named: list[tuple[tree_lib.PathJson, str, Any]]
    ) -> tuple[local.Slices, dict[str, list[Index]], dict[str, jax.Array], dict[int, jax.Array]]:
        """Host snapshots of every distinct shard this process holds; every slice of every
        array leaf (``local.json``'s ``slices``); the device arrays for the peer copies; PRNG
        keys' data. Unsupported leaves raise here, before anything is written."""
        snaps: dict[SliceKey, Callable[[], np.ndarray]] = {}
        required: dict[str, list[Index]] = {}
        on_devices: dict[str, jax.Array] = {}
        key_data: dict[int, jax.Array] = {}
        for i, (_, name, leaf) in enumerate(named):
            if type(leaf) in PY_TYPES:
                continue  # kept in the record
            if isinstance(leaf, (np.ndarray, np.generic)):
                host = np.asarray(leaf)
                check_numpy(host, name)
                if host.size:  # copied: NumPy arrays can change after save returns
                    key = SliceKey(name, whole(host.shape))
                    snaps[key] = self.host.snapshot(key, host, host.dtype.newbyteorder("="))
                    required[name] = [key.box]
                continue
            if not isinstance(leaf, jax.Array):
                raise unsupported(leaf, name)
            check_alive(leaf, name)
            arr = leaf
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
                arr = key_data[i] = jax.random.key_data(leaf)
            shape = tuple(arr.shape)
            if not math.prod(shape):
                continue
            on_devices[name] = arr
            every, held = _slice_keys(name, arr.sharding, shape)
            required[name] = every
            for k, key in held:  # one device per index
                snaps[key] = self.host.snapshot(key, arr.addressable_data(k))
        self.host.run_copies()  # all D2H copies were started above
        slices: local.Slices = {key: get() for key, get in snaps.items()}
        return slices, required, on_devices, key_data


@functools.lru_cache(maxsize=4096)
def _slice_keys(
    name: str, sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[list[Index], tuple[tuple[int, SliceKey], ...]]:
    """Every slice index of leaf ``name`` and, for each distinct one this process holds,
    its device's position and key: cached, as a training loop saves the same leaves on
    the same shardings each time (the list is shared: read it, never change it)."""
    lay = layout(sharding, shape)
    return list(lay.indices), tuple((k, SliceKey(name, index)) for k, index in lay.held_at)


def _keep_new(p: Pending, slices: local.Slices, writers: local.Writers) -> None:
    """Adds the peer copies in ``slices`` that ``p`` lacks (with their writers)."""
    for key, data in slices.items():
        if key not in p.slices:
            p.slices[key], p.writers[key] = data, writers[key]
