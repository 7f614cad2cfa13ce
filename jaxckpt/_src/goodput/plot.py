"""The timeline of a run drawn from its log: the step each job reached against wall time,
its saves (a marker per tier), failures (red vertical lines) and restores (green)."""

from __future__ import annotations

import os

from ...errors import MissingDependencyError
from . import runlog
from .report import goodput, number

_MARKERS = {"local": "o", "remote": "s", "dir": "D"}


def plot(run: str | os.PathLike, out_png: str | os.PathLike, *, process: int = 0) -> None:
    """Writes the timeline of ``run``'s log (process ``process``) to ``out_png``."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise MissingDependencyError(
            f"drawing {os.fspath(out_png)} needs matplotlib: pip install matplotlib"
        ) from e
    events = runlog.read(run, process).events
    report = goodput(run, process=process)
    t0 = events[0].t
    fig = Figure(figsize=(10, 5))
    ax = fig.add_subplot()
    for job in dict.fromkeys(e.job for e in events):  # a line per job, in the order they began
        # a save is logged as it commits: its step was reached when it was called
        line = sorted(
            (e.t - t0 - number(e.fields, "write_s") - number(e.fields, "blocking_s"), e.step)
            for e in events
            if e.job == job and e.step is not None and e.event != "cancel"
        )
        if line:
            ax.plot([t for t, _ in line], [s for _, s in line], lw=1, label=f"job {job}")
    saves = [(e.t - t0, e.step, str(e.fields.get("tier"))) for e in events
             if e.event == "save" and e.step is not None]  # fmt: skip
    for tier in sorted({tier for _, _, tier in saves}):
        mine = [(t, step) for t, step, of in saves if of == tier]
        ax.scatter([t for t, _ in mine], [s for _, s in mine], zorder=3,
                   marker=_MARKERS.get(tier, "^"), label=f"save ({tier})")  # fmt: skip
    restores = [(e.t - t0, e.step) for e in events if e.event == "restore" and e.step is not None]
    if restores:
        ax.scatter([t for t, _ in restores], [s for _, s in restores], color="green",
                   marker="P", s=80, zorder=4, label="restore")  # fmt: skip
    for i, loss in enumerate(report.losses):
        ax.axvline(loss.failed_t - t0, color="red", lw=1.5, label="failure" if i == 0 else None)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("step")
    ettr = "-" if report.ettr is None else f"{100 * report.ettr:.1f} %"
    ax.set_title(f"{report.path} (process {process}): ETTR {ettr}, {report.failures} failure(s)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", fontsize="small")
    fig.savefig(os.fspath(out_png), dpi=100)
