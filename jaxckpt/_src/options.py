"""``Options`` and ``EmergencyOptions``: how the managers save, keep and time out; readable
from TOML files."""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeGuard

from ..errors import OptionsError
from .io.codecs import parse as parse_compression

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["AUTO", "CONTINUOUS", "EmergencyOptions", "Options", "OptionsError", "is_auto"]

AUTO = "auto"
"""An interval chosen from measured costs and an MTBF (``jaxckpt._src.goodput.intervals``)."""


def is_auto(value: object) -> TypeGuard[Literal["auto"]]:
    """Whether an interval option is ``"auto"`` rather than a number of steps."""
    return isinstance(value, str) and value == AUTO


CONTINUOUS = "continuous"
"""The next save is due at the first step after the previous one committed
(``jaxckpt._src.goodput.cadence``)."""


@dataclass(frozen=True)
class Options:
    """Policies of a :class:`CheckpointManager`.

    save_interval_steps: save when ``step % save_interval_steps == 0`` (``force`` overrides),
        or ``"auto"``: an interval that maximizes the expected effective training time
        ratio given the measured step, save and restore times and the MTBF, re-chosen as the
        measurements change, within [``min_interval_steps``, ``max_interval_steps``], or
        ``"continuous"``: the first step after the previous save committed (the next save
        starts as soon as the last one is written; needs ``async_save``).
    mtbf_hours: mean time between failures of one host, in hours (the job's is this over
        the process count, refined by the failures in the run log); needed by ``"auto"``.
    run_log: append the run's events to ``<directory>/runlog/`` (``jaxckpt goodput``).
    heartbeat_s: the log notes the step reached at most this often (a finer account of
        the steps a failure loses; 0: at every ``save`` call).
    max_to_keep: committed steps kept (the newest ones, or the best ones with ``best_fn``);
        None keeps all. The newest step is never deleted.
    keep_period: steps that are multiples of it are kept forever, in addition to the
        ``max_to_keep`` newest (or best).
    best_fn / best_mode: rank steps by ``best_fn(metrics)``, lower (``"min"``) or higher
        (``"max"``) is better; ``best_metric = "loss"`` in a file means ``m["loss"]``.
    async_save: ``save`` returns after the device->host copy; a background thread writes.
    staging_budget_bytes: host memory for that copy; a state bigger than it is saved
        synchronously instead (None: no limit).
    step_digits: zero padding of step directory names (``00001000``).
    create: create the directory if missing. cleanup_tmp: delete leftovers of
        interrupted saves when the manager starts.
    timeout_s: bound on every cross-process wait and on ``close``.
    compression: None (raw), ``"zstd"`` (zstd, level 3) or ``"blosc"`` (blosc's byte
        shuffle by the element's size, then zstd, level 1: the exponent bytes of float
        weights are compressed apart from their mantissas, to fewer bytes than zstd alone
        gives, for less CPU: docs/MEASURED.md); a level after a colon picks another
        (``"zstd:9"``, ``"blosc:5"``). TensorStore writes and reads compressed leaves (the
        direct paths take raw ones only); a blosc save keeps each chunk to at most 1 GiB.
        None for the emergency tier's remote too (why: docs/MEASURED.md).
    chunk_bytes: store each shard as chunks of at most this many bytes (see
        ``jaxckpt.save``); None: chunks follow the shards.
    read_budget_bytes: host memory for slices read but not yet on a device during a
        restore (None: 64 MiB per reader thread, at least 128 MiB; ``inflight.default_budget``).
    stall_timeout_s: a restore's read that makes no progress this long fails with
        ``ReadStalledError`` naming the process, its host, the file or object and how long;
        the job's other processes then fail at their barrier naming it (``jaxckpt.restore``).
    drop_page_cache: keep a save's files out of the page cache (local directories): their
        pages are dropped as they are written, so a save of any size holds a few hundred
        MiB of cache at most instead of its whole size, and does not evict what training
        reads. A restore of the step then reads from the disk. (TensorStore writes through
        the cache: this is what O_DIRECT would give, done with ``posix_fadvise``; Linux.)
    direct_io: write a save's local files with O_DIRECT: the bytes go from the host buffers
        to the disk without entering the page cache at all (``ocdbt_write``; a compressed
        save, or a filesystem without O_DIRECT such as tmpfs, falls back to
        ``drop_page_cache``'s way). A restore of the step then reads from the disk. None
        (the default): O_DIRECT where the directory is on a disk filesystem (ext4, xfs,
        btrfs; ``io.linux.DIRECT_IO_FILESYSTEMS``) and jaxckpt writes the files itself
        (uncompressed), else through the page cache; False: always through it.
    """

    save_interval_steps: int | Literal["auto", "continuous"] = 1
    max_to_keep: int | None = None
    keep_period: int | None = None
    best_fn: Callable[[dict], float] | None = None
    best_mode: str = "min"
    async_save: bool = True
    staging_budget_bytes: int | None = None
    step_digits: int = 8
    create: bool = True
    cleanup_tmp: bool = True
    timeout_s: float = 600.0
    compression: str | None = None
    chunk_bytes: int | None = None
    read_budget_bytes: int | None = None
    stall_timeout_s: float = 300.0
    mtbf_hours: float | None = None
    min_interval_steps: int = 1
    max_interval_steps: int = 10_000
    run_log: bool = True
    heartbeat_s: float = 30.0
    drop_page_cache: bool = False
    direct_io: bool | None = None
    read_only: bool = False
    lease_stale_s: float = 60.0
    take_over_lease: bool = False
    preemption_signals: tuple[str | int, ...] = ("SIGTERM",)
    preemption_grace_s: float = 20.0

    def __post_init__(self) -> None:
        _preemption(self)
        _interval(self, "save_interval_steps", "min_interval_steps", "max_interval_steps")
        _continuous_needs_async(self, "save_interval_steps")
        _at_least(self, 0, "heartbeat_s")
        _at_least(
            self, 1, "read_budget_bytes", "chunk_bytes", "max_to_keep", "keep_period", none=True
        )
        if not self.stall_timeout_s > 0:
            raise OptionsError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if self.best_mode not in ("min", "max"):
            raise OptionsError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        parse_compression(self.compression)

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> Options:
        """Reads a TOML option file (see ``configs/``); unknown keys are an error.

        TOML has no null: leave a key out to keep its default (None where it is None).

        >>> Options.from_file("configs/default.toml", max_to_keep=3)
        """
        return cls.from_dict(option_file(path), where=os.fspath(path), **overrides)

    @classmethod
    def from_dict(cls, doc: dict, *, where: str = "options", **overrides: Any) -> Options:
        doc = dict(doc)
        known_options(cls, doc, where=where, extra=("best_metric",), exclude=("best_fn",))
        metric = doc.pop("best_metric", None)
        if metric is not None:
            doc["best_fn"] = _metric_getter(str(metric))
        doc.update(overrides)
        try:
            return cls(**doc)
        except TypeError as e:
            raise OptionsError(f"{where}: {e}") from e


