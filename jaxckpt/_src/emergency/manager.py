"""``EmergencyCheckpointManager``: frequent saves to each host's local disk, rare remote ones.

Local tier (every ``local_interval_steps``): each process writes every distinct shard it
holds to its own ``local_directory`` (see :mod:`jaxckpt._src.emergency.local`); with
``replication=k`` it also sends them to k other processes ``p + j`` (mod the process count;
shifts ``j`` chosen once so that copies leave their host, ``peers.peer_shifts``; written in
``local.json``) through a JAX collective (``ppermute``, device to device, see
:mod:`jaxckpt._src.emergency.peers`), which store them too. ``save`` only starts the
transfer; the writer thread waits for it (both halves in :mod:`jaxckpt._src.emergency.save`).
No cross-host filesystem traffic, no barrier: each process commits its own copy.

Remote tier (every ``remote.save_interval_steps``): a normal checkpoint through an inner
:class:`CheckpointManager` made with ``EmergencyOptions.remote``.

Restore: processes publish what they hold through the ``jax.distributed`` key-value store and
take the newest step whose every slice is held by somebody, unless the remote tier has a newer
one; they assemble it from their local copies (see :mod:`jaxckpt._src.emergency.restore`), or
try the next older step when it proves unusable, and fall back to the remote tier. The
folder's README.md walks through both protocols.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import time
from typing import Any

import jax
from jax.sharding import Mesh

from ...errors import CheckpointError, CheckpointNotFoundError
from .. import gc_pause, lease, multihost, steps
from .. import per_process as pp
from ..goodput.cadence import Blocking, Cadence, start_run
from ..manager import CANCEL_TIMEOUT_S, CheckpointManager
from ..monitoring import Figures, Stopwatch
from ..options import EmergencyOptions, signal_numbers
from ..preemption import Watch, name_for
from ..storage import location
from ..writer import Writer
from . import restore as local_restore
from . import save as local_save
from .local import LocalStep
from .peers import peer_shifts
from .planner import BadCopy, Rejected, StepUnusable
from .recovery import RecoveryReport

log = logging.getLogger("jaxckpt")

_seq = itertools.count()  # names of key-value exchanges (main thread only)


class EmergencyCheckpointManager:
    """Two-tier checkpoints for jobs that lose hosts.

    >>> opts = jaxckpt.EmergencyOptions(local_interval_steps=10, replication=1,
    ...                                 remote=jaxckpt.Options(save_interval_steps=500))
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
    ) -> None:
        self.options = opts = options or EmergencyOptions()
        self.local_directory = location(local_directory)
        if not self.local_directory.is_local:
            raise CheckpointError(
                f"local_directory must be a local path, got {self.local_directory.url}"
            )
        self.local_directory.makedirs()
        # each process's own local directory gets its own writer's lease (lease.py)
        self._verdict = lease.for_job(
            self.local_directory,
            stale_s=opts.lease_stale_s,
            take_over=opts.take_over_lease,
            timeout_s=opts.timeout_s,
            per_process=True,
        )
        self._preemption: Watch | None = None
        try:
            self._start(remote_directory)
        except BaseException:
            self._verdict.release()
            raise

    def _start(self, remote_directory: str | os.PathLike) -> None:
        opts = self.options
        if not self._verdict.read_only:
            steps.clean_leftovers(self.local_directory, grace_s=opts.timeout_s)
        # the remote tier: its options as given, but this manager logs both tiers (and
        # watches for a preemption notice: the remote one's preemption fields go unused)
        self.remote = CheckpointManager(
            remote_directory, dataclasses.replace(opts.remote, run_log=False)
        )
        self._warn_if_remote_is_more_frequent()
        # the run log, in both tiers' directories (a replaced host keeps the remote one),
        # and each tier's save interval, fixed or chosen from measurement
        dirs = [self.local_directory, self.remote.directory]
        self._log, history = start_run(dirs, ["local", "remote"], opts.heartbeat_s, opts.run_log)
        self.remote.log_into(self._log, "remote")
        self._writer = Writer("jaxckpt-local", self.options.timeout_s)
        tier = functools.partial(
            Cadence, history=history, log=self._log, timeout_s=opts.timeout_s,
            where=self.remote.directory.url,
        )  # fmt: skip
        ro = self.remote.options
        self._cadences = (
            tier("local", opts.local_interval_steps, mtbf_hours=opts.mtbf_hours,
                 min_steps=opts.min_interval_steps, max_steps=opts.max_interval_steps,
                 writer=self._writer),
            tier("remote", ro.save_interval_steps, mtbf_hours=ro.mtbf_hours,
                 min_steps=ro.min_interval_steps, max_steps=ro.max_interval_steps,
                 writer=self.remote._writer),
        )  # fmt: skip
        self._reached: int | None = None  # the highest step given to save()
        self.last_report: RecoveryReport | None = None
        self._local_steps = set(steps.committed(self.local_directory))
        self._saver = self._local_saver()
        self._shifts: tuple[tuple[int, ...], list[str]] | None = None  # see _peer_shifts
        self._closed = self._failed = False
        self.last_save_figures: Figures | None = None  # the calling thread's part
        self.last_write_figures: Figures | None = None  # the local step's writer
        self.last_restore_figures: Figures | None = None
        # the step last restored, and its per-process records (one per saved process; local)
        self._restored: tuple[int, tuple[pp.Record | None, ...] | None] | None = None

    def _warn_if_remote_is_more_frequent(self) -> None:
        local, remote = self.options.local_interval_steps, self.options.remote.save_interval_steps
        fixed = not isinstance(local, str) and not isinstance(remote, str)  # not "auto" etc.
        if fixed and int(remote) < int(local):
            log.warning(
                "jaxckpt: the remote tier %s saves every %d steps, more often than the local "
                "tier's %d; set EmergencyOptions(remote=Options(save_interval_steps=...)) "
                "(an Options() alone saves at every step)",
                self.remote.directory.url,
                remote,
                local,
            )

    # --- listing -------------------------------------------------------------------------

    def local_steps(self) -> list[int]:
        """Steps committed in this process's local directory."""
        return sorted(self._local_steps)

    def all_steps(self) -> list[int]:
        """Steps this process can see: its local ones and the remote ones (oldest first).

        Which step ``restore`` uses is decided with the other processes.
        """
        return sorted(self._local_steps | set(self.remote.all_steps()))

    def latest_step(self) -> int | None:
        """The step ``restore`` would use, the same on every process (None: nothing to
        restore). A replaced host with an empty disk gets its peers' answer, so
        ``if mgr.latest_step() is not None: state = mgr.restore(target=state)`` is right on
        every process. With several processes it is one key-value round: every process
        must call it, as it must call ``restore``. (A copy that fails its checksums during
        ``restore`` can still send it to an older step.)"""
        self.wait_until_finished()
        if multihost.process_count() == 1:
            return max(self.all_steps(), default=None)
        self.remote.reload()
        _, views = self._publish_holdings(self._tag("latest"))
        return views.tries[0] if views.tries else max(views.remote, default=None)

    def _publish_holdings(
        self, tag: str, step: int | None = None
    ) -> tuple[dict[int, LocalStep], local_restore.Published]:
        """This process's local steps, and the steps to try, chosen by process 0 from every
        process's holdings (one key-value round)."""
        return local_restore.publish_holdings(
            self.local_directory,
            self.remote.all_steps(),
            tag=tag,
            timeout_s=self.options.timeout_s,
            digits=self.options.step_digits,
            step=step,
        )

    def reached_preemption(self, step: int) -> bool:
        """True at the step every process stops at after any process got a preemption
        notice; see :meth:`CheckpointManager.reached_preemption`. Then ``save(step, state,
        force=True)`` writes the local tier only (the fastest), a remote save in flight gets
        ``preemption_grace_s`` to finish before it is cancelled; ``wait_until_finished()``
        and exit 0."""
        if self._preemption is None:
            self._preemption = Watch(
                name_for(self.remote.directory),
                signal_numbers(self.options.preemption_signals),
                self.options.timeout_s,
            )
        return self._preemption.reached(step)

    # --- save ----------------------------------------------------------------------------

    def should_save(self, step: int) -> tuple[bool, bool]:
        """(local, remote): which tiers the interval policy asks for at ``step``."""
        local, remote = self._cadences
        return local.due(step), remote.due(step)

    def save(
        self,
        step: int,
        state: Any,
        *,
        per_process: Any = None,
        force: bool = False,
        metrics: dict | None = None,
    ) -> bool:
        """Saves ``state`` to the tiers whose interval ``step`` hits; False when none.

        Every process must call it with the same steps (the peer exchange is a collective).
        ``per_process``: this process's own value (its data iterator's ``get_state()``...),
        kept in both tiers and sent with the peer copies; see :meth:`per_process`.
        """
        if self._closed:
            raise CheckpointError(f"the emergency manager of {self.local_directory.url} is closed")
        self._verdict.check(self.local_directory.url)
        self._writer.raise_error()
        self._reached = max(step, self._reached or step)
        if self._log is not None:
            self._log.heartbeat(step)
        do_local, do_remote = self.should_save(step)
        do_local, do_remote = do_local or force, do_remote or force
        if force and self._preemption is not None and self._preemption.stopping:
            # the notice leaves seconds: the local tier only; a remote save in flight gets
            # the grace to finish, then is cancelled
            do_local, do_remote = True, False
            self.remote._make_way(self.options.preemption_grace_s)
        if not (do_local or do_remote):
            return False
        record = pp.encode(per_process, where=f"{self.local_directory.url} step {step}")
        fig = Stopwatch("emergency_save", self.local_directory.url)
        if do_remote and step not in self.remote.all_steps():
            with fig.phase("remote"):
                self.remote.save(step, state, metrics=metrics, per_process=record, force=True)
        if do_local:
            with fig.phase("local"):
                self._save_local(step, state, fig, record)
        self.last_save_figures = done = fig.done()
        dids = (do_local, do_remote)
        for cadence, tier, did in zip(self._cadences, ("local", "remote"), dids, strict=True):
            if did:
                cadence.saved(step, done.phases.get(tier, 0.0))
        return True

    def _local_saver(self) -> local_save.LocalSaver:
        """What writes the local steps, keeping the host buffers it reuses (through the page
        cache unless ``direct_io=True``: a restarted process reads its step back from it)."""
        o = self.options
        return local_save.LocalSaver(
            self.local_directory, o.timeout_s, o.step_digits, o.drop_page_cache,
            o.direct_io is True,
        )  # fmt: skip

    def _tag(self, what: str) -> str:
        # the same on every process: every process makes the same save/restore calls, in order
        return f"jaxckpt/emergency/{what}/{next(_seq)}"

    def _save_local(self, step: int, state: Any, fig: Stopwatch, record: pp.Record | None) -> None:
        """On the calling thread only snapshots and the peer copies' dispatch; the rest on
        the writer thread (see :mod:`jaxckpt._src.emergency.save`)."""
        since = time.perf_counter()
        self._writer.wait(self.local_directory.url)  # host buffers are reused
        shifts, hosts = self._peer_shifts()
        pending = self._saver.start(
            step, state, record, shifts=shifts, hosts=hosts, tag=self._tag, fig=fig
        )
        what = f"saving local step {step} to {self.local_directory.url}"
        if self.options.async_save:
            blocking = Blocking(since, time.perf_counter())
            self._writer.submit(what, self._write, step, pending, blocking)
        else:
            self._writer.run_now(what, self._write, step, pending, Blocking(since, None))

    def _peer_shifts(self) -> tuple[tuple[int, ...], list[str]]:
        """Where the peer copies go (see ``peers.peer_shifts``) and every process's host;
        agreed once, at the first save with ``replication``."""
        if self._shifts is None:
            count = multihost.process_count()
            k = min(self.options.replication, count - 1)
            hosts = [multihost.host_name()] * count
            if k:
                hosts = multihost.process_hosts(self.options.timeout_s)
            shifts, same = peer_shifts(hosts, k)
            if same and len(set(hosts)) > 1:
                log.warning(
                    "jaxckpt: with replication=%d, the peer copies of processes %s stay on "
                    "their own host (hosts: %s); losing that host loses them",
                    k,
                    same,
                    hosts,
                )
            self._shifts = (shifts, hosts)
        return self._shifts

    def _write(self, step: int, pending: local_save.Pending, blocking: Blocking) -> None:
        fig = Stopwatch("emergency_write", self.local_directory.url)
        written = step not in self._local_steps
        self._saver.finish(pending, fig, write=written)
        self._local_steps.add(step)
        if self._log is not None and written:
            self._log.append(
                "save",
                step,
                tier="local",
                blocking_s=blocking.seconds(),
                write_s=time.perf_counter() - fig.started,
                bytes=fig.bytes,
            )
        keep = self.options.local_max_to_keep
        if keep is not None:
            for old in sorted(self._local_steps)[:-keep]:
                steps.delete(steps.step_dir(self.local_directory, old, self.options.step_digits))
                self._local_steps.discard(old)
        self.last_write_figures = fig.done()

    def wait_until_finished(self) -> None:
        """Blocks until both tiers' writes in flight are committed; raises their errors."""
        self._writer.wait(self.local_directory.url)
        self.remote.wait_until_finished()

    # --- restore -------------------------------------------------------------------------

    def restore(
        self, step: int | None = None, target: Any = None, *, mesh: Mesh | None = None
    ) -> Any:
        """Restores the newest step every process can assemble (or ``step``); see the module.

        ``target`` / ``mesh`` work as in :func:`jaxckpt.restore`. The report is in
        ``last_report``. Every process must call it.
        """
        o = self.options
        started = time.perf_counter()
        self.wait_until_finished()
        self.remote.reload()
        # The host copies of the state being replaced are of no further use; freeing them
        # before reading lets the restore's buffers reuse that memory (the next save stages
        # into fresh buffers).
        self._saver = self._local_saver()
        tag = self._tag("restore")
        fig = Stopwatch("emergency_restore", self.local_directory.url)
        mine, views = self._publish_holdings(tag, step)
        tries, rejected = views.tries, list(views.rejected)
        bad_copies: list[BadCopy] = []
        req = local_restore.Request(
            self.local_directory, views, target, mesh, tag, o.timeout_s, fig
        )
        for s in tries:
            try:
                with gc_pause.paused():
                    state, report, records = local_restore.restore_step(req, s, mine.get(s))
            except StepUnusable as e:
                rejected.append(Rejected(s, str(e)))
                bad_copies.extend(e.bad_copies)
                continue
            fig.bytes = sum(
                a.nbytes for a in jax.tree_util.tree_leaves(state) if hasattr(a, "nbytes")
            )
            self.last_restore_figures = fig.done()
            self._restored = (s, records)
            if self._log is not None:  # (a remote restore is logged by the remote manager)
                tier = "peer" if report.from_peers else "local"
                self._log.append(
                    "restore",
                    s,
                    tier=tier,
                    seconds=time.perf_counter() - started,
                    sources={"peer": len(report.from_peers)},
                )
            break
        else:
            remote_steps = views.remote
            chosen = step if step is not None else max(remote_steps, default=None)
            if chosen is None or chosen not in remote_steps:
                raise CheckpointNotFoundError(
                    f"no step to restore{f' (asked for {step})' if step is not None else ''}: "
                    f"no local step is complete on the {views.count} processes "
                    f"({rejected or 'none'}) and the remote tier {self.remote.directory.url} "
                    f"has {list(remote_steps)}"
                )
            state = self.remote.restore(chosen, target, mesh=mesh)
            self._restored = (chosen, None)
            report = RecoveryReport("remote", chosen, multihost.process_count())
        rejected.sort(key=lambda r: -r.step)  # newest first, as they were considered
        self.last_report = dataclasses.replace(
            report, rejected=tuple(rejected), bad_copies=(*bad_copies, *report.bad_copies)
        )
        log.info("jaxckpt: restored %s", self.last_report)
        for cadence in self._cadences:  # saves count from here; a restart's cost
            cadence.restored(self.last_report.step, time.perf_counter() - started)
        return state

    def per_process(
        self,
        step: int | None = None,
        *,
        process: int | None = None,
        all: bool = False,  # noqa: A002 - the keyword users write
    ) -> Any:
        """This process's ``per_process=`` value of the step last restored (or ``step`` of
        the remote tier), matched by process index; ``process=i`` / ``all=True`` after a
        process-count change (see :func:`jaxckpt.per_process`). A replaced host gets its
        predecessor's value from a peer's copy (``last_report.per_process_from``)."""
        s, records = self._restored or (step, None)
        if step in (None, s) and records is not None:
            where = f"{self.local_directory.url} step {s} (local copies)"
            return pp.choose(
                records.__getitem__, saved_count=len(records), where=where, process=process, all=all
            )
        step = s if step is None else step
        if step is None or step not in self.remote.all_steps():
            raise CheckpointNotFoundError(
                f"{self.local_directory.url}: the per-process values of "
                f"{'a step' if step is None else f'local step {step}'} come with its restore "
                "(every process gathers them from the copies); call restore() first, or pass "
                f"a step of the remote tier ({self.remote.all_steps()})"
            )
        return self.remote.per_process(step, process=process, all=all)

    # --- lifetime ------------------------------------------------------------------------

    def cancel(self, timeout_s: float = CANCEL_TIMEOUT_S) -> bool:
        """Stops both tiers' saves in flight within about ``timeout_s``, so that the rest
        of a preemption's grace goes to ``save(step, state, force=True)`` of the current
        step (its local write; the remote save it starts too is not waited for). Every
        process calls it. True if a save was cancelled; see
        :meth:`CheckpointManager.cancel` for the guarantees."""
        start = time.monotonic()
        local = self._writer.cancel(timeout_s / 2)  # waits for peers, then a quick write
        local_s = time.monotonic() - start
        remote = self.remote.cancel(max(0.0, timeout_s - local_s))
        if local and self._log is not None:  # (the remote manager logs its own)
            # logged last: on an object store the log's rewrite is a PUT, not to be waited
            # for before the remote save is stopped
            self._log.append("cancel", self._reached, tier="local", seconds=local_s)
        return local or remote

    def close(self, cancel: bool = False) -> None:
        """Finishes both tiers' saves in flight (or ``cancel``s them) and stops the writer
        threads."""
        if self._closed:
            return
        self._closed = True
        if cancel:
            self.cancel()
        try:
            self._writer.close(self.local_directory.url)
        finally:
            try:
                self.remote.close()
                if self._log is not None:
                    self._log.close(self._reached, clean=not self._failed)
            finally:
                if self._preemption is not None:
                    self._preemption.close()
                self._verdict.release()

    def __enter__(self) -> EmergencyCheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        self._failed = kind is not None  # left by an exception: the run log's job failed
        self.close()
