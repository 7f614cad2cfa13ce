"""One writer per run directory: the lease a manager holds on its directory while it may write.

A scheduler that relaunches a job while its previous incarnation still drains, or a job
started twice, would otherwise have two managers saving, pruning and cleaning one directory.
The lease is a small JSON record, ``<directory>/.jaxckpt-lease``, naming its holder (host,
pid, job id, since when, last renewed):

* local and shared filesystems: the holder keeps an ``flock`` on the file, which the kernel
  drops when the process dies (even by SIGKILL), so a dead holder's lease on this host is
  free at once; releasing deletes the file.
* object stores (``s3://``, ``gs://``): the record is created with a conditional write
  (only if absent, or only if unchanged since it was read: S3's If-None-Match / If-Match,
  which TensorStore sends from 0.1.72), so two managers racing for it cannot both win;
  releasing writes a record that says released (S3 has no conditional delete).

The holder rewrites its record every ``stale_s / 6`` (the heartbeat). A record of another
host (flock does not reach across hosts on every shared filesystem) or on an object store
that was renewed within its holder's ``stale_s`` is watched for up to 2.5 of its heartbeats: renewed meanwhile,
its holder is alive and the lease is refused; not, it is dead (a crashed job restarted on
other hosts) and the lease is taken over with a warning. An older record is taken at once.

A second manager that finds the lease held refuses with :class:`DirectoryInUseError` naming
the holder. ``take_over=True`` takes a lease whose record still looks live (its holder is
gone, on another host or behind an object store) but never one whose flock is held: that
holder is alive. Restoring, listing and the ``jaxckpt`` command take no lease.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import tensorstore as ts

from ..errors import DirectoryInUseError, StorageError
from .storage import Location, storage_error

log = logging.getLogger("jaxckpt")

LEASE_FILE = ".jaxckpt-lease"
_JOB_VARIABLES = ("JAXCKPT_JOB_ID", "SLURM_JOB_ID", "JOB_ID", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class Holder:
    """Who holds a lease: the record in the lease file."""

    host: str
    pid: int
    job: str
    since: float  # when it was taken (Unix time)
    renewed: float  # when it was last renewed (Unix time)
    released: bool = False
    stale_s: float = 60.0  # its lease_stale_s: it renews every sixth of this

    @staticmethod
    def me(stale_s: float) -> Holder:
        from .multihost import host_name

        job = next((os.environ[v] for v in _JOB_VARIABLES if os.environ.get(v)), "")
        now = time.time()
        return Holder(host_name(), os.getpid(), job, now, now, stale_s=stale_s)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def parse(data: bytes) -> Holder | None:
        """The record in ``data``; None for an empty or unreadable one (a free lease)."""
        try:
            doc = json.loads(data)
            return Holder(
                str(doc["host"]),
                int(doc["pid"]),
                str(doc.get("job", "")),
                float(doc["since"]),
                float(doc["renewed"]),
                bool(doc.get("released", False)),
                float(doc.get("stale_s", 60.0)),
            )
        except (ValueError, TypeError, KeyError):
            return None

    def describe(self) -> str:
        since = datetime.datetime.fromtimestamp(self.since, datetime.UTC)
        job = f", job {self.job}" if self.job else ""
        return (
            f"host {self.host}, pid {self.pid}{job}, holding it since "
            f"{since.isoformat(timespec='seconds')}, renewed {time.time() - self.renewed:.0f} s ago"
        )


def _in_use(directory: Location, holder: Holder | None, why: str, way_out: str) -> Exception:
    who = holder.describe() if holder is not None else "another process"
    return DirectoryInUseError(
        f"{directory.url} is being written by another job ({who}): {why}. Two jobs writing "
        f"one run directory would lose saves, so this manager refuses to start. {way_out}",
        holder,
    )


_WAIT = "Wait for that job to finish or stop it, or give this job another directory"


class Lease:
    """A held lease: renewed by a daemon thread until :meth:`release`."""

    def __init__(self, directory: Location, holder: Holder, fd: int | None, gen: bytes) -> None:
        self.directory, self.holder = directory, holder
        self._fd, self._generation = fd, gen
        self._lost: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_loop, name="jaxckpt-lease", daemon=True)
        self._thread.start()

    def check(self) -> None:
        """Raises DirectoryInUseError if the lease was lost (taken over by another job)."""
        if self._lost is not None:
            raise DirectoryInUseError(
                f"{self.directory.url}: this manager lost its writer's lease ({self._lost}); "
                "another job writes this directory now, so nothing more is saved here. Stop "
                "one of the two jobs",
                None,
            )

    def renew(self) -> None:
        """Writes the record again with the time now (the heartbeat; also called by tests)."""
        with self._lock:
            if self._lost is not None or self._stop.is_set():
                return
            holder = replace(self.holder, renewed=time.time())
            try:
                if self._fd is not None:
                    path = os.path.join(self.directory.url, LEASE_FILE)
                    if os.stat(path).st_ino != os.fstat(self._fd).st_ino:
                        self._lost = f"{path} was replaced"
                        return
                    now = Holder.parse(_read_fd(self._fd))  # (another host's takeover)
                    if now is not None and (now.host, now.pid, now.since) != (
                        holder.host,
                        holder.pid,
                        holder.since,
                    ):
                        self._lost = f"taken over by {now.describe()}"
                        return
                    _write_fd(self._fd, holder.to_bytes())
                else:
                    stamp = (
                        self.directory.open_kvstore()
                        .write(LEASE_FILE, holder.to_bytes(), if_equal=self._generation)
                        .result()
                    )
                    generation = stamp.generation or _ours(self.directory, holder)
                    if not generation:
                        self._lost = _lost_to(self.directory)
                        return
                    self._generation = generation
                self.holder = holder
            except FileNotFoundError:
                self._lost = f"{self.directory.url}/{LEASE_FILE} was deleted"
            except Exception as e:  # a storage hiccup: the next beat tries again
                log.warning("jaxckpt: renewing the lease of %s failed: %s", self.directory.url, e)

    def _renew_loop(self) -> None:
        while not self._stop.wait(heartbeat_s(self.holder.stale_s)):
            self.renew()

    def release(self) -> None:
        """Stops renewing and frees the lease: deletes the record (while still holding the
        lock, or only if it is still this holder's object)."""
        with self._lock:
            if self._stop.is_set():
                return
            self._stop.set()
            try:
                if self._fd is not None:
                    if self._lost is None:
                        with contextlib.suppress(FileNotFoundError):
                            os.remove(os.path.join(self.directory.url, LEASE_FILE))
                    os.close(self._fd)
                elif self._lost is None:
                    # a record saying released, written only over this holder's own: an S3
                    # delete is not conditional (TensorStore checks, then deletes), so it
                    # could remove a lease another job just took over
                    done = replace(self.holder, renewed=time.time(), released=True)
                    self.directory.open_kvstore().write(
                        LEASE_FILE, done.to_bytes(), if_equal=self._generation
                    ).result()
            except Exception as e:  # the lease goes stale instead
                log.warning("jaxckpt: releasing the lease of %s failed: %s", self.directory.url, e)
        self._thread.join(timeout=1.0)


def acquire(directory: Location, *, stale_s: float, take_over: bool = False) -> Lease:
    """Takes the writer's lease on ``directory`` (see the module); raises
    DirectoryInUseError if another job holds it, StorageError if the storage refuses
    (read-only, permissions: ``StorageError.errno`` says which)."""
    me = Holder.me(stale_s)
    if directory.is_local:
        return _acquire_file(directory, me, take_over)
    return _acquire_object(directory, me, take_over)


def _acquire_file(directory: Location, me: Holder, take_over: bool) -> Lease:
    path = os.path.join(directory.url, LEASE_FILE)
    while True:
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        except OSError as e:
            raise storage_error(e, directory, "taking the writer's lease on") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _record_of_locker(fd)
                mine = held is not None and (held.host, held.pid) == (me.host, me.pid)
                raise _in_use(
                    directory,
                    held,
                    "it holds the lock on " + path,
                    "This is another manager of this process: close it first (mgr.close(), "
                    "or open managers in a with block)"
                    if mine
                    else _WAIT,
                ) from None
            try:  # a holder releasing deletes the file: this lock may be on a deleted one
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if not current:
                os.close(fd)
                continue
            _check_record(
                directory,
                Holder.parse(_read_fd(fd)),
                me,
                take_over,
                lambda fd=fd: Holder.parse(_read_fd(fd)),  # type: ignore[misc]
            )
            _write_fd(fd, me.to_bytes())
        except BaseException:
            os.close(fd)
            raise
        return Lease(directory, me, fd, b"")


def heartbeat_s(stale_s: float) -> float:
    """How often a holder renews its record."""
    return stale_s / 6


def _check_record(
    directory: Location,
    old: Holder | None,
    me: Holder,
    take_over: bool,
    read: Callable[[], Holder | None],
) -> None:
    """Refuses a record that is still being renewed (see the module); logs a takeover.
    ``read`` reads the record again."""
    if old is None or old.released:
        return
    age, stale_s = time.time() - old.renewed, old.stale_s  # by the holder's own heartbeat
    if old.host != me.host and age < stale_s and not take_over:
        deadline = time.monotonic() + min(stale_s - age, 2.5 * heartbeat_s(stale_s))
        while time.monotonic() < deadline:
            time.sleep(min(0.2, heartbeat_s(stale_s) / 4))
            now = read()
            if now is not None and now != old and not now.released:
                raise _in_use(
                    directory,
                    now,
                    f"its holder renews its lease (a heartbeat every {heartbeat_s(stale_s):g} s)",
                    f"{_WAIT}; if that job is gone and this is wrong, pass "
                    "Options(take_over_lease=True)",
                )
            if now is not None and now.released:
                return  # (None: read while being rewritten, or deleted: watch on)
    log.warning(
        "jaxckpt: taking over the writer's lease of %s from %s, which did not release it "
        "(it died or was killed)",
        directory.url,
        old.describe(),
    )


def _acquire_object(directory: Location, me: Holder, take_over: bool) -> Lease:
    kv = directory.open_kvstore()
    try:
        got = kv.read(LEASE_FILE).result()
        old = Holder.parse(bytes(got.value)) if got.state == "value" else None
        # no flock on an object store: every live-looking record is watched for renewals
        _check_record(directory, old, replace(me, host=""), take_over, lambda: _read_holder(kv))
        # only if the object is still what was just read: the generation of a key read as
        # missing means "only if still absent" (S3: If-None-Match; TensorStore >= 0.1.72)
        condition = got.stamp.generation
        stamp = kv.write(LEASE_FILE, me.to_bytes(), if_equal=condition).result()
    except DirectoryInUseError:
        raise
    except Exception as e:
        raise StorageError(f"taking the writer's lease on {directory.url} failed: {e}") from e
    generation = stamp.generation or _ours(directory, me)
    if not generation:  # another manager wrote it in between: it won
        raise _in_use(
            directory,
            _read_holder(kv),
            "it took the lease object a moment before this manager",
            _WAIT,
        )
    return Lease(directory, me, None, generation)


def _ours(directory: Location, record: Holder) -> bytes:
    """After a conditional write that reports its condition failed: the object's generation
    if it holds exactly ``record`` (the write was applied, its answer lost on the way, and
    TensorStore's retry found the object changed: by this very write), else b""."""
    got = directory.open_kvstore().read(LEASE_FILE).result()
    if got.state == "value" and Holder.parse(bytes(got.value)) == record:
        return bytes(got.stamp.generation)
    return b""


@dataclass(frozen=True)
class Verdict:
    """What a job's managers get: this process's lease (None on the processes that do not
    hold it), or why the directory is read-only for this job (``read_only``)."""

    lease: Lease | None
    read_only: str | None = None
    errno: int | None = None  # of the refusal that made it read-only

    def check(self, where: str) -> None:
        """Raises StorageError if a manager with this verdict may not save (read-only),
        DirectoryInUseError if another job took its lease over."""
        if self.read_only:
            error = StorageError(
                f"{where}: this manager refuses to save, it lists and restores only: "
                f"{self.read_only}"
            )
            error.errno = self.errno
            raise error
        if self.lease is not None:
            self.lease.check()

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()


_rounds: dict[str, int] = {}


def for_job(
    directory: Location,
    *,
    stale_s: float,
    take_over: bool,
    timeout_s: float,
    per_process: bool = False,
) -> Verdict:
    """Takes the lease for a job's managers: process 0 for a shared directory
    (``per_process=False``), every process for its own (an emergency local tier); the
    others learn the verdict, so every process raises the same DirectoryInUseError or gets
    the same ``read_only``. A read-only filesystem or a directory this user may not write
    makes the managers read-only instead of failing. Every process calls it."""
    from . import multihost

    # a name the same on every process: the shared directory's, or one for all local ones
    which = "local" if per_process else hashlib.sha256(directory.url.encode()).hexdigest()[:12]
    n = _rounds[which] = _rounds.get(which, 0) + 1
    name = f"jaxckpt/lease/{which}/{n}"
    if per_process or multihost.process_index() == 0:
        lease, outcome = _try(directory, stale_s, take_over)
    else:
        lease, outcome = None, {}
    if per_process:
        got = [json.loads(v) for v in multihost.all_gather(name, json.dumps(outcome), timeout_s)]
        failed = [(p, o) for p, o in enumerate(got) if o.get("kind") == "error"]
        if failed and lease is not None:
            lease.release()
        outcome = failed[0][1] if failed else next((o for o in got if o.get("kind")), outcome)
        if failed and multihost.process_count() > 1:
            outcome = {**outcome, "text": f"process {failed[0][0]}: {outcome['text']}"}
    else:
        text = json.dumps(outcome)
        outcome = json.loads(multihost.decided(name, "", lambda _: text, timeout_s))
    if outcome.get("kind") == "error":
        if not outcome["in_use"]:
            raise StorageError(outcome["text"])
        held = outcome.get("holder")
        raise DirectoryInUseError(outcome["text"], Holder(**held) if held else None)
    if outcome.get("kind") == "read_only":
        return Verdict(None, outcome["text"], outcome.get("errno"))
    return Verdict(lease)


_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)