def _metric_getter(name: str) -> Callable[[dict], float]:
    def get(metrics: dict) -> float:
        return float(metrics[name])

    get.__name__ = f"metric[{name!r}]"
    return get


REMOTE_DEFAULTS: dict[str, Any] = {  # EmergencyOptions.remote's fields unless given
    "save_interval_steps": 1000,
    "max_to_keep": 3,
    "max_interval_steps": 100_000,
}


def _remote_default() -> Options:
    return Options(**REMOTE_DEFAULTS)


@dataclass(frozen=True)
class EmergencyOptions:
    """Policies of an :class:`EmergencyCheckpointManager`: its local tier and the manager
    itself here, its remote tier in ``remote``.

    local_interval_steps: save to the local tier when ``step`` is a multiple of it
        (``force=True`` saves both tiers), or ``"auto"`` (see ``Options``), chosen within
        [``min_interval_steps``, ``max_interval_steps``] from ``mtbf_hours``, or
        ``"continuous"``: the first step after the previous local save committed (needs
        ``async_save``; the remote tier's ``save_interval_steps`` takes it too).
    mtbf_hours: mean time between failures of one host, in hours; needed by ``"auto"``.
    local_max_to_keep: committed local steps kept (None: all).
    replication: how many other processes (on other hosts where the layout allows) keep a
        copy of each process's local shards.
    async_save: a local save returns after the device->host copy, with the peer copies in
        flight.
    timeout_s: bound on every cross-process wait of this manager and its local tier.
    step_digits: zero padding of the local step directories' names (``00001000``).
    drop_page_cache: keep the local tier's files out of the page cache as they are written
        (see ``Options``); a restore from local copies then reads from the disk.
    direct_io: write the local tier's files with O_DIRECT (see ``Options``). None (the
        default) or False: through the page cache (a process restarted on its host reads
        its step back from memory).
    lease_stale_s / take_over_lease: the writer's lease on each process's local directory
        (see ``Options``).
    run_log / heartbeat_s: this manager's run log, kept in both tiers' directories
        (``runlog/``), and how often it notes the step reached (0: every ``save``).
    preemption_signals / preemption_grace_s: see ``Options`` and ``reached_preemption``;
        the grace is what a remote save in flight gets after the notice.
    remote: the remote tier: the :class:`Options` of the ``CheckpointManager`` that writes
        it, every field as for that manager (``save_interval_steps``,
        ``min_interval_steps``/``max_interval_steps`` and ``mtbf_hours`` set when it saves;
        ``max_to_keep``, ``keep_period``, ``compression``, ``chunk_bytes``,
        ``read_budget_bytes``, ``timeout_s``, ``async_save``, its lease, ``direct_io``...),
        except ``run_log``, ``heartbeat_s`` and the preemption fields, which are the ones
        above (this manager logs both tiers and watches for the notice). Default: a save
        every 1000 steps (``"auto"``: up to 100,000), 3 kept, the rest as ``Options()``.
        An ``Options`` given here is a whole record: set ``save_interval_steps`` in it, or
        the remote tier saves at every step (``Options()``'s 1); a file's ``[remote]`` table
        changes only the keys it names.
    """

    local_interval_steps: int | Literal["auto", "continuous"] = 10
    # the rest by keyword only: the second field was remote_interval_steps before 0.1.0, and
    # an old call giving it by position fails instead of setting another field
    _: dataclasses.KW_ONLY
    local_max_to_keep: int | None = 2
    replication: int = 0
    async_save: bool = True
    timeout_s: float = 600.0
    step_digits: int = 8
    mtbf_hours: float | None = None
    min_interval_steps: int = 1
    max_interval_steps: int = 10_000
    run_log: bool = True
    heartbeat_s: float = 30.0
    drop_page_cache: bool = False
    direct_io: bool | None = None
    lease_stale_s: float = 60.0
    take_over_lease: bool = False
    preemption_signals: tuple[str | int, ...] = ("SIGTERM",)
    preemption_grace_s: float = 20.0
    remote: Options = dataclasses.field(default_factory=_remote_default)

    def __post_init__(self) -> None:
        _preemption(self)
        _interval(self, "local_interval_steps", "min_interval_steps", "max_interval_steps")
        _continuous_needs_async(self, "local_interval_steps")
        _at_least(self, 0, "heartbeat_s")
        _at_least(self, 1, "local_max_to_keep", none=True)
        _at_least(self, 0, "replication")
        if not isinstance(self.remote, Options):
            raise OptionsError(
                f"remote must be a jaxckpt.Options (the remote tier's), got {self.remote!r}"
            )

    @classmethod
    def from_file(cls, path: str | os.PathLike, **overrides: Any) -> EmergencyOptions:
        """Reads a TOML option file (see ``configs/emergency_gpu.toml``): the remote tier's
        options in its ``[remote]`` table, as an ``Options`` file holds them."""
        doc = option_file(path)
        known_options(cls, doc, where=os.fspath(path))
        remote = doc.pop("remote", None)
        if remote is not None:
            if not isinstance(remote, dict):
                raise OptionsError(f"{os.fspath(path)}: remote must be a table ([remote])")
            doc["remote"] = Options.from_dict(  # its keys replace the remote defaults'
                {**REMOTE_DEFAULTS, **remote}, where=f"{os.fspath(path)} [remote]"
            )
        try:
            return cls(**{**doc, **overrides})
        except TypeError as e:
            raise OptionsError(f"{os.fspath(path)}: {e}") from e


