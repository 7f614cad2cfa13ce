"""Process index/count, barriers and key-value agreement through ``jax.distributed``.

All use of JAX's coordination-service client lives here. With one process every call is a
cheap no-op, so single-host code pays nothing. Every wait has a timeout; a timeout raises
:class:`CoordinationError` naming the processes that did not arrive. A wait given a
``check`` (a save that can be cancelled) polls the key-value store in slices and calls
``check`` between them, so a cancel stops it within a slice: JAX's ``wait_at_barrier``
cannot be interrupted. ``together`` runs a block on every process and then waits for all
of them at a barrier; a process whose block failed (a stalled read) opens that barrier with
its error, so the others raise at once, naming it, instead of waiting out the timeout. Time
spent in coordination is accumulated in :data:`STATS` (see :func:`coordination_stats`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import re
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import jax

from ..errors import CoordinationError, SaveCancelledError

_counter = itertools.count()
WAIT_SLICE_S = 0.25  # an interruptible wait calls its check this often
Check = Callable[[], None]  # raises (SaveCancelledError) to stop an interruptible wait
AFTER_SAVE = "Nothing was committed; restart the job to restore the previous checkpoint"

# Cheap counters: seconds and calls spent in barriers and key-value traffic. ``protocol_s``
# is the coordination's own latency: for each barrier, release minus the last process's
# arrival; plus the key-value calls. Unlike ``barrier_s`` it leaves out time spent waiting
# for slower processes to finish their work.
# Measuring it costs one extra key-value listing per barrier, so it is off unless
# ``JAXCKPT_PROTOCOL_TIMING=1`` (bench/scale.py sets it).
STATS: dict[str, float] = {
    "barrier_s": 0.0,
    "kv_s": 0.0,
    "protocol_s": 0.0,
    "barriers": 0,
    "kv_calls": 0,
}
_PROTOCOL_TIMING = os.environ.get("JAXCKPT_PROTOCOL_TIMING") == "1"


def coordination_stats(reset: bool = False) -> dict[str, float]:
    """A copy of the coordination timers; ``reset`` zeroes them afterwards."""
    out = dict(STATS)
    if reset:
        STATS.update(dict.fromkeys(STATS, 0))
    return out


@contextmanager
def _timed(kind: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        spent = time.perf_counter() - t
        STATS[f"{kind}_s"] += spent
        STATS["barriers" if kind == "barrier" else "kv_calls"] += 1
        if kind == "kv":
            STATS["protocol_s"] += spent


process_index = jax.process_index
process_count = jax.process_count


def host_name() -> str:
    """This process's machine: ``$JAXCKPT_HOST`` if set (containers whose hostnames do not
    identify the machine), else the hostname."""
    return os.environ.get("JAXCKPT_HOST") or socket.gethostname()


_HOSTS: list[str] | None = None


def process_hosts(timeout_s: float) -> list[str]:
    """Every process's ``host_name()``, in process order: one key-value round per job, the
    first time it is asked (every process must ask at the same point)."""
    global _HOSTS
    if _HOSTS is None or len(_HOSTS) != process_count():
        _HOSTS = all_gather("jaxckpt/process_hosts", host_name(), timeout_s, what="hosts")
    return _HOSTS


def _client() -> Any:  # jaxlib's DistributedRuntimeClient (its _jax module has no stubs)
    from jax._src import distributed

    client = distributed.global_state.client
    if client is None:
        raise CoordinationError(
            "jax.process_count() > 1 but jax.distributed is not initialized; call "
            "jax.distributed.initialize() before saving or restoring"
        )
    return client


def client() -> Any:
    """The coordination service's client (key-value calls other modules make themselves)."""
    return _client()


def unique_name(prefix: str) -> str:
    """A name that is the same on every process for the n-th call with this prefix."""
    return f"jaxckpt/{prefix}/{next(_counter)}"


_TIMED_OUT = re.compile(r"timed out task names:\s*((?:\S+\s*)+)", re.IGNORECASE)


def _missing(error: Exception) -> list[int]:
    """Processes the coordination service says never reached a barrier (may be a subset)."""
    match = _TIMED_OUT.search(str(error))
    if not match:
        return []
    tokens = re.split(r"[\s,]+", match.group(1))
    return sorted({int(t) for t in itertools.takewhile(str.isdigit, tokens)})


