"""Every property test (``@pytest.mark.property``) under the "fuzz" hypothesis profile, with
fresh seeds, round after round, for as long as asked.

    python bench/fuzz.py --minutes 10 [-k safetensors] [--log-dir DIR]

A round runs the properties in a random order in one pytest process (``-m property``, a
random ``--hypothesis-seed``, ``JAXCKPT_HYPOTHESIS_PROFILE=fuzz``); its hypothesis statistics
give each property's passing, failing and invalid examples, its ``-v``/``-rA`` lines each
one's outcome. A property that kills the process is CRASHED and the rest of the round goes
on in a new one. No round starts once the time is up, and one still running then is
interrupted (finished properties count). A failing property prints the command that replays
it (same seed) and where the round's output is. Prints a table per property and the totals;
exit status 1 if any property failed (a strict xfail failing as expected is no failure).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import harness
from harness import ROOT

INTERRUPT_GRACE_S = 60.0  # after SIGINT, time for pytest to print what it has
ROUND_LIMIT_S = 1800.0  # a round that runs longer is interrupted (a hang, not a slow test)
FAILED = ("FAILED", "ERROR", "XPASS", "CRASHED")
_STATS = re.compile(r"- (\d+) passing examples, (\d+) failing examples, (\d+) invalid examples")
_PROGRESS = re.compile(r"^(\S.*?::.+?) (PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b")
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS) (.+?::.+?)(?: - (.*))?$")


@dataclass
class Tally:
    """One property's figures over every round."""

    passing: int = 0
    failing: int = 0
    invalid: int = 0
    rounds: collections.Counter = field(default_factory=collections.Counter)  # outcome: n
    failed_seeds: list[int] = field(default_factory=list)
    counted: bool = False  # hypothesis printed its statistics (not for a @given inside a test)

    @property
    def tried(self) -> int:
        return self.passing + self.failing