def _preemption(options: Any) -> None:
    """Checks the lease and preemption fields shared by both option classes."""
    if not options.lease_stale_s > 0:
        raise OptionsError(f"lease_stale_s must be > 0 seconds, got {options.lease_stale_s!r}")
    if not options.preemption_grace_s >= 0:
        raise OptionsError(
            f"preemption_grace_s must be >= 0 seconds, got {options.preemption_grace_s!r}"
        )
    object.__setattr__(options, "preemption_signals", tuple(options.preemption_signals))
    signal_numbers(options.preemption_signals)


def signal_numbers(names: tuple[str | int, ...]) -> tuple[int, ...]:
    """``("SIGTERM", 10)`` -> their numbers; an unknown name is an OptionsError."""
    import signal

    out = []
    for name in names:
        try:
            out.append(int(signal.Signals[name] if isinstance(name, str) else signal.Signals(name)))
        except (KeyError, ValueError):
            raise OptionsError(
                f"preemption_signals: {name!r} is not a signal; use names like 'SIGTERM'"
            ) from None
    return tuple(out)


def _at_least(options: Any, least: int, *names: str, none: bool = False) -> None:
    """Refuses the fields ``names`` of ``options`` below ``least`` (``none``: None is allowed)."""
    for name in names:
        value = getattr(options, name)
        if not (none and value is None) and value < least:
            allowed = f">= {least} or None" if none else f">= {least}"
            raise OptionsError(f"{name} must be {allowed}, got {value}")


