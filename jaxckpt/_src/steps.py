"""Step directories, for both tiers: the commit that makes one visible, listing the
committed ones, deleting one, and clearing what interrupted saves left behind.

A step directory is committed when it holds ``COMMITTED``, written last: a save writes into
``<step>.tmp-<id>/`` (its writer holding the ``.owner`` lock), renames it into place, then
writes the marker; a deletion removes the marker first. So a half-written or half-deleted
step is never listed or restored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import CheckpointError, CheckpointExistsError
from .manifest import COMMIT_FILE
from .storage import (
    OWNER_FILE,
    Location,
    being_written,
    hold_owner_lock,
    release_owner_lock,
    rename_dir,
    storage_error,
)

log = logging.getLogger("jaxckpt")
_CLAIM = ".init-"  # prefix of a claim's hidden directory (see ``claim``)


def step_dir(directory: Location, step: int, digits: int = 8) -> Location:
    """A step's directory: its number zero-padded to ``digits`` (``00001000``)."""
    return directory.join(f"{step:0{digits}d}")


def claim(work: Location) -> int | None:
    """Creates the local temporary directory ``work`` (a new, unique name) already holding
    its owner lock, and returns the lock's descriptor (``storage.release_owner_lock``). A
    manager cleaning leftovers meanwhile must never see it unlocked, so it is made under a
    hidden name, locked there, then renamed into place. The hidden name carries the host
    and the process id, so ``clean_leftovers`` can tell a claim killed before its lock
    (or its rename) from one in progress."""
    if not work.is_local:
        return None
    owner = f"{socket.gethostname()}-{os.getpid()}"
    hidden = work.parent().join(f"{_CLAIM}{owner}-{uuid.uuid4().hex[:8]}")
    os.makedirs(hidden.url)
    fd = None
    try:
        fd = hold_owner_lock(hidden)
        os.rename(hidden.url, work.url)
    except BaseException:
        release_owner_lock(fd)
        hidden.remove()
        raise
    return fd


def work_dir(final: Location, token: str) -> Location:
    """Where a save of ``final`` writes: ``<final>.tmp-<token>`` beside it, or ``final``
    itself on object stores (they have no rename; the marker written last is the truth)."""
    return final.parent().join(f"{final.name}.tmp-{token}") if final.is_local else final


@contextlib.contextmanager
def committing(
    final: Location,
    token: str | None = None,
    *,
    marker: bool = True,
    replace_committed: bool = False,
) -> Iterator[Location]:
    """Writes the directory ``final`` all at once: yields its temporary ``work_dir``,
    created already holding the owner lock (``claim``), for the caller to fill; on a clean
    exit renames it into place and writes ``COMMITTED`` last (``publish``; ``marker=False``
    for directories that other tools read, which carry no marker); on any error removes
    it (and only it), so an earlier committed ``final`` is never touched. On object stores
    the leftovers of an earlier uncommitted attempt at ``final`` are cleared first. In a
    multi-process save only process 0 enters it; the others write into
    ``work_dir(final, token)``. An OSError of the storage becomes a :class:`StorageError`
    naming ``final`` and what the errno means.

    >>> with steps.committing(loc) as work:
    ...     work.write_bytes("data", b"...")
    """
    work = work_dir(final, token or uuid.uuid4().hex[:12])
    if work == final and final.list_children():
        if final.exists(COMMIT_FILE) and not replace_committed:
            raise CheckpointExistsError(
                f"{final.url} already holds a committed checkpoint; nothing was overwritten"
            )
        final.remove()
    try:
        owner = claim(work)
    except OSError as e:
        if isinstance(e, CheckpointError):
            raise
        raise storage_error(e, final, "saving") from e
    try:
        yield work
        publish(work, final, replace_committed=replace_committed, marker=marker)
    except BaseException as e:
        if work != final:
            work.remove()
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise storage_error(e, final, "saving") from e
        raise
    finally:
        release_owner_lock(owner)


def publish(
    work: Location, final: Location, *, replace_committed: bool = False, marker: bool = True
) -> None:
    """Makes the finished ``work`` directory the committed ``final`` one: rename (local
    filesystems; on object stores ``work`` is ``final``), then the marker.

    The rename never replaces a directory (``storage.rename_dir``). What is already at
    ``final`` is moved aside only when nobody writes it (its owner lock is taken here, so a
    save in progress there is never touched) and it is a leftover without a marker, or a
    committed one with ``replace_committed``; else this is a CheckpointExistsError and
    nothing is overwritten (always, for ``marker=False`` directories, which have no marker
    to tell a leftover from a finished one). So two saves racing for one step cannot mix:
    one commits its own directory, the other fails and removes only its own. The marker
    goes into the directory this save renamed (it holds that directory's owner lock until
    the marker is written, so nobody can move it aside meanwhile)."""
    if work != final:
        try:
            rename_dir(work, final)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            _move_aside(final, replaceable=marker, replace_committed=replace_committed)
            try:
                rename_dir(work, final)
            except OSError as again:
                if again.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                raise _written_meanwhile(final) from again
    if marker:
        final.write_bytes(COMMIT_FILE, b"", create_dir=False)
    final.delete_file(OWNER_FILE)