def barrier(
    name: str,
    timeout_s: float,
    *,
    what: str = "",
    check: Check | None = None,
    then: str = AFTER_SAVE,
) -> None:
    """Waits until every process reaches ``name``; raises CoordinationError on timeout.

    ``what`` (e.g. the checkpoint path) is named in the error, with the processes that never
    arrived (as the coordination service reports them), and ``then``: what it means and
    what to do. With ``check``, an interruptible barrier of key-value calls (see
    :func:`_interruptible_barrier`).
    """
    if process_count() == 1:
        return
    if check is not None:
        _interruptible_barrier(name, timeout_s, what, check, then=then)
        return
    client = _client()
    try:
        arrived = time.time()
        with _timed("barrier"):
            client.wait_at_barrier(name, int(timeout_s * 1000))
        if _PROTOCOL_TIMING:  # instrumentation only, after the barrier: off the clock
            released = time.time()
            client.key_value_set(f"{name}/arrived/{process_index()}", repr(arrived))
            last = max(
                float(client.blocking_key_value_get(f"{name}/arrived/{p}", 60_000))
                for p in range(process_count())
            )
            STATS["protocol_s"] += max(0.0, released - last)
    except Exception as e:  # the client raises XlaRuntimeError / JaxRuntimeError
        who = "not every process arrived"
        if missing := _missing(e):
            who = f"process(es) {missing} of {process_count()} never arrived"
        first = (str(e).splitlines()[0] if str(e) else type(e).__name__).rstrip(".")
        raise CoordinationError(
            f"{what + ': ' if what else ''}barrier {name!r}: {who} within {timeout_s:g}s "
            f"(this is process {process_index()}): {first}. Those processes died, hang or "
            f"are saving something else; check their logs. {then}"
        ) from e


def _interruptible_barrier(
    name: str,
    timeout_s: float,
    what: str,
    check: Check | None,
    *,
    group: Sequence[int] | None = None,
    then: str = AFTER_SAVE,
) -> None:
    """A barrier of key-value calls among the processes of ``group`` (default: all): each
    marks its arrival and counts itself in; the last one opens it, and the others wait for
    that key, in slices with ``check`` between them where there is one. Three key-value
    calls a process, and a listing only on timeout (to name who never arrived). A process
    that fails instead of arriving may open it with its error (``together``): the others
    then raise CoordinationError naming it."""
    client = _client()
    members = list(range(process_count())) if group is None else sorted(group)
    opened: str | None = None
    with _timed("barrier"):
        client.key_value_set(f"{name}/at/{process_index()}", "")
        if client.key_value_increment(f"{name}/count", 1) == len(members):
            with contextlib.suppress(Exception):  # (a failed process opened it already)
                client.key_value_set(f"{name}/open", "")
            return
        try:
            if check is not None:
                opened = wait_key(f"{name}/open", timeout_s, check)
            else:
                opened = str(client.blocking_key_value_get(f"{name}/open", int(timeout_s * 1000)))
        except Exception as e:
            if not isinstance(e, CoordinationError) and "DEADLINE_EXCEEDED" not in str(e):
                raise
            arrived = {
                int(k.rsplit("/", 1)[-1]) for k, _ in client.key_value_dir_get(f"{name}/at/")
            }
    if opened is not None:
        if opened:
            raise _failed_elsewhere(name, opened, what, then)
        return
    missing = sorted(set(members) - arrived)
    raise CoordinationError(
        f"{what + ': ' if what else ''}barrier {name!r}: process(es) {missing} of "
        f"{len(members)} never arrived within {timeout_s:g}s (this is process "
        f"{process_index()}). Those processes died, hang or are saving something else; check "
        f"their logs. {then}"
    )


@contextmanager
def together(
    name: str,
    timeout_s: float,
    *,
    what: str = "",
    processes: Sequence[int] | None = None,
    then: str = AFTER_SAVE,
) -> Iterator[None]:
    """Runs the block, then waits at barrier ``name`` until every process of ``processes``
    (default: all; every one of them must run it, this one among them) has run it.

    An error in the block is told to the others before it raises here: it opens the barrier
    with this process's index, host and error, so they raise CoordinationError naming it at
    once instead of waiting out ``timeout_s`` (a restore's stalled read fails every process
    of the job within the stall bound). A process that never arrives and told nothing (it
    died or hangs) is named when ``timeout_s`` runs out."""
    group = list(range(process_count())) if processes is None else sorted(set(processes))
    if len(group) <= 1:
        yield
        return
    try:
        yield
    except BaseException as e:
        _tell_failure(name, e)
        raise
    _interruptible_barrier(name, timeout_s, what, None, group=group, then=then)


