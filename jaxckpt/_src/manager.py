"""``CheckpointManager``: numbered steps in one directory, policies, and a background writer.

``save`` blocks for the device->host copy of the owned shards only; one persistent thread
writes and commits (at most one save in flight). A background failure is raised at the next
``save`` / ``wait_until_finished`` / ``close``. Steps are ``<directory>/<zero-padded step>``;
only directories with a ``COMMITTED`` marker exist, leftovers of interrupted saves are
deleted when a manager starts.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import jax

from ..errors import (
    BackgroundSaveError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    ManifestError,
)
from . import gc_pause, lease, monitoring, multihost, preemption, readers, saving, steps
from .changes import Changes
from .goodput.cadence import Blocking, Cadence, start_run
from .goodput.runlog import RunLog
from .manifest import MANIFEST_FILE, read_manifest
from .options import Options, signal_numbers
from .restoring import restore
from .staging import HostCopies, Staged
from .storage import Location, location, storage_error
from .writer import Writer

__all__ = ["BackgroundSaveError", "CheckpointManager"]

log = logging.getLogger("jaxckpt")
CANCEL_TIMEOUT_S = 1.0  # how long cancel() waits for the cancelled save to stop


class CheckpointManager:
    """Saves and restores numbered steps of a training run.

    >>> with jaxckpt.CheckpointManager("/ckpt/run1", jaxckpt.Options(max_to_keep=3)) as mgr:
    ...     for step in range(1000):
    ...         state = train_step(state)
    ...         mgr.save(step, state, metrics={"loss": float(loss)})
    >>> state = mgr.restore(target=abstract_state)
    """

    def __init__(self, directory: str | os.PathLike, options: Options | None = None):
        self.directory: Location = location(directory)
        self.options = opts = options or Options()
        if opts.create and not opts.read_only:
            try:
                self.directory.makedirs()
            except OSError as e:
                raise storage_error(e, self.directory, "creating the run directory") from e
        if self.directory.is_local and not os.path.isdir(self.directory.url):
            raise CheckpointNotFoundError(
                f"{self.directory.url} does not exist; create it or pass Options(create=True)"
            )
        # one writing job per directory (lease.py); a read-only one lists and restores
        self._verdict = lease.Verdict(None, "it was opened with Options(read_only=True)")
        if not opts.read_only:
            self._verdict = lease.for_job(
                self.directory,
                stale_s=opts.lease_stale_s,
                take_over=opts.take_over_lease,
                timeout_s=opts.timeout_s,
            )
            if self._verdict.read_only:
                log.warning(
                    "jaxckpt: %s; this manager lists and restores only", self._verdict.read_only
                )
        self._preemption: preemption.Watch | None = None
        try:
            self._start()
        except BaseException:
            self._release()
            raise

    def _start(self) -> None:
        self._host = HostCopies()
        self._writer = Writer("jaxckpt-writer", self.options.timeout_s)
        # this process's figures (jaxckpt.Figures): the last committed save's phases,
        # bytes and GB/s; the calling thread's part of the last save; the last restore
        self.last_save_figures: monitoring.Figures | None = None
        self.last_save_blocking_s: float | None = None
        self.last_restore_figures: monitoring.Figures | None = None
        self._closed = self._failed = False
        self._metrics: dict[int, dict | None] = {}
        self._broken: set[int] = set()  # marked steps without a manifest, warned about
        self._restored_step: int | None = None
        self._changes = Changes(self.directory.url)  # stale saves (process 0)
        read_only = self._verdict.read_only
        if self.options.cleanup_tmp and not read_only and multihost.process_index() == 0:
            # Leftovers of interrupted saves; a save still in progress (another manager on
            # this directory) is left alone: its writer holds the lock on its owner file
            # (see ``storage.being_written``).
            steps.clean_leftovers(self.directory, grace_s=self.options.timeout_s)
        self.reload()
        # the run log (a figure of each save and restore; jaxckpt.goodput reads it) and the
        # save interval, fixed or chosen from what the log and this job measure
        opts = self.options
        self._log, history = start_run(
            [self.directory], ["dir"], opts.heartbeat_s, opts.run_log and not read_only
        )
        self._cadence = Cadence(
            "dir",
            opts.save_interval_steps,
            mtbf_hours=opts.mtbf_hours,
            min_steps=opts.min_interval_steps,
            max_steps=opts.max_interval_steps,
            history=history,
            log=self._log,
            timeout_s=opts.timeout_s,
            writer=self._writer,
            where=self.directory.url,
        )
        self._reached: int | None = None  # the highest step given to save()
        self._tier, self._owns_log = "dir", True  # this manager's tier in the run log

    def log_into(self, log: RunLog | None, tier: str) -> None:
        """Logs this manager's saves and restores into ``log`` as ``tier`` (the remote
        tier of an EmergencyCheckpointManager, whose log it is). That manager also decides
        when the tier saves (it forces every save): this one's interval goes unused, and an
        ``"auto"`` one is not measured or agreed on a second time."""
        self._log, self._tier, self._owns_log = log, tier, False
        self._cadence = Cadence(tier, 1, writer=self._writer, where=self.directory.url)

    # --- listing -------------------------------------------------------------------------

    def step_path(self, step: int) -> Location:
        return steps.step_dir(self.directory, step, self.options.step_digits)

    def reload(self) -> None:
        """Re-reads the directory: sees steps another process committed or deleted.

        A step marked committed without its manifest (an older version's lost save, another
        tool's crash, a hand's deletion) is left out with a warning naming it, so the run
        goes on from the newest step that reads; ``jaxckpt ls`` shows it."""
        scan = steps.scan(self.directory, require=MANIFEST_FILE)
        unseen = sorted(set(scan.broken) - self._broken)
        if unseen:
            log.warning(
                "jaxckpt: %s: step(s) %s hold COMMITTED but no %s; skipped (the newest step "
                "that reads is used). Delete them: rm -r %s",
                self.directory.url,
                unseen,
                MANIFEST_FILE,
                " ".join(self.step_path(s).url for s in unseen),
            )
        self._broken |= set(unseen)
        self._metrics = {s: self._metrics.get(s, _NOT_READ) for s in scan.committed}

    def all_steps(self) -> list[int]:
        """Committed steps, oldest first."""
        return sorted(self._metrics)

    def latest_step(self) -> int | None:
        return max(self._metrics, default=None)

    def metrics(self, step: int) -> dict | None:
        """The metrics saved with ``step`` (None if none were given)."""
        self._require(step)
        if self._metrics[step] is _NOT_READ:
            self._metrics[step] = read_manifest(self.step_path(step)).metrics
        return self._metrics[step]

    def best_step(self) -> int | None:
        """The step whose metrics rank best by ``Options.best_fn`` (newest without one)."""
        ranked = self._ranked()
        return ranked[0] if ranked else self.latest_step()

    def metadata(self, step: int | None = None) -> Any:
        """The tree of leaf info of ``step`` (default: newest); see ``jaxckpt.metadata``."""
        return readers.metadata(self.step_path(self._step_or_latest(step)).url)

    def custom_metadata(self, step: int | None = None) -> Any:
        """The ``custom_metadata=`` saved with ``step`` (default: newest)."""
        return readers.custom_metadata(self.step_path(self._step_or_latest(step)).url)

    def per_process(
        self,
        step: int | None = None,
        *,
        process: int | None = None,
        all: bool = False,  # noqa: A002 - the keyword users write
    ) -> Any:
        """This process's ``per_process=`` value of ``step`` (default: the step last
        restored, else the newest); see :func:`jaxckpt.per_process` for ``process`` and
        ``all`` after a process-count change."""
        if step is None:
            step = self._restored_step
        path = self.step_path(self._step_or_latest(step)).url
        return readers.per_process(path, process=process, all=all)

    def should_save(self, step: int) -> bool:
        """True when the interval policy asks for ``step`` and it is not saved yet."""
        return self._cadence.due(step) and step not in self._metrics

    def reached_preemption(self, step: int) -> bool:
        """True at the step every process stops at after any process got a preemption
        notice (SIGTERM, or ``Options.preemption_signals``), with one process as with many.

        Call it every step, with the same steps on every process; when True, save that step
        with ``force=True`` (a save still in flight gets ``Options.preemption_grace_s`` to
        finish, then is cancelled), ``wait_until_finished()``, and exit 0: the next job
        resumes there. The first call installs the signal handler (chained to one already
        installed in Python; the previous one is put back on ``close``), so a job that never
        calls it keeps the default SIGTERM. See ``jaxckpt._src.preemption``.
        """
        if self._preemption is None:
            self._preemption = preemption.Watch(
                preemption.name_for(self.directory),
                signal_numbers(self.options.preemption_signals),
                self.options.timeout_s,
            )
        return self._preemption.reached(step)

    # --- save ----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict | None = None,
        custom_metadata: Any = None,
        per_process: Any = None,
        force: bool = False,
    ) -> bool:
        """Saves ``state`` (a pytree, or a ``jaxckpt.stage`` handle) as ``step``.

        Returns False when the policy says not now. With ``async_save`` it returns once the
        owned shards are on the host; the write and commit run in the background.
        ``custom_metadata``: a JSON value kept with the step (``mgr.custom_metadata(step)``);
        ``per_process``: this process's own value, e.g. its data iterator's ``get_state()``
        (``mgr.per_process(step)``); each process passes its own.
        """
        if self._closed:
            raise CheckpointError(f"the manager of {self.directory.url} is closed")
        self.check_writable()
        if force and self._preemption is not None and self._preemption.stopping:
            self._make_way(self.options.preemption_grace_s)
        self._writer.raise_error()
        self._reached = max(step, self._reached or step)
        if self._log is not None:
            self._log.heartbeat(step)
        if not force and not self.should_save(step):
            return False
        if step in self._metrics:
            raise CheckpointExistsError(
                f"step {step} is already committed at {self.step_path(step).url}; delete it "
                "first (mgr.delete(step)) or save another step"
            )
        clock = monitoring.Stopwatch("manager_save", self.step_path(step).url)
        # the caller waits (a synchronous save writes here too): no collections meanwhile
        with clock.phase("blocking"), gc_pause.paused():
            self.wait_until_finished()
            opts = self.options
            prepared = saving.prepare(
                self.step_path(step).url,
                state,
                custom_metadata=custom_metadata,
                metrics=metrics,
                per_process=per_process,
                compression=opts.compression,
                chunk_bytes=opts.chunk_bytes,
                writes=saving.Writes.of(opts),
            )
            background = opts.async_save and (
                isinstance(state, Staged) or not self._over_budget(prepared.staged)
            )
            if background and not isinstance(state, Staged):
                prepared = prepared.snapshot(self._host)
            run = self._writer.submit if background else self._writer.run_now
            # the time this save blocks the caller, for the run log (run now: until written)
            blocking = Blocking(clock.started, time.perf_counter() if background else None)
            run(
                f"saving step {step} to {self.directory.url}", self._write, step, prepared, blocking
            )
        self.last_save_blocking_s = clock.done().phases["blocking"]
        self._cadence.saved(step, self.last_save_blocking_s)
        return True

    def check_writable(self) -> None:
        """Raises StorageError if this manager may not save (read-only), DirectoryInUseError
        if another job took its directory over."""
        self._verdict.check(self.directory.url)

    def _make_way(self, grace_s: float) -> None:
        """Gives a save in flight ``grace_s`` to finish, then cancels it (a preemption)."""
        if not self._writer.idle_within(grace_s):
            log.warning(
                "jaxckpt: preemption: the save in flight to %s did not finish within %gs "
                "(preemption_grace_s); cancelling it",
                self.directory.url,
                grace_s,
            )
            self.cancel()

    def _over_budget(self, staged: Staged) -> bool:
        budget = self.options.staging_budget_bytes
        total = sum(leaf.write.nbytes for leaf in staged.leaves if leaf.write is not None)
        if budget is None or total <= budget:
            return False
        log.warning(
            "jaxckpt: %d bytes to stage exceed staging_budget_bytes=%d; saving synchronously",
            total,
            budget,
        )
        return True

    def _write(self, step: int, prepared: saving.Prepared, blocking: Blocking) -> None:
        fig, written = saving.committed(prepared, self.options.timeout_s)
        self.last_save_figures = fig
        before = max((s for s in self._metrics if s < step), default=None)
        self._metrics[step] = prepared.metrics
        changed = None
        if written is not None:  # process 0 wrote the manifest: leaves changed, stale?
            previous = None if before is None else (before, self.step_path(before))
            changed = self._changes.committed(step, written, previous)
        if self._log is not None:
            self._log.append(
                "save",
                step,
                tier=self._tier,
                blocking_s=blocking.seconds(),
                write_s=fig.total_s,
                bytes=fig.bytes,
                **({} if changed is None else {"leaves_changed": changed}),
            )
        self._apply_retention()

    def wait_until_finished(self) -> None:
        """Blocks until the save in flight is committed; raises its error if it failed."""
        self._writer.wait(self.directory.url)

    # --- retention -----------------------------------------------------------------------

    def _ranked(self) -> list[int]:
        """Steps with metrics, best first by ``Options.best_fn`` (none without one)."""
        fn = self.options.best_fn
        if fn is None:
            return []
        scored = []
        for step in self._metrics:
            m = self.metrics(step)
            if m is None:
                continue
            try:
                value = float(fn(m))
            except (KeyError, TypeError, ValueError) as e:
                log.warning("jaxckpt: step %d not ranked: best_fn failed on %s (%r)", step, m, e)
                continue
            if not math.isnan(value):  # NaN ranks nowhere: it is not better than anything
                scored.append((value, step))
        reverse = self.options.best_mode == "max"
        # Ties: the newer step ranks first.
        scored.sort(key=lambda t: (t[0], t[1]) if reverse else (t[0], -t[1]), reverse=reverse)
        return [s for _, s in scored]

    def _apply_retention(self) -> None:
        """Every process decides the same deletions (same steps and metrics); process 0 deletes."""
        opts = self.options
        if opts.max_to_keep is None:
            return
        steps = self.all_steps()
        newest = steps[-1] if steps else None
        forever = {s for s in steps if opts.keep_period and s % opts.keep_period == 0}
        ranked = self._ranked()
        # the best first (with a best_fn), then the steps without a rank, newest first
        candidates = ranked + [s for s in reversed(steps) if s not in ranked]
        keep = set(candidates[: opts.max_to_keep]) | forever | {newest}
        for step in steps:
            if step not in keep:
                self._delete(step)

    def delete(self, step: int) -> None:
        """Deletes a committed step (its marker first, so a half-deleted step is invisible)."""
        self._require(step)
        self.check_writable()
        self.wait_until_finished()
        self._delete(step)

    def _delete(self, step: int) -> None:
        """Forgets ``step``; process 0 deletes it from storage."""
        if multihost.process_index() == 0:
            steps.delete(self.step_path(step))
        self._metrics.pop(step, None)

    # --- restore -------------------------------------------------------------------------

    def restore(
        self, step: int | None = None, target: Any = None, *, mesh: jax.sharding.Mesh | None = None
    ) -> Any:
        """Restores ``step`` (default: the newest committed) like :func:`jaxckpt.restore`.

        By default a step whose manifest does not parse is skipped with a warning, for the
        next older one (every process reads the same file: all choose the same step)."""
        self.wait_until_finished()
        tries = [self._step_or_latest(step)]
        if step is None:
            tries += [s for s in reversed(self.all_steps()) if s < tries[0]]
        for s in tries:
            started = time.perf_counter()
            try:
                out = restore(
                    self.step_path(s).url,
                    target=target,
                    mesh=mesh,
                    read_budget_bytes=self.options.read_budget_bytes,
                    timeout_s=self.options.timeout_s,
                    stall_timeout_s=self.options.stall_timeout_s,
                )
            except ManifestError as e:
                if step is not None or s == tries[-1]:
                    raise
                log.warning("jaxckpt: skipping step %d, its manifest does not read: %s", s, e)
                continue
            self.last_restore_figures = monitoring.last("restore")
            self._restored_step = s
            seconds = time.perf_counter() - started
            self._cadence.restored(s, seconds)
            if self._log is not None:
                self._log.append("restore", s, tier=self._tier, seconds=seconds)
            return out
        raise AssertionError("unreachable: the last try returns or raises")

    def _step_or_latest(self, step: int | None) -> int:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise CheckpointNotFoundError(
                    f"{self.directory.url} holds no committed step; train from scratch or "
                    "point the manager at the run's directory"
                )
        self._require(step)
        return step

    def _require(self, step: int) -> None:
        if step not in self._metrics:
            raise CheckpointNotFoundError(
                f"step {step} is not a committed step of {self.directory.url} "
                f"(committed: {self.all_steps()}); call reload() if another process saved it"
            )

    # --- lifetime ------------------------------------------------------------------------

    def cancel(self, timeout_s: float = CANCEL_TIMEOUT_S) -> bool:
        """Stops the save in flight (a preemption notice leaves seconds; a remote save may
        take minutes); every process of the job calls it. Returns within about
        ``timeout_s``: True if a save was cancelled (it is never committed, even if its
        thread is still inside a storage write when this returns, and its error is not
        raised later), False if none was in flight or its commit had already won (then it
        is committed). Its leftovers are removed now on a local disk, else when a manager
        next starts. The manager can save again at once (the cancelled job ends first)."""
        started = time.perf_counter()
        cancelled = self._writer.cancel(timeout_s)
        if cancelled and self._log is not None:
            self._log.append(
                "cancel", self._reached, tier=self._tier, seconds=time.perf_counter() - started
            )
        return cancelled

    def close(self, cancel: bool = False) -> None:
        """Finishes the save in flight (or ``cancel``s it), stops the writer thread, raises
        a pending error."""
        if self._closed:
            return
        self._closed = True
        if cancel:
            self.cancel()
        try:
            self._writer.close(self.directory.url)
        finally:
            try:
                if self._log is not None and self._owns_log:
                    self._log.close(self._reached, clean=not self._failed)
            finally:
                self._release()

    def _release(self) -> None:
        """Frees the lease and the signal handlers (after the last save of this manager)."""
        if self._preemption is not None:
            self._preemption.close()
        self._verdict.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: Any) -> None:
        self._failed = kind is not None  # left by an exception: the run log's job failed
        self.close()


class _NotRead:
    def __repr__(self) -> str:
        return "<metrics not read>"


_NOT_READ: Any = _NotRead()