def _written_meanwhile(final: Location) -> CheckpointExistsError:
    holder = (final.read_bytes(OWNER_FILE) or b"").decode(errors="replace").strip()
    return CheckpointExistsError(
        f"{final.url} was written by another save while this one was writing"
        f"{f' (by {holder})' if holder else ''}; nothing was overwritten and this save's "
        "own directory was removed. Save each checkpoint once (one manager per directory)"
    )


def _move_aside(final: Location, *, replaceable: bool, replace_committed: bool) -> None:
    """Moves the directory at ``final`` out of the way if it may be replaced (see
    ``publish``), holding its owner lock meanwhile; raises CheckpointExistsError if not."""
    if not replaceable:
        raise _written_meanwhile(final)
    path = os.path.join(final.url, OWNER_FILE)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    except FileNotFoundError:
        return  # gone meanwhile: the rename may go ahead
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _written_meanwhile(final) from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        committed = final.exists(COMMIT_FILE)
        if not same or (committed and not replace_committed):
            raise _written_meanwhile(final)
        aside = final.parent().join(f"{final.name}.tmp-replaced-{uuid.uuid4().hex[:8]}")
        log.info("jaxckpt: replacing %s (%s)", final.url, "committed" if committed else "leftover")
        if committed:
            final.delete_file(COMMIT_FILE)
        os.rename(final.url, aside.url)
    finally:
        os.close(fd)
    aside.remove()


@dataclass(frozen=True)
class Scan:
    """The step directories under a directory: those that are ``committed`` (marker and the
    ``require``d file), and those ``broken``: marked but missing that file (an older
    version's lost save, another tool's crash, a hand's deletion), which no reader can use."""

    committed: list[int]
    broken: list[int]


def scan(directory: Location, require: str | None = None) -> Scan:
    """Lists the step directories under ``directory`` (one listing on object stores)."""
    if directory.is_local:
        names = [n for n in directory.list_children() if n.isdigit()]

        def has(name: str, file: str) -> bool:
            return os.path.exists(os.path.join(directory.url, name, file))

    else:
        keys = set(directory.list_keys())
        names = sorted({k.split("/", 1)[0] for k in keys if k.split("/", 1)[0].isdigit()})

        def has(name: str, file: str) -> bool:
            return f"{name}/{file}" in keys

    marked = [n for n in names if has(n, COMMIT_FILE)]
    good = [n for n in marked if require is None or has(n, require)]
    return Scan(sorted(int(n) for n in good), sorted(int(n) for n in set(marked) - set(good)))


def committed(directory: Location, require: str | None = None) -> list[int]:
    """The committed steps under ``directory`` (numeric names with the marker, and the
    ``require``d file), sorted."""
    return scan(directory, require).committed


def delete(path: Location) -> None:
    """Deletes a committed step directory, its marker first."""
    path.delete_file(COMMIT_FILE)
    path.remove()


def clean_leftovers(directory: Location, *, grace_s: float) -> list[str]:
    """Removes the temporary and unmarked step directories under ``directory``, except those
    a live save still writes (it holds their owner lock, ``storage.being_written``)."""
    removed = []
    for name in directory.list_children():
        child = directory.join(name)
        if name.startswith(_CLAIM):
            if not _claim_abandoned(name, child):
                continue
        elif not (".tmp-" in name or (name.isdigit() and not child.exists(COMMIT_FILE))):
            continue
        if being_written(child, grace_s):
            log.info("jaxckpt: leaving %s alone: a save is writing it", child.url)
            continue
        log.info("jaxckpt: removing leftover %s", child.url)
        child.remove()
        removed.append(name)
    return removed


def _claim_abandoned(name: str, hidden: Location) -> bool:
    """Whether the claim ``.init-<host>-<pid>-<id>`` was killed before its rename: its
    process is gone (this host), or it is a minute old (another host: no pids to ask)."""
    host, _, pid = name[len(_CLAIM) :].rpartition("-")[0].rpartition("-")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            pass
        return False
    try:
        return time.time() - os.path.getmtime(hidden.url) > 60
    except FileNotFoundError:
        return False