def _tell_failure(name: str, error: BaseException) -> None:
    """Opens barrier ``name`` with this process's failure (see ``together``); never raises
    (a second failed process finds it opened already)."""
    text = str(error).strip() or type(error).__name__
    failure = {"process": process_index(), "host": host_name(), "error": text[:4000]}
    with contextlib.suppress(Exception):
        _client().key_value_set(f"{name}/open", json.dumps(failure))


def _failed_elsewhere(name: str, opened: str, what: str, then: str) -> CoordinationError:
    """The error of a process whose barrier ``name`` another opened with its failure."""
    try:
        failure = json.loads(opened)
        who = f"process {int(failure['process'])} (host {failure['host']})"
        error = str(failure["error"])
    except (ValueError, KeyError, TypeError):
        who, error = "another process", opened
    return CoordinationError(
        f"{what + ': ' if what else ''}{who} failed instead of reaching barrier {name!r} "
        f"(this is process {process_index()}): {error}. {then}"
    )


def wait_key(key: str, timeout_s: float, check: Check) -> str:
    """The value of ``key`` once some process sets it, waiting at most ``timeout_s``
    (CoordinationError) in slices of :data:`WAIT_SLICE_S`, with ``check()`` between them."""
    client = _client()
    deadline = time.monotonic() + timeout_s
    while True:
        check()
        left = deadline - time.monotonic()
        try:
            return str(
                client.blocking_key_value_get(key, max(1, int(min(WAIT_SLICE_S, left) * 1000)))
            )
        except Exception as e:  # the client raises JaxRuntimeError
            if "DEADLINE_EXCEEDED" not in str(e) or time.monotonic() >= deadline:
                raise CoordinationError(
                    f"nobody set {key!r} within {timeout_s:g}s (this is process "
                    f"{process_index()}): {str(e).splitlines()[0] if str(e) else e!r}"
                ) from e


def count(key: str, add: int = 0) -> int:
    """Adds ``add`` to the counter ``key`` (atomically, on the coordination service) and
    returns its new value (0 for a counter never added to)."""
    client = _client()
    if add:
        return int(client.key_value_increment(key, add))
    try:
        return int(client.key_value_try_get(key))
    except Exception as e:  # NOT_FOUND
        if "NOT_FOUND" in str(e):
            return 0
        raise


def send_text(name: str, to: int, text: str) -> None:
    """Leaves ``text`` for process ``to`` under ``name`` (:func:`receive_text` takes it)."""
    _client().key_value_set(f"{name}/{process_index()}->{to}", text)


def receive_text(name: str, sender: int, timeout_s: float, check: Check | None = None) -> str:
    """What ``sender`` left for this process under ``name``; the key is deleted once read,
    so the coordination service keeps nothing per save. ``check``: see :func:`wait_key`."""
    key = f"{name}/{sender}->{process_index()}"
    client = _client()
    try:
        if check is not None:
            text = wait_key(key, timeout_s, check)
        else:
            text = client.blocking_key_value_get(key, int(timeout_s * 1000))
    except SaveCancelledError:
        raise
    except Exception as e:
        raise CoordinationError(
            f"process {sender} sent nothing under {name!r} within {timeout_s:g}s (this is "
            f"process {process_index()}); it died or is saving something else; check its log"
        ) from e
    client.key_value_delete(key)
    return text


def all_gather(name: str, value: str, timeout_s: float, *, what: str = "") -> list[str]:
    """Every process's ``value``, in process order (one set, one barrier, one listing)."""
    if process_count() == 1:
        return [value]
    return _exchange(name, value, timeout_s, what, everyone=True)


def gather(
    name: str, value: str, timeout_s: float, *, what: str = "", check: Check | None = None
) -> list[str]:
    """Every process's ``value`` in process order on process 0, [] on the others: one set
    each, one barrier (which every process passes only once all have set theirs), one
    listing: O(processes) key-value traffic. The values are deleted once read, so that the
    coordination service keeps nothing of each save."""
    if process_count() == 1:
        return [value]
    values = _exchange(name, value, timeout_s, what, everyone=False, check=check)
    if values:
        with _timed("kv"):
            _client().key_value_delete(f"{name}/value")  # the directory: every process's
    return values


