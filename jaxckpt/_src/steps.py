"""Step directories, for both tiers: the commit that makes one visible, listing the
committed ones, deleting one, and clearing what interrupted saves left behind.

A step directory is committed when it holds ``COMMITTED``, written last: a save writes into
``<step>.tmp-<id>/`` (its writer holding the ``.owner`` lock), renames it into place, then
writes the marker; a deletion removes the marker first. So a half-written or half-deleted
step is never listed or restored.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterator

from ..errors import CheckpointExistsError
from .manifest import COMMIT_FILE
from .storage import (
    OWNER_FILE,
    Location,
    being_written,
    hold_owner_lock,
    release_owner_lock,
    rename_dir,
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
    fd = hold_owner_lock(hidden)
    try:
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
    it, so an earlier committed ``final`` is never touched. On object stores the leftovers
    of an earlier uncommitted attempt at ``final`` are cleared first. In a multi-process
    save only process 0 enters it; the others write into ``work_dir(final, token)``.

    >>> with steps.committing(loc) as work:
    ...     work.write_bytes("data", b"...")
    """
    work = work_dir(final, token or uuid.uuid4().hex[:12])
    if work == final and final.list_children():
        final.remove()
    owner = claim(work)
    try:
        yield work
        publish(work, final, replace_committed=replace_committed, marker=marker)
    except BaseException:
        if work != final:
            work.remove()
        raise
    finally:
        release_owner_lock(owner)


def publish(
    work: Location, final: Location, *, replace_committed: bool = False, marker: bool = True
) -> None:
    """Makes the finished ``work`` directory the committed ``final`` one: rename (local
    filesystems; on object stores ``work`` is ``final``), then the marker. A leftover at
    ``final`` without a marker is replaced; a committed one too with ``replace_committed``,
    else it is an error and nothing is overwritten (always, for ``marker=False``
    directories, which have no marker to tell a leftover from a finished one)."""
    if work != final:
        if os.path.exists(final.url):
            if not marker or (final.exists(COMMIT_FILE) and not replace_committed):
                raise CheckpointExistsError(
                    f"{final.url} was written by another save while this one was writing; "
                    "nothing was overwritten. Save each checkpoint once"
                )
            final.remove()
        rename_dir(work, final)
    if marker:
        final.write_bytes(COMMIT_FILE, b"", create_dir=False)
    final.delete_file(OWNER_FILE)


def committed(directory: Location) -> list[int]:
    """The committed steps under ``directory`` (numeric names with the marker), sorted."""
    return sorted(
        int(n)
        for n in directory.list_children()
        if n.isdigit() and directory.join(n).exists(COMMIT_FILE)
    )


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