def _try(directory: Location, stale_s: float, take_over: bool) -> tuple[Lease | None, dict]:
    try:
        return acquire(directory, stale_s=stale_s, take_over=take_over), {}
    except DirectoryInUseError as e:
        held = asdict(e.holder) if isinstance(e.holder, Holder) else None
        return None, {"kind": "error", "in_use": True, "text": str(e), "holder": held}
    except StorageError as e:
        if e.errno in _READ_ONLY_ERRNOS:
            return None, {"kind": "read_only", "text": str(e), "errno": e.errno}
        return None, {"kind": "error", "in_use": False, "text": str(e)}


def _lost_to(directory: Location) -> str:
    holder = _read_holder(directory.open_kvstore())
    return f"taken over by {holder.describe()}" if holder else "its lease object was deleted"


def _read_holder(kv: ts.KvStore) -> Holder | None:
    got = kv.read(LEASE_FILE).result()
    return Holder.parse(bytes(got.value)) if got.state == "value" else None


def holder(directory: Location) -> Holder | None:
    """The record of the lease on ``directory`` (None: none, or unreadable)."""
    data = directory.read_bytes(LEASE_FILE)
    return Holder.parse(data) if data else None


def _record_of_locker(fd: int) -> Holder | None:
    """The record of the process holding the lock: it writes it right after locking, so
    an empty file is read again for up to a second."""
    for _ in range(50):
        if (got := Holder.parse(_read_fd(fd))) is not None:
            return got
        time.sleep(0.02)
    return None


def _read_fd(fd: int) -> bytes:
    return os.pread(fd, RECORD_BYTES, 0)


RECORD_BYTES = 1024  # a record is padded with spaces to this size (JSON allows them)


def _write_fd(fd: int, data: bytes) -> None:
    """Rewrites the record in place with one write of a fixed size: a reader never sees
    the file empty or half old, as it could between a truncate and a write."""
    if len(data) > RECORD_BYTES:
        raise ValueError(f"a lease record of {len(data)} bytes (at most {RECORD_BYTES})")
    os.pwrite(fd, data.ljust(RECORD_BYTES), 0)
    os.fsync(fd)