def decided(
    name: str, value: str, decide: Callable[[list[str]], str], timeout_s: float, *, what: str = ""
) -> str:
    """What process 0 makes of every process's ``value`` (``decide(values)``, in process
    order), on every process: O(processes) key-value traffic, where ``all_gather`` moves
    O(processes^2). ``decide`` must not raise (the others would wait for nothing)."""
    if process_count() == 1:
        return decide([value])
    values = _exchange(name, value, timeout_s, what, everyone=False)
    client, key = _client(), f"{name}/decided"
    if process_index() == 0:
        out = decide(values)
        with _timed("kv"):
            client.key_value_set(key, out)
        return out
    try:
        with _timed("kv"):
            return str(client.blocking_key_value_get(key, int(timeout_s * 1000)))
    except Exception as e:
        raise CoordinationError(
            f"{what + ': ' if what else ''}process 0 published no decision for {name!r} within "
            f"{timeout_s:g}s (this is process {process_index()}): {e}. It died or hangs; check "
            "its log"
        ) from e


def _exchange(
    name: str, value: str, timeout_s: float, what: str, everyone: bool, check: Check | None = None
) -> list[str]:
    """Sets this process's ``value`` under ``name``, waits for every process at a barrier,
    and returns every process's value in process order: on every process if ``everyone``,
    else on process 0 only (the others get [])."""
    client = _client()
    with _timed("kv"):
        client.key_value_set(f"{name}/value/{process_index()}", value)
    barrier(name, timeout_s, what=what, check=check)
    if not everyone and process_index() != 0:
        return []
    with _timed("kv"):
        entries = client.key_value_dir_get(f"{name}/value/")
    by_pid = {int(k.rsplit("/", 1)[-1]): v for k, v in entries}
    return [by_pid[p] for p in range(process_count())]


@dataclass(frozen=True)
class Agreement:
    """What ``agree`` returns: process 0's ``extra`` everywhere, every process's ``extra``
    on process 0 only (nobody else needs them, and gathering them everywhere would move
    O(processes^2) bytes through the coordinator)."""

    first: str
    all: list[str] | None


def agree(
    name: str,
    description: dict,
    timeout_s: float,
    *,
    what: str = "",
    extra: str = "",
    check: Check | None = None,
) -> Agreement:
    """Raises CoordinationError on every process unless all give the same ``description``.

    Only a short hash and a summary travel through the key-value store, with ``extra`` (a
    per-process string that is not compared). Process 0 reads every value and publishes a
    verdict that the others read: O(processes) key-value traffic.
    """
    if process_count() == 1:
        return Agreement(extra, [extra])
    full = json.dumps(description, sort_keys=True, default=str)
    digest = hashlib.sha256(full.encode()).hexdigest()[:16]
    summary = {k: v for k, v in description.items() if k in ("path", "leaves")}
    message = json.dumps({"h": digest, "x": extra, **summary})
    values = _exchange(name, message, timeout_s, what, everyone=False, check=check)
    client = _client()
    if process_index() == 0:
        got = [json.loads(v) for v in values]
        verdict = {"error": _disagreement(got, what), "first": got[0]["x"]}
        with _timed("kv"):
            client.key_value_set(f"{name}/verdict", json.dumps(verdict))
        extras = [g["x"] for g in got]
    else:
        try:
            with _timed("kv"):
                key = f"{name}/verdict"
                verdict = json.loads(
                    wait_key(key, timeout_s, check)
                    if check is not None
                    else client.blocking_key_value_get(key, int(timeout_s * 1000))
                )
        except SaveCancelledError:
            raise
        except Exception as e:
            raise CoordinationError(
                f"{what + ': ' if what else ''}process 0 published no verdict for {name!r} "
                f"within {timeout_s:g}s (this is process {process_index()}): {e}. It died or "
                "hangs; check its log. Nothing was written"
            ) from e
        extras = None
    if verdict["error"]:
        raise CoordinationError(verdict["error"])
    return Agreement(verdict["first"], extras)


def _disagreement(got: list[dict], what: str) -> str | None:
    groups: dict[str, list[int]] = {}
    for pid, g in enumerate(got):
        groups.setdefault(g["h"], []).append(pid)
    if len(groups) == 1:
        return None
    lines = "; ".join(
        f"process(es) {pids}: path {got[pids[0]].get('path')}, "
        f"{got[pids[0]].get('leaves')} leaves, tree/shape/dtype hash {h}"
        for h, pids in groups.items()
    )
    return (
        f"{what + ': ' if what else ''}processes disagree on what to save ({lines}); nothing "
        "was written. Every process must call save with the same step/path and the same tree "
        "structure, shapes and dtypes"
    )
