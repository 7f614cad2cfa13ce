"""What the benchmarks share: worker processes (one, or a jax.distributed job on 127.0.0.1)
that hand back one ``RESULT <json>`` line, page-cache dropping, medians and GB/s, peak RSS,
tables and PASS/FAIL words, and the results JSON under bench/results/.

A script with workers ends in ``harness.entry(main, worker)``: ``worker(**kwargs)`` runs in
the processes ``run_worker`` / ``run_job`` start and returns what they collect.
Nothing here imports jax: a script sets its devices (``cpu_devices``) before it does.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
GB = 1e9
TAG = "RESULT "
sys.path.insert(0, os.path.join(ROOT, "tests"))

import multiproc  # noqa: E402  (tests/: jax.distributed jobs of N processes on 127.0.0.1)
from iostats import drop_page_cache, io, ts_file_bytes_read  # noqa: E402, F401

# --- processes -----------------------------------------------------------------------------


def cpu_devices(n: int) -> None:
    """``n`` virtual CPU devices for jax in this process (before jax is imported)."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    os.environ["XLA_FLAGS"] = flags.strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def entry(main: Callable[[], None], worker: Callable[..., dict]) -> None:
    """``main()``, or in a worker process ``worker(**kwargs)``, its result printed for the
    parent; a worker of ``run_job`` joins its jax.distributed job first."""
    if sys.argv[1:2] != ["--worker"]:
        return main()
    if "JAXCKPT_COORD" in os.environ:
        multiproc.init()
    print(TAG + json.dumps(worker(**json.loads(sys.argv[2]))), flush=True)


def result(output: str) -> dict:
    """The last ``RESULT`` line of a worker's output."""
    return json.loads([ln for ln in output.splitlines() if ln.startswith(TAG)][-1][len(TAG) :])


def run_worker(script: str, timeout_s: float = 3600, **kwargs) -> dict:
    """``script``'s worker run with ``kwargs`` in a fresh process: what it returned."""
    cmd = [sys.executable, script, "--worker", json.dumps(kwargs)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0 or TAG not in proc.stdout:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise RuntimeError(f"worker {cmd[3]} failed (exit {proc.returncode})")
    return result(proc.stdout)


def run_job(
    script: str, n: int, devices: int = 2, timeout_s: float = 600, env=None, **kwargs
) -> list[dict]:
    """``script``'s worker run with ``kwargs`` as the ``n`` processes of one jax.distributed
    job, ``devices`` CPU devices each: what each returned, by process index."""
    res = multiproc.run(
        script,
        n,
        devices_per_process=devices,
        args=["--worker", json.dumps(kwargs)],
        timeout_s=timeout_s,
        env=env,
    ).check()
    return [result(out) for out in res.outputs]


@contextlib.contextmanager
def scratch(prefix: str = "jaxckpt-bench-", parent: str | None = "/tmp") -> Iterator[str]:
    """A temporary directory, deleted on the way out."""
    with tempfile.TemporaryDirectory(prefix=prefix, dir=parent, ignore_cleanup_errors=True) as d:
        yield d


def log(msg: str) -> None:
    """Progress on stderr, timestamped."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- measuring -----------------------------------------------------------------------------

median = statistics.median


def gbps(nbytes: float, seconds: Iterable[float]) -> float:
    """GB/s (1e9 bytes) of ``nbytes`` in the median of ``seconds``."""
    return nbytes / GB / median(seconds)


def alternate(items: Sequence, rep: int) -> list:
    """``items`` in order on even repeats, reversed on odd ones: none always goes first."""
    return list(items if rep % 2 == 0 else items[::-1])


def rotated(items: Sequence, by: int) -> list:
    """``items`` rotated left by ``by``: each takes its turn first."""
    by %= len(items)
    return [*items[by:], *items[:by]]


class PeakRss:
    """Peak RSS over the RSS at entry: a sampling thread plus the kernel's VmHWM mark."""

    def __init__(self, interval_s: float = 0.002):
        import psutil

        self.interval_s, self.proc = interval_s, psutil.Process()

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.baseline = self.peak = self.proc.memory_info().rss
        try:  # resets the kernel's peak-RSS mark (VmHWM); not allowed everywhere
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.hwm = True
        except OSError:
            self.hwm = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.proc.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        if self.hwm:
            with open("/proc/self/status") as f:
                hwm = next((int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")), 0)
            self.peak = max(self.peak, hwm * 1024)

    @property
    def over(self) -> int:
        return self.peak - self.baseline


# --- reporting -----------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    """PASS, FAIL, or SKIP where there was nothing to judge (None)."""
    return "SKIP" if ok is None else "PASS" if ok else "FAIL"


@dataclass(frozen=True)
class Table:
    """Fixed-width columns: (heading, format spec such as ``"<24"`` or ``">9.3f"``) each.

    A cell that is None prints as ``-``, a string as it is, a number with its column's spec.
    """

    columns: tuple[tuple[str, str], ...]
    sep: str = ""
    markdown: bool = False  # | a | b |, with a |---|---| rule under the headings

    def row(self, *cells) -> str:
        out = []
        for (_, spec), cell in zip(self.columns, cells, strict=False):
            text = cell is None or isinstance(cell, str)
            out.append(format("-" if cell is None else cell, _pad(spec) if text else spec))
        return f"| {' | '.join(out)} |" if self.markdown else self.sep.join(out)

    def head(self, rule: bool = False) -> str:
        """The headings, and under them a rule if asked (a markdown table always has one)."""
        head = self.row(*(name for name, _ in self.columns))
        if self.markdown:
            cells = [format(name, _pad(spec)) for name, spec in self.columns]
            return head + "\n|" + "|".join("-" * (len(c) + 2) for c in cells) + "|"
        return head + ("\n" + "-" * len(head) if rule else "")

    def print(self, rows: Iterable[Sequence], rule: bool = False) -> None:
        print(self.head(rule))
        for cells in rows:
            print(self.row(*cells))


def _pad(spec: str) -> str:
    """The alignment and width of a format spec (">9" of ">9.3f")."""
    return re.match(r"[<>^]?\d*", spec).group()


def write_json(path: str, data) -> None:
    """``data`` as JSON at ``path`` (results of record go under ``RESULTS``)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
