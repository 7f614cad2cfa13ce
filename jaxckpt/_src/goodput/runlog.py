"""The run log: small events (start, step, save, restore, cancel, interval, end) that the
managers append to ``<dir>/runlog/process-<i>.jsonl``, one JSON object a line, and that
``jaxckpt goodput`` reads back. Pure I/O, no analysis (docs/FORMAT.md, "Run log").

Local files are appended with one ``os.write`` of a whole line on an ``O_APPEND`` descriptor,
so a SIGKILL loses at most the last line; object stores have no append, so there each job
rewrites its own object ``process-<i>.<job>.jsonl`` when a save, restore, cancel or end is
logged. Writing never raises: a failed write is logged once and the run goes on.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...errors import RunLogError
from ..storage import Location, location

log = logging.getLogger("jaxckpt")

LOG_VERSION = 1
DIRECTORY = "runlog"
_DURABLE = frozenset({"save", "restore", "cancel", "end"})  # fsynced; written out to object stores
OBJECT_EVERY_S = 60.0
"""A save event rewrites the job's object at most this often (a local save may come every
step, and the rewrite of a long job's log is a PUT of all its lines); the other durable
events always do. The local file has every line at once."""
_BASE = ("v", "t", "event", "job", "process", "step")
_MAX_INT = 2**63  # steps and process indices at or above it are garbage, not figures
_REACHED = frozenset({"save", "step", "end"})


@dataclass(frozen=True)
class Event:
    """One line of the log; ``fields`` are the kind's own (``tier``, ``blocking_s``, ...)."""

    event: str
    t: float
    job: str
    process: int
    step: int | None
    fields: Mapping[str, Any] = field(default_factory=dict)