def _interval(options: Any, name: str, low: str, high: str) -> None:
    """Checks an interval field (a step count >= 1, ``"continuous"``, or ``"auto"`` with an
    ``mtbf_hours`` to work from) and the bounds ``low`` <= ``high`` of its ``"auto"`` choice."""
    _at_least(options, 1, low)
    if getattr(options, high) < getattr(options, low):
        raise OptionsError(
            f"{high} must be >= {low} ({getattr(options, low)}), got {getattr(options, high)}"
        )
    mtbf, value = options.mtbf_hours, getattr(options, name)
    if mtbf is not None and not (
        isinstance(mtbf, numbers.Real) and not isinstance(mtbf, bool) and 0 < float(mtbf) < math.inf
    ):
        raise OptionsError(f"mtbf_hours must be a number of hours > 0 or None, got {mtbf!r}")
    if is_auto(value):
        if mtbf is None:
            raise OptionsError(
                f"{name}='auto' needs mtbf_hours: pass the mean time between failures "
                "of one host in hours (e.g. mtbf_hours=1000), or a number of steps"
            )
    elif isinstance(value, str) and value == CONTINUOUS:
        pass
    elif isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise OptionsError(
            f"{name} must be a number of steps >= 1, 'auto' or 'continuous', got {value!r}"
        )


def _continuous_needs_async(options: Any, name: str) -> None:
    """Refuses ``"continuous"`` without ``async_save``: every save would commit before
    ``save`` returns, so every step would be saved, each blocking the loop."""
    value = getattr(options, name)
    if isinstance(value, str) and value == CONTINUOUS and not options.async_save:
        raise OptionsError(
            f"{name}='continuous' needs async_save=True (a synchronous save commits before "
            f"save returns, so every step would be saved, each one blocking): set "
            f"async_save=True, or {name}=1 to save every step on purpose"
        )


def option_file(path: str | os.PathLike) -> dict:
    """The table of a TOML option file (``Options`` and ``EmergencyOptions`` read theirs here)."""
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise OptionsError(f"{os.fspath(path)}: not valid TOML: {e}") from e


def known_options(
    cls: type[DataclassInstance],
    doc: dict,
    *,
    where: str,
    extra: tuple[str, ...] = (),
    exclude: tuple[str, ...] = (),
) -> None:
    """Refuses keys of ``doc`` that are not fields of the options class ``cls`` (plus
    ``extra``, less ``exclude``: fields a file cannot set)."""
    known = ({f.name for f in dataclasses.fields(cls)} | set(extra)) - set(exclude)
    unknown = sorted(set(doc) - known)
    if unknown:
        raise OptionsError(
            f"{where}: unknown option(s) {unknown}; known options are {sorted(known)}"
        )
