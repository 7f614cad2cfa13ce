"""``EmergencyCheckpointManager``: frequent saves to each host's local disk, rare remote ones.

Local tier (every ``local_interval_steps``): each process writes every distinct shard it
holds to its own ``local_directory`` (see :mod:`jaxckpt.local`); with ``replication=k`` it
also sends them to processes ``p+1 .. p+k`` (mod the process count) through a JAX
collective (``ppermute``, device to device, see :mod:`jaxckpt.peers`), which store them too.
``save`` only starts the transfer; the writer thread waits for it. No cross-host filesystem
traffic, no barrier: each process commits its own copy.

Remote tier (every ``remote_interval_steps``): a normal checkpoint through an inner
:class:`CheckpointManager`.

Restore: processes publish what they hold through the ``jax.distributed`` key-value store and
take the newest step whose every slice is held by somebody, unless the remote tier has a newer
one. Each process reads (and CRC-checks) the held slices anybody needs; a failed copy counts
as missing and the step is re-planned without it. Slices a process needs and lacks are sent
to it alone by the lowest verified holder: one ``ppermute`` of packed rows per shift
``(receiver - sender) % count`` the plan uses, each sender packing only its receiver's slices.
Slices are placed by global index, never by device id, so renumbered processes or a
different process count work when the copies cover every slice.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from . import local, multihost
from . import tree as tree_lib
from .checkpoint import _want_saved, _want_target
from .errors import CheckpointError, CheckpointNotFoundError
from .manager import CheckpointManager
from .manifest import LeafRecord
from .options import Options, OptionsError
from .peers import PeerCopies, exchange_rows, send_rows, send_shards
from .recovery import (
    SavedMeshes,
    StepUnusable,
    assemble,
    needed_slices,
    plan_sends,
    read_held,
    sent_by,
    shift_rounds,
    uncovered,
    verified,
)
from .sharding import Index, normalize_index
from .staging import describe
from .storage import location
from .writer import Writer

log = logging.getLogger("jaxckpt")

_seq = itertools.count()  # names of key-value exchanges (main thread only)
_EMPTY = np.zeros(0, np.uint8)


@dataclass(frozen=True)
class EmergencyOptions:
    """Policies of an :class:`EmergencyCheckpointManager`.

    local_interval_steps / remote_interval_steps: save to that tier when ``step`` is a
        multiple (``force=True`` saves both tiers).
    local_max_to_keep / remote_max_to_keep: committed steps kept per tier (None: all).
    replication: how many other processes keep a copy of each process's local shards.
    async_save: ``save`` returns after the device->host copy, with the peer copies in flight.
    timeout_s: bound on every cross-process wait. compression: remote tier only.
    """

    local_interval_steps: int = 10
    remote_interval_steps: int = 1000
    local_max_to_keep: int | None = 2
    remote_max_to_keep: int | None = 3
    replication: int = 0
    async_save: bool = True
    timeout_s: float = 600.0
    compression: str | None = None

    def __post_init__(self) -> None:
        for name in ("local_interval_steps", "remote_interval_steps"):
            if getattr(self, name) < 1:
                raise OptionsError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("local_max_to_keep", "remote_max_to_keep"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise OptionsError(f"{name} must be >= 1 or None, got {value}")
        if self.replication < 0:
            raise OptionsError(f"replication must be >= 0, got {self.replication}")

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> EmergencyOptions:
        """Reads a TOML option file (see ``configs/emergency_gpu.toml``)."""
        import tomllib

        with open(path, "rb") as f:
            try:
                doc = tomllib.load(f)
            except tomllib.TOMLDecodeError as e:
                raise OptionsError(f"{os.fspath(path)}: not valid TOML: {e}") from e
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(doc) - fields)
        if unknown:
            raise OptionsError(f"{os.fspath(path)}: unknown option(s) {unknown}")
        return cls(**{**doc, **overrides})


@dataclass(frozen=True)
class RecoveryReport:
    """What the last ``restore`` used (this process's view; tier and step agree everywhere).

    from_peers: (leaf, index, holder, writer) for each slice this process used that it did not
        read from a copy it wrote itself: ``holder`` is the process that read it from its
        local directory (this one, for a peer copy on its own disk), ``writer`` the process
        that held it at save time.
    rejected: (step, why) for each newer step that was not used.
    bad_copies: (process, leaf, index, why) for local copies that failed to read / verify.
    """

    tier: str
    step: int
    process_count: int
    saved_process_count: int | None = None
    from_peers: tuple[tuple[str, str, int, int], ...] = ()
    rejected: tuple[tuple[int, str], ...] = ()
    bad_copies: tuple[tuple[int, str, str, str], ...] = ()


class EmergencyCheckpointManager:
    """Two-tier checkpoints for jobs that lose hosts.

    >>> opts = jaxckpt.EmergencyOptions(local_interval_steps=10, remote_interval_steps=500,
    ...                                 replication=1)
    >>> with jaxckpt.EmergencyCheckpointManager("/local_nvme/ckpt", "s3://b/run", opts) as m:
    ...     if m.latest_step() is not None:
    ...         state = m.restore(target=abstract_state)   # m.last_report says from where
    ...     for step in range(start, n):
    ...         state = train_step(state)
    ...         m.save(step, state)

    ``local_directory`` is this host's own disk (RAM disk or NVMe); ``remote_directory`` is
    shared (filesystem, ``s3://``, ``gs://``). Every process calls ``save`` and ``restore``
    with the same steps.
    """

    def __init__(
        self,
        local_directory: str | os.PathLike,
        remote_directory: str | os.PathLike,
        options: EmergencyOptions | None = None,
    ):
        self.options = opts = options or EmergencyOptions()
        self.local_directory = location(local_directory)
        if not self.local_directory.is_local:
            raise CheckpointError(
                f"local_directory must be a local path, got {self.local_directory.url}"
            )
        self.local_directory.makedirs()
        local.cleanup(self.local_directory)
        self._remote = CheckpointManager(
            remote_directory,
            Options(
                max_to_keep=opts.remote_max_to_keep,
                async_save=opts.async_save,
                timeout_s=opts.timeout_s,
                compression=opts.compression,
            ),
        )
        self.last_report: RecoveryReport | None = None
        self._local_steps = set(local.committed_steps(self.local_directory))
        self._host: dict[tuple, np.ndarray] = {}
        self._writer = Writer("jaxckpt-local", self.options.timeout_s)
        self._pack_buffer: np.ndarray | None = None  # the peer-exchange row, reused across saves
        self._received: PeerCopies | None = None  # the last peer copies: their CPU buffers
        # receive the next ones
        self._closed = False
        self.timings: dict[str, float] = {}

    @property
    def remote(self) -> CheckpointManager:
        return self._remote

    # --- listing -------------------------------------------------------------------------

    def local_steps(self) -> list[int]:
        """Steps committed in this process's local directory."""
        return sorted(self._local_steps)

    def all_steps(self) -> list[int]:
        """Steps this process can see: its local ones and the remote ones (oldest first).

        Which step ``restore`` uses is decided with the other processes.
        """
        return sorted(self._local_steps | set(self._remote.all_steps()))

    def latest_step(self) -> int | None:
        return max(self.all_steps(), default=None)

    def reached_preemption(self, step: int) -> bool:
        return multihost.reached_preemption(step)

    # --- save ----------------------------------------------------------------------------

    def should_save(self, step: int) -> tuple[bool, bool]:
        """(local, remote): which tiers the interval policy asks for at ``step``."""
        o = self.options
        return step % o.local_interval_steps == 0, step % o.remote_interval_steps == 0

    def save(self, step: int, state: Any, *, force: bool = False, metrics: dict | None = None):
        """Saves ``state`` to the tiers whose interval ``step`` hits; False when none.

        Every process must call it with the same steps (the peer exchange is a collective).
        """
        self._check_open()
        self._writer.raise_error()
        do_local, do_remote = self.should_save(step)
        do_local, do_remote = do_local or force, do_remote or force
        if do_remote and step not in self._remote.all_steps():
            t = time.perf_counter()
            self._remote.save(step, state, metrics=metrics, force=True)
            self.timings["remote_blocking_s"] = time.perf_counter() - t
        if do_local:
            t = time.perf_counter()
            self._save_local(step, state)
            self.timings["local_blocking_s"] = time.perf_counter() - t
        return do_local or do_remote

    def _tag(self, what: str) -> str:
        # the same on every process: every process makes the same save/restore calls, in order
        return f"jaxckpt/emergency/{what}/{next(_seq)}"

    def _save_local(self, step: int, state: Any) -> None:
        self._wait_local()  # host buffers are reused
        staged = describe(state)  # records only; nothing copied
        records = [leaf.record for leaf in staged.leaves]
        slices, required, on_devices = self._stage(state, records)
        pid, count = multihost.process_index(), multihost.process_count()
        origins = dict.fromkeys(slices, pid)
        k = min(self.options.replication, count - 1)
        extra = {
            "process_index": pid,
            "process_count": count,
            "replication": k,
            "sends_to": [(pid + j) % count for j in range(1, k + 1)],
            "receives_from": [(pid - j) % count for j in range(1, k + 1)],
            "slices": required,
        }
        peers = None
        if k:
            t = time.perf_counter()
            peers, as_rows = send_shards(on_devices, tuple(range(1, k + 1)), reuse=self._received)
            self._received = peers
            if as_rows:  # the same leaves on every process
                self._exchange_rows(set(as_rows), slices, origins, k)
            self.timings["peer_exchange_s"] = time.perf_counter() - t
        job = (step, records, staged.meshes, slices, origins, extra, peers)
        what = f"saving local step {step} to {self.local_directory.url}"
        if self.options.async_save:
            self._writer.submit(what, self._write, *job)
        else:
            self._writer.run_now(what, self._write, *job)

    def _exchange_rows(self, names: set[str], slices, origins, k: int) -> None:
        """Peer copies of the leaves ``send_shards`` cannot move: packed into one byte row
        per process, exchanged and unpacked here (blocking)."""
        pid = multihost.process_index()
        mine = {key: v for key, v in slices.items() if key[0] in names}
        row = local.pack(mine, dict.fromkeys(mine, pid), reuse=self._pack_buffer)
        if self._pack_buffer is None or row.size > self._pack_buffer.size:
            self._pack_buffer = row  # a new, bigger (aligned) buffer: keep it for next time
        rows = exchange_rows(
            row, shifts=range(1, k + 1), name=self._tag("peers"), timeout_s=self.options.timeout_s
        )
        for got in rows:
            peer_slices, peer_origins = local.unpack(got)
            for key, data in peer_slices.items():
                if key not in slices:
                    slices[key], origins[key] = data, peer_origins[key]

    def _stage(self, state: Any, records: list[LeafRecord]):
        """Host snapshots of every distinct shard this process holds, each leaf's slices, and
        the device arrays (by leaf name) for the peer copies.

        NumPy leaves and accelerator shards are copied into reused buffers; CPU device
        buffers are taken as zero-copy views.
        """
        slices: local.Slices = {}
        required: dict[str, list[str]] = {}
        on_devices: dict[str, jax.Array] = {}
        pending = []
        for (_, leaf), rec in zip(tree_lib.flatten(state), records, strict=True):
            if not rec.has_array or not math.prod(rec.shape):
                continue
            if rec.kind == "numpy":
                arr = np.asarray(leaf)
                index = tuple((0, d) for d in arr.shape)
                required[rec.name] = [local.index_key(index)]
                pending.append(((rec.name, index), arr))
                continue
            arr = leaf if rec.kind == "array" else jax.random.key_data(leaf)
            shape = tuple(arr.shape)
            every = {
                normalize_index(i, shape) for i in arr.sharding.devices_indices_map(shape).values()
            }
            required[rec.name] = [local.index_key(i) for i in sorted(every)]
            on_devices[rec.name] = arr
            seen: set[Index] = set()
            for shard in arr.addressable_shards:
                index = normalize_index(shard.index, shape)
                if index in seen:
                    continue
                seen.add(index)
                if shard.data.platform() != "cpu":
                    shard.data.copy_to_host_async()
                pending.append(((rec.name, index), shard.data))
        for key, src in pending:  # all D2H copies were started above
            if isinstance(src, jax.Array) and src.platform() == "cpu":
                # Host memory already: a view is a snapshot (see staging._shard_getter).
                slices[key] = np.asarray(src)
                continue
            buf = self._host.get(key)
            if buf is None or buf.shape != tuple(src.shape) or buf.dtype != src.dtype:
                buf = self._host[key] = np.empty(tuple(src.shape), src.dtype)
            np.copyto(buf, np.asarray(src), casting="no")
            slices[key] = buf
        return slices, required, on_devices

    def _write(self, step, records, meshes, slices, origins, extra, peers) -> None:
        if peers is not None:
            t = time.perf_counter()
            got, got_origins = peers.collect()  # waits for the transfers
            for key, data in got.items():
                if key not in slices:
                    slices[key], origins[key] = data, got_origins[key]
            self.timings["peer_wait_s"] = time.perf_counter() - t
        if step not in self._local_steps:
            t = time.perf_counter()
            local.write_step(self.local_directory, step, records, meshes, slices, origins, extra)
            self.timings["local_write_s"] = time.perf_counter() - t
            self._local_steps.add(step)
        keep = self.options.local_max_to_keep
        if keep is not None:
            for old in sorted(self._local_steps)[:-keep]:
                local.delete_step(self.local_directory, old)
                self._local_steps.discard(old)

    def wait_until_finished(self) -> None:
        """Blocks until both tiers' writes in flight are committed; raises their errors."""
        self._wait_local()
        self.remote.wait_until_finished()

    def _wait_local(self) -> None:
        self._writer.wait(self.local_directory.url)

    # --- restore -------------------------------------------------------------------------

    def restore(
        self, step: int | None = None, target: Any = None, *, mesh: Mesh | None = None
    ) -> Any:
        """Restores the newest step every process can assemble (or ``step``); see the module.

        ``target`` / ``mesh`` work as in :func:`jaxckpt.restore`. The report is in
        ``last_report``. Every process must call it.
        """
        self.wait_until_finished()
        self._remote.wait_until_finished()
        self._remote.reload()
        # The host copies of the state being replaced are of no further use; freeing them
        # before reading lets the restore's buffers reuse that memory (the next save stages
        # into fresh buffers).
        self._host.clear()
        self._pack_buffer = self._received = None
        timeout = self.options.timeout_s
        tag = self._tag("restore")
        mine = {
            s: ls
            for s in local.committed_steps(self.local_directory)
            if (ls := local.read_step(self.local_directory, s)) is not None
        }
        published = {
            "remote": self._remote.all_steps(),
            "steps": {
                str(s): {
                    "digest": ls.digest,
                    "need": {n: len(keys) for n, keys in ls.doc["slices"].items()},
                    "held": {n: sorted(h) for n, h in ls.held().items()},
                }
                for s, ls in mine.items()
            },
        }
        views = [
            json.loads(v)
            for v in multihost.all_gather(f"{tag}/held", json.dumps(published), timeout)
        ]
        remote_steps = views[0]["remote"]
        newest_remote = max(remote_steps, default=None)
        steps = sorted({int(s) for v in views for s in v["steps"]}, reverse=True)
        if step is not None:
            steps = [s for s in steps if s == step]
        rejected: list[tuple[int, str]] = []
        bad_all: list[tuple[int, str, str, str]] = []
        for s in steps:
            if step is None and newest_remote is not None and newest_remote > s:
                rejected.append((s, f"the remote tier has a newer step {newest_remote}"))
                break
            why = uncovered(s, views)
            if why:
                rejected.append((s, why))
                continue
            try:
                return self._restore_local(
                    tag, s, views, mine.get(s), target, mesh, rejected, bad_all
                )
            except StepUnusable as e:
                rejected.append((s, str(e)))
        chosen = step if step is not None else newest_remote
        if chosen is None or chosen not in remote_steps:
            raise CheckpointNotFoundError(
                f"no step to restore{f' (asked for {step})' if step is not None else ''}: no "
                f"local step is complete on the {len(views)} processes ({rejected or 'none'}) "
                f"and the remote tier {self._remote.directory.url} has {remote_steps}"
            )
        out = self._remote.restore(chosen, target, mesh=mesh)
        self.last_report = RecoveryReport(
            "remote",
            chosen,
            multihost.process_count(),
            None,
            rejected=tuple(rejected),
            bad_copies=tuple(bad_all),
        )
        log.info("jaxckpt: restored %s", self.last_report)
        return out

    def _rows_to_read_into(self, first, my_needs, mine, by_name) -> dict:
        """{receiver: packed row, its slices' views} for the receivers that this process,
        under the first plan, sends only slices it sends to nobody else and does not need:
        those are read straight into the row, which then moves without another copy.
        """
        pid = multihost.process_index()
        mine_first = {r: keys for (a, r), keys in first.items() if a == pid}
        times: dict[tuple[str, str], int] = {}
        for keys in mine_first.values():
            for key in keys:
                times[key] = times.get(key, 0) + 1
        rows = {}
        for r, keys in sorted(mine_first.items()):
            parsed = sorted((n, local.parse_index(k)) for n, k in keys)
            if mine is None or any(times[k] > 1 for k in keys) or my_needs.intersection(parsed):
                continue
            held = mine.held()
            rows[r] = local.pack_layout(
                {
                    (n, i): (
                        local.stored_dtype(by_name[n]),
                        tuple(b - a for a, b in i),
                        held[n][local.index_key(i)],
                    )
                    for n, i in parsed
                }
            )
        return rows

    def _move(self, tag, sends, data, origins_mine, my_needs, first, rows) -> dict:
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
        last: dict[tuple[str, Index], int] = {}
        for r, (j, _) in enumerate(rounds):
            for n, k in sends.get((pid, (pid + j) % count), ()):
                last[(n, local.parse_index(k))] = r
        used_from: dict[tuple[str, Index], tuple[int, int]] = {}
        for r, (j, pairs) in enumerate(rounds):
            dst = (pid + j) % count
            keys = sorted((n, local.parse_index(k)) for n, k in sends.get((pid, dst), ()))
            if keys and dst in rows and sends[(pid, dst)] == first.get((pid, dst)):
                row = rows.pop(dst)[0]  # read into already
            else:
                out = {key: data[key] for key in keys}
                row = local.pack(out, {key: origins_mine[key] for key in out}) if out else _EMPTY
                del out
            got = send_rows(row, pairs, name=f"{tag}/move{j}", timeout_s=self.options.timeout_s)
            del row
            for key, at in last.items():
                if at == r and key not in my_needs:
                    del data[key]
            if got is None:
                continue
            sender = (pid - j) % count
            got_slices, got_origins = local.unpack(got)
            for key, value in got_slices.items():
                if key in my_needs:
                    data[key] = value
                    used_from[key] = (sender, got_origins[key])
        rows.clear()  # rows of a plan that a failed copy changed
        return used_from

    def _restore_local(self, tag, s, views, mine, target, mesh, rejected, bad_all) -> Any:
        timeout = self.options.timeout_s
        pid = multihost.process_index()
        tag = f"{tag}/{s}"
        t0 = time.perf_counter()
        holders = [p for p, v in enumerate(views) if str(s) in v["steps"]]
        elected = holders[0]
        docs = multihost.all_gather(
            f"{tag}/doc", json.dumps(mine.doc) if pid == elected else "", timeout
        )
        doc = json.loads(docs[elected])
        records = [LeafRecord(**r) for r in doc["leaves"]]
        by_name = {r.name: r for r in records}
        meshes = SavedMeshes(doc["meshes"])
        if target is None:
            wants = [_want_saved(r, meshes, mesh) for r in records]
        else:
            flat = tree_lib.flatten(target)
            wants = [_want_target(p, t, by_name, self.local_directory) for p, t in flat]
        required = {n: [local.parse_index(k) for k in keys] for n, keys in doc["slices"].items()}
        needs = {w.record.name: needed_slices(w, required.get(w.record.name, [])) for w in wants}
        needs = {n: [local.index_key(i) for i in idx] for n, idx in needs.items() if idx}
        all_needs = [
            json.loads(v) for v in multihost.all_gather(f"{tag}/needs", json.dumps(needs), timeout)
        ]
        # Each process reads (and CRC-checks) the held slices it needs and those it sends; the
        # lowest process with a verified copy sends each slice somebody lacks. A copy failing
        # re-plans, and a new sender reads in another round. Every process computes the same
        # plan from the same published facts, so all run the same number of rounds.
        read_by = [
            {(n, k) for n, keys in need.items() for k in keys if verified(views[p], s, n, k)}
            for p, need in enumerate(all_needs)
        ]
        # The plan with no failed copies (the usual case) is known now: senders read what
        # they send in the same round as what they need.
        first = plan_sends(s, views, holders, all_needs, set(), [])
        for p in range(len(views)):
            read_by[p] |= sent_by(first, p)
        to_read = set(read_by[pid])
        my_needs = {(n, local.parse_index(k)) for n, keys in needs.items() for k in keys}
        rows = self._rows_to_read_into(first, my_needs, mine, by_name)
        into = {key: v for _, views in rows.values() for key, v in views.items()}
        data: local.Slices = {}
        bad_set: set[tuple[int, str, str]] = set()
        self.timings["restore_plan_s"] = time.perf_counter() - t0
        for round_ in range(len(views) + 2):
            got, bad = ({}, []) if mine is None or not to_read else read_held(mine, to_read, into)
            data.update(got)
            gathered = multihost.all_gather(f"{tag}/bad{round_}", json.dumps(bad), timeout)
            for p, text in enumerate(gathered):
                for name, key, why in json.loads(text):
                    bad_set.add((p, name, key))
                    bad_all.append((p, name, key, why))
            sends = plan_sends(s, views, holders, all_needs, bad_set, bad_all)
            unread = [sent_by(sends, p) - read_by[p] for p in range(len(views))]
            if not any(unread):
                break
            to_read = unread[pid]
            for p, more in enumerate(unread):
                read_by[p] |= more
        else:
            raise StepUnusable("copies kept failing verification")
        self.timings["restore_read_s"] = time.perf_counter() - t0
        origins_mine = {
            (name, local.parse_index(k)): w
            for name, h in (mine.held() if mine else {}).items()
            for k, w in h.items()
        }
        del into
        sending = {(n, local.parse_index(k)) for n, k in sent_by(sends, pid)}
        for key in [k for k in data if k not in my_needs and k not in sending]:
            del data[key]  # read for a plan that a failed copy changed
        used_from = self._move(tag, sends, data, origins_mine, my_needs, first, rows)
        own_pid = mine.doc["process_index"] if mine else None
        for name, keys in needs.items():
            for k in keys:
                key = (name, local.parse_index(k))
                if key not in used_from and origins_mine.get(key, own_pid) != own_pid:
                    used_from[key] = (pid, origins_mine[key])
        self.timings["restore_move_s"] = time.perf_counter() - t0
        values = [assemble(w, required.get(w.record.name, []), data) for w in wants]
        if target is None:
            result = tree_lib.unflatten_paths(
                [(w.record.path, v) for w, v in zip(wants, values, strict=True)]
            )
        else:
            result = tree_lib.unflatten_like(target, values)
        self.timings["restore_place_s"] = time.perf_counter() - t0
        self.last_report = RecoveryReport(
            "local",
            s,
            multihost.process_count(),
            doc.get("process_count"),
            from_peers=tuple(
                sorted((n, local.index_key(i), h, w) for (n, i), (h, w) in used_from.items())
            ),
            rejected=tuple(rejected),
            bad_copies=tuple(bad_all),
        )
        log.info("jaxckpt: restored %s", self.last_report)
        return result

    # --- lifetime ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError(f"the emergency manager of {self.local_directory.url} is closed")

    def close(self) -> None:
        """Finishes both tiers' saves in flight and stops the writer threads."""
        if self._closed:
            return
        self._closed = True
        try:
            self._writer.close(self.local_directory.url)
        finally:
            self._remote.close()

    def __enter__(self) -> EmergencyCheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