def pytest_command(extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", "-m", "property", "-p", "no:cacheprovider", *extra]


def collect(selection: list[str]) -> list[str]:
    """The node ids of the property tests (``-k`` etc. in ``selection``)."""
    out = subprocess.run(
        pytest_command(["--collect-only", "-q", *selection]),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=fuzz_env(),
        timeout=600,
    )
    ids = [line for line in out.stdout.splitlines() if "::" in line and not line[:1].isspace()]
    if not ids:
        sys.exit(f"no property tests collected:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    broken = [line for line in out.stdout.splitlines() if line.startswith("ERROR ")]
    for line in broken:  # a test file that does not import: its properties are left out
        print(f"collection error, left out: {line[len('ERROR ') :]}")
    return ids


def fuzz_env(storage: str | None = None) -> dict[str, str]:
    """The fuzz profile; hypothesis' example database under ``storage`` (not the repo's)."""
    env = dict(os.environ, JAXCKPT_HYPOTHESIS_PROFILE="fuzz", PYTHONHASHSEED="0")
    if storage:
        env["HYPOTHESIS_STORAGE_DIRECTORY"] = storage
    return env


@dataclass
class Run:
    """One pytest process's output."""

    output: str
    log: str
    code: int
    interrupted: bool  # stopped by the time limit


def run_pytest(ids: list[str], seed: int, timeout_s: float, log: str, storage: str) -> Run:
    """One pytest process over ``ids`` (in that order), interrupted after ``timeout_s``."""
    cmd = pytest_command(
        [f"--hypothesis-seed={seed}", "--hypothesis-show-statistics", "-rA", "-v", "--tb=short"]
        + ids
    )
    with open(log, "w+") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=fuzz_env(storage),
            start_new_session=True,
        )
        interrupted = False
        try:
            proc.wait(timeout=max(1.0, min(timeout_s, ROUND_LIMIT_S)))
        except subprocess.TimeoutExpired:
            interrupted = True
            os.killpg(proc.pid, signal.SIGINT)  # pytest still prints statistics and summary
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        f.seek(0)
        return Run(f.read(), log, proc.returncode, interrupted)


def run_round(
    order: list[str], seed: int, deadline: float, log_dir: str, n: int
) -> tuple[dict[str, list[int]], dict[str, tuple[str, str, str]], bool]:
    """Every property in ``order`` with ``seed``: (statistics, {node id: (outcome, message,
    log)}, interrupted). A property that kills its pytest process is CRASHED, and the ones
    after it run in a new process."""
    stats: dict[str, list[int]] = {}
    outcomes: dict[str, tuple[str, str, str]] = {}
    remaining, part = list(order), 0
    while remaining:
        part += 1
        log = os.path.join(log_dir, f"round{n:03d}-seed{seed}" + f"-{part}" * (part > 1) + ".log")
        run = run_pytest(
            remaining, seed, deadline - time.monotonic(), log, os.path.join(log_dir, "hypothesis")
        )
        got_stats, got = parse(run.output)
        stats.update(got_stats)
        outcomes.update({i: (o, m, log) for i, (o, m) in got.items()})
        left = [i for i in remaining if i not in got]
        if run.interrupted or (left and time.monotonic() >= deadline):
            outcomes.update({i: ("NOT STARTED", "time up", log) for i in left})
            if run.interrupted and left:  # pytest runs in order: the first was running
                outcomes[left[0]] = ("INTERRUPTED", "time up", log)
            return stats, outcomes, True
        if left:  # pytest runs in order: the first without an outcome took the process down
            why = f"the pytest process died (exit status {run.code}) while it ran"
            outcomes[left[0]] = ("CRASHED", why, log)
        remaining = left[1:]
    return stats, outcomes, False


def parse(output: str) -> tuple[dict[str, list[int]], dict[str, tuple[str, str]]]:
    """Per node id: [passing, failing, invalid] examples, and (outcome, message)."""
    stats: dict[str, list[int]] = {}
    outcomes: dict[str, tuple[str, str]] = {}
    current = None
    in_stats = False
    for line in output.splitlines():
        if "Hypothesis Statistics" in line:
            in_stats = True
            continue
        if in_stats and line.endswith(":") and "::" in line and not line.startswith(" "):
            current = line[:-1]
            stats.setdefault(current, [0, 0, 0])
            continue
        m = _STATS.search(line)
        if in_stats and m and current is not None:
            for i in range(3):
                stats[current][i] += int(m.group(i + 1))
            continue
        m = _PROGRESS.match(line)  # -v: "<node id> PASSED   [ 50%]"
        if m and m.group(1) not in outcomes:
            outcomes[m.group(1)] = (m.group(2), "")
            continue
        m = _OUTCOME.match(line)  # -rA: "FAILED <node id> - <message>"
        if m:
            outcomes[m.group(2)] = (m.group(1), m.group(3) or "")
    return stats, outcomes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="run rounds for this long")
    ap.add_argument("-k", dest="keyword", help="only the properties pytest -k selects")
    ap.add_argument("--log-dir", help="where round outputs go (default: a new temporary dir)")
    a = ap.parse_args()
    start = time.monotonic()
    deadline = start + 60 * a.minutes
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="jaxckpt-fuzz-")
    os.makedirs(log_dir, exist_ok=True)
    ids = collect(["-k", a.keyword] if a.keyword else [])
    print(f"{len(ids)} properties, profile fuzz, {a.minutes:g} min; round logs in {log_dir}")
    tallies = {i: Tally() for i in ids}
    rng = random.Random()
    rounds = 0
    while time.monotonic() < deadline:
        seed = rng.randrange(2**32)
        rounds += 1
        t = time.monotonic()
        stats, outcomes, interrupted = run_round(
            rng.sample(ids, len(ids)), seed, deadline, log_dir, rounds
        )
        failed_now = []
        for nodeid in ids:
            tally = tallies[nodeid]
            counts = stats.get(nodeid, [0, 0, 0])
            tally.counted |= nodeid in stats
            tally.passing += counts[0]
            tally.failing += counts[1]
            tally.invalid += counts[2]
            outcome, message, log = outcomes.get(nodeid, ("NOT RUN", "", ""))
            tally.rounds[outcome] += 1
            if outcome in FAILED:
                tally.failed_seeds.append(seed)
                failed_now.append((nodeid, outcome, message, log))
        note = " (interrupted: time up)" if interrupted else ""
        print(
            f"round {rounds}: seed {seed}, {time.monotonic() - t:.0f} s, "
            f"{sum(sum(v[:2]) for v in stats.values())} cases, {len(failed_now)} failed{note}",
            flush=True,
        )
        for nodeid, outcome, message, log in failed_now:
            print(f"  {outcome} {nodeid}: {message[:200]}")
            print(
                "    replay: JAXCKPT_HYPOTHESIS_PROFILE=fuzz PYTHONHASHSEED=0 python -m pytest "
                f"'{nodeid}' -p no:cacheprovider --hypothesis-seed={seed}   (output: {log})"
            )
    report(tallies, rounds, time.monotonic() - start)


def report(tallies: dict[str, Tally], rounds: int, elapsed_s: float) -> None:
    width = max(len(i) for i in tallies)
    print(f"\n{rounds} rounds in {elapsed_s / 60:.1f} min")
    table = harness.Table(
        (("property", f"<{width}"), ("tried", ">7"), ("failing", ">7"), ("invalid", ">7"))
        + ((" rounds", ""),),  # after two spaces, as long as it is
        sep=" ",
    )
    print(table.head(rule=True))
    failures = 0
    for nodeid, t in tallies.items():
        outcomes = ", ".join(f"{k.lower()} {v}" for k, v in sorted(t.rounds.items()))
        seeds = f"  failing seeds: {t.failed_seeds[:5]}" if t.failed_seeds else ""
        figures = [v if t.counted else None for v in (t.tried, t.failing, t.invalid)]
        print(table.row(nodeid, *figures, f" {outcomes}{seeds}"))
        failures += len(t.failed_seeds)
    known = sum(t.rounds["XFAIL"] for t in tallies.values())
    tried = sum(t.tried for t in tallies.values())
    if any(
        not t.counted and t.rounds.keys() - {"INTERRUPTED", "NOT STARTED", "SKIPPED"}
        for t in tallies.values()
    ):
        print("-: no hypothesis statistics printed (e.g. its @given is on a function inside it)")
    print(
        f"\ncases tried: {tried}, failures: {failures}"
        + (f" (and {known} expected failures of strict xfail properties)" if known else "")
    )
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
