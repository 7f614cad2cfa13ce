"""Run-time figures of saves and restores: per-phase seconds, bytes and GB/s.

Reported through ``jax.monitoring`` (the channel JAX and Orbax use, so dashboards that
listen there see them), at DEBUG level on the ``jaxckpt`` logger, and kept: the figures of
this thread's last save and restore (``last``), and on a manager (``last_save_figures``,
``last_restore_figures``). Event names (docs/CLI.md lists them):

    /jaxckpt/<op>/<phase>_secs   durations (record_event_duration_secs)
    /jaxckpt/<op>/total_secs
    /jaxckpt/<op>/bytes          scalars (record_scalar): this process's bytes
    /jaxckpt/<op>/gbps           this process's bytes / total seconds / 1e9

with ``op`` ``save`` (phases ``describe``, ``write``, ``commit``), ``restore`` (``plan``,
``read``, ``move``), ``manager_save`` (``blocking``: the part of an async save on the
calling thread), or the emergency tier's ``emergency_save`` (``remote``, ``local``,
``peer_exchange``: on the calling thread), ``emergency_write`` (``peer_wait``, ``write``:
the local step's writer) and ``emergency_restore`` (``plan``, ``read``, ``move``,
``place``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import jax

log = logging.getLogger("jaxckpt")
_last = threading.local()


@dataclass(frozen=True)
class Figures:
    """One save's or restore's figures on this process: what :func:`jaxckpt.save` returns,
    and a manager's ``last_save_figures`` / ``last_restore_figures``.

    op: ``"save"``, ``"restore"``, ``"manager_save"``, ``"emergency_save"``... (see above).
    path: the checkpoint. bytes: this process's bytes written or read. phases: seconds per
    phase. total_s: seconds from start to end.
    """

    op: str
    path: str
    bytes: int
    phases: Mapping[str, float]
    total_s: float

    @property
    def gbps(self) -> float:
        """This process's bytes / total seconds / 1e9."""
        return self.bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0


@dataclass
class Stopwatch:
    """Times the phases of one operation; ``done`` reports them and returns the Figures."""

    op: str
    path: str
    bytes: int = 0
    phases: dict[str, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    _lap: float | None = field(default=None, repr=False)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the block as phase ``name`` (added up if it runs several times)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - t

    def lap(self, name: str) -> None:
        """Ends phase ``name``: the time since the previous lap (or the start)."""
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - (self._lap or self.started)
        self._lap = now

    def done(self) -> Figures:
        """Stamps the total, reports the figures and keeps them as this thread's last."""
        fig = Figures(
            self.op, self.path, self.bytes, dict(self.phases), time.perf_counter() - self.started
        )
        for name, secs in fig.phases.items():
            jax.monitoring.record_event_duration_secs(f"/jaxckpt/{fig.op}/{name}_secs", secs)
        jax.monitoring.record_event_duration_secs(f"/jaxckpt/{fig.op}/total_secs", fig.total_s)
        jax.monitoring.record_scalar(f"/jaxckpt/{fig.op}/bytes", float(fig.bytes))
        jax.monitoring.record_scalar(f"/jaxckpt/{fig.op}/gbps", fig.gbps)
        log.debug(
            "jaxckpt %s %s: %d bytes in %.3f s (%.3f GB/s); %s",
            fig.op,
            fig.path,
            fig.bytes,
            fig.total_s,
            fig.gbps,
            ", ".join(f"{k} {v:.3f} s" for k, v in fig.phases.items()),
        )
        setattr(_last, fig.op, fig)
        return fig


def last(op: str) -> Figures | None:
    """This thread's last ``op`` ("save", "restore") figures."""
    return getattr(_last, op, None)