class RunLog:
    """Appends this process's events to ``runlog/`` under each of ``directories``.

    ``job`` names this job's lines (default: a new id for each log, so two managers of one
    process are two jobs); ``job`` and ``clock`` exist for tests and tools that write a log
    of another time.
    """

    def __init__(
        self,
        directories: Sequence[Location],
        process: int,
        *,
        heartbeat_s: float = 30.0,
        job: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        job = job or new_job()
        self.process, self.heartbeat_s, self.job, self._clock = process, heartbeat_s, job, clock
        self._dirs = [d.join(DIRECTORY) for d in directories]
        self._remote = any(not d.is_local for d in self._dirs)
        self._fds: dict[str, int] = {}
        self._lines: list[bytes] = []  # this job's lines, for the object-store rewrite
        self._lock, self._remote_lock = threading.Lock(), threading.Lock()
        self._written = 0  # lines in the objects written so far
        self._put = -float("inf")  # when the objects were last rewritten
        self._last = -float("inf")
        self._warned = self._closed = False

    def append(self, event: str, step: int | None = None, **fields: Any) -> None:
        """Appends one event to every directory's log; never raises (a failure is logged)."""
        with self._lock:
            if self._closed:
                return
            now = self._last = self._clock()
            doc = {"v": LOG_VERSION, "t": now, "event": event, "job": self.job}
            doc |= {"process": self.process, "step": step}
            doc |= {k: v for k, v in fields.items() if k not in _BASE}
            line = (json.dumps(doc, separators=(",", ":"), default=str) + "\n").encode()
            for d in self._dirs:
                if d.is_local:
                    self._guard(d, functools.partial(self._write_local, d, line, event in _DURABLE))
            if not self._remote:
                return
            self._lines.append(line)
            lines = len(self._lines)
            put = event in _DURABLE and (event != "save" or now - self._put >= OBJECT_EVERY_S)
            if put:
                self._put = now
        if put:  # the object stores, off the lock: a heartbeat never waits on them
            with self._remote_lock:
                if lines > self._written:  # a rewrite holding more lines went first
                    self._written, data = lines, b"".join(self._lines[:lines])
                    name = f"process-{self.process}.{self.job}.jsonl"
                    for d in self._dirs:
                        if not d.is_local:
                            self._guard(d, functools.partial(d.write_bytes, name, data))

    def _guard(self, d: Location, write: Callable[[], object]) -> None:
        try:
            write()
        except Exception as e:  # noqa: BLE001 - a log write never fails a save
            if not self._warned:
                self._warned = True
                log.warning("jaxckpt: cannot write the run log in %s (%s); going on", d.url, e)

    def _write_local(self, d: Location, line: bytes, durable: bool) -> None:
        fd = self._fds.get(d.url)
        fd = self._open(d) if fd is None else fd
        if os.write(fd, line) < len(line):  # (a full disk): end the torn line
            os.write(fd, b"\n")
        if durable:
            os.fsync(fd)

    def _open(self, d: Location) -> int:
        """The append descriptor of ``d``'s file; a torn last line is ended first."""
        os.makedirs(d.url, exist_ok=True)
        path = os.path.join(d.url, f"process-{self.process}.jsonl")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        size = os.fstat(fd).st_size
        if size:
            with open(path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(fd, b"\n")
        self._fds[d.url] = fd
        return fd

    def heartbeat(self, step: int) -> None:
        """Appends a ``step`` event when ``heartbeat_s`` passed since the last append."""
        if self._clock() - self._last >= self.heartbeat_s:
            self.append("step", step)

    def close(self, step: int | None, clean: bool = True) -> None:
        """Appends ``end`` if ``clean`` (else the job reads as failed) and closes the files;
        later calls do nothing."""
        if clean:
            self.append("end", step)
        with self._lock:
            self._closed = True
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


@dataclass(frozen=True)
class Read:
    """The events of one process in time order; ``skipped`` lines were torn, garbled or of a
    newer log version (``notes`` says which)."""

    events: tuple[Event, ...]
    skipped: int
    path: str
    notes: tuple[str, ...] = ()


def read(directory: str | os.PathLike | Location, process: int = 0) -> Read:
    """Reads process ``process``'s log under ``directory`` (its file, or on object stores one
    object per job), merged in time order. Nothing outside ``<directory>/runlog/`` is read."""
    d = location(directory).join(DIRECTORY)
    names = d.list_children()
    pattern = re.compile(rf"process-{process}(\.[A-Za-z0-9_-]+)?\.jsonl")
    mine = [n for n in names if pattern.fullmatch(n)]
    if not mine:
        others = sorted({int(m[1]) for n in names if (m := re.fullmatch(r"process-(\d+)\..*", n))})
        hint = f"pass process= one of {others}" if others else "pass a manager's directory"
        raise RunLogError(
            f"{d.url}: no run log of process {process} (runlog/process-{process}*.jsonl); {hint}"
        )
    events: list[Event] = []
    skipped = newer = 0
    for name in mine:
        try:
            data = _read_file(d, name)
        except OSError as e:
            raise RunLogError(
                f"{d.url}/{name}: cannot read the run log ({e}); check its permissions"
            ) from e
        for raw in data.split(b"\n"):
            if not raw.strip():
                continue
            ev, version = _parse(raw, process)
            newer += version > LOG_VERSION
            skipped += ev is None
            events += [ev] if ev is not None else []
    if not events:
        raise RunLogError(
            f"{d.url}: the run log of process {process} holds no readable event "
            f"({skipped} lines skipped); pass another directory or process"
        )
    notes: list[str] = []
    if newer:
        notes.append(f"{newer} line(s) of a newer run log version skipped: upgrade jaxckpt")
        log.warning("jaxckpt: %s: %s", d.url, notes[0])
    return Read(tuple(sorted(events, key=lambda e: e.t)), skipped, d.url, tuple(notes))


def _read_file(d: Location, name: str) -> bytes:
    if not d.is_local:
        return d.read_bytes(name) or b""
    fd = os.open(os.path.join(d.url, name), os.O_RDONLY | os.O_NOFOLLOW)  # stays in runlog/
    with os.fdopen(fd, "rb") as f:
        return f.read()


def _parse(raw: bytes, process: int) -> tuple[Event | None, int]:
    """The event of one line (None if torn or garbled), and the line's version (0 if none)."""
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):  # (deeply nested garbage)
        return None, 0
    if not isinstance(doc, dict):
        return None, 0
    v, t, kind, job, step = (doc.get(k) for k in ("v", "t", "event", "job", "step"))
    version = v if type(v) is int else 0
    if not (
        0 < version <= LOG_VERSION
        and _finite(t)
        and isinstance(kind, str)
        and isinstance(job, str)
        and type(doc.get("process")) is int
        and doc["process"] == process
        and (step is None or (type(step) is int and 0 <= step < _MAX_INT))
    ):
        return None, version
    fields = {k: x for k, x in doc.items() if k not in _BASE}
    return Event(kind, float(t), job, process, step, fields), version  # type: ignore[arg-type]


def new_job() -> str:
    """A job id: the time it started and a random part."""
    return f"{int(time.time())}-{uuid.uuid4().hex[:8]}"


def _finite(t: Any) -> bool:
    """A number of seconds a float holds (not a bool, not a 400-digit int)."""
    if isinstance(t, bool) or not isinstance(t, int | float):
        return False
    try:
        return math.isfinite(float(t))
    except OverflowError:
        return False


def previous_step(events: Sequence[Event]) -> int | None:
    """The highest step that ``events`` reached (their ``save``, ``step`` and ``end``)."""
    reached = [e.step for e in events if e.event in _REACHED and e.step is not None]
    return max(reached, default=None)
