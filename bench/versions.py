"""The version matrix: the format and direct-path tests under the oldest and the newest jax and
tensorstore that pyproject.toml accepts.

Each environment is a virtual environment of this Python (``python -m venv``) with pyproject's
``dependencies`` and its ``[test]`` extras installed by pip:

- ``lowest``: every ``>=`` floor of ``dependencies`` pinned (``jax>=0.10.1`` becomes
  ``jax==0.10.1``); the extras take whatever pip resolves with those pins.
- ``lowest-jax``: only jax, jaxlib and tensorstore pinned to their floors, the rest as new
  as pip finds compatible: whether those three floors hold apart from the others'.
- ``newest``: everything unpinned, upgraded (the newest pip installs here, at build time).

jaxckpt itself is not installed: each run copies the working tree (the files git tracks or
would, as they are now, uncommitted changes included) once into a temporary directory and
every environment imports jaxckpt and runs the tests from that one copy (``PYTHONPATH``), so
all of them test the same code even while the tree is being edited, and no build writes into
the repository (``--live`` runs the tree in place instead). The environments are cached (``~/.cache/jaxckpt/versions/<env>``, or
``$JAXCKPT_VERSIONS_CACHE``) and rebuilt only when their requirements change or with
``--rebuild``. Each test file runs in its own pytest process; the matrix shows
passed/failed (and skipped) per file, then the exact versions installed.

    python bench/versions.py                      # the three environments, the five test files
    python bench/versions.py lowest               # one environment
    python bench/versions.py --quick              # the format tests only, -m "not slow"
    python bench/versions.py --rebuild newest     # fetch today's newest again
    python bench/versions.py --tests tests/test_ocdbt_write.py -- -k manifest
    python bench/versions.py lowest --pin numpy==2.0.0 --pin ml_dtypes==0.6.0   # a floor to try
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("JAXCKPT_VERSIONS_CACHE", Path.home() / ".cache/jaxckpt/versions"))
TESTS = [  # the format (OCDBT, golden checkpoints) and the direct read/write paths
    "tests/test_ocdbt_write.py",
    "tests/test_golden.py",
    "tests/test_direct.py",
    "tests/test_chunk_plan.py",
    "tests/test_mapped.py",
]
QUICK_TESTS = ["tests/test_ocdbt_write.py", "tests/test_golden.py"]
JAX_AND_TENSORSTORE = ("jax", "jaxlib", "tensorstore")
SHOWN = ["jax", "jaxlib", "tensorstore", "numpy", "ml_dtypes", "crc32c"]
ENVS = ["lowest", "lowest-jax", "newest"]
INSTALL_TIMEOUT_S = 3600
TEST_TIMEOUT_S = 1800


def _requirements(env: str) -> tuple[list[str], list[str]]:
    """pip's requirements and extra options for ``env``, from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps: list[str] = project["dependencies"]
    extras: list[str] = project["optional-dependencies"]["test"]
    if env in ("lowest", "lowest-jax"):
        only = None if env == "lowest" else JAX_AND_TENSORSTORE
        pinned = []
        for req in deps:
            m = re.fullmatch(r"\s*([A-Za-z0-9_.\-\[\]]+)\s*>=\s*([^,;\s]+)\s*", req)
            pin = m is not None and (only is None or m.group(1) in only)
            pinned.append(f"{m.group(1)}=={m.group(2)}" if pin and m else req)
        return pinned + extras, []
    if env == "newest":
        return deps + extras, ["--upgrade", "--upgrade-strategy", "eager"]
    raise SystemExit(f"unknown environment {env!r}: {', '.join(ENVS)}")


@dataclass
class Env:
    name: str
    path: Path
    built: str = ""
    versions: dict[str, str] = field(default_factory=dict)
    error: str = ""
    detail: str = ""

    @property
    def python(self) -> str:
        return str(self.path / "bin" / "python")


def _run(cmd: list[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def _project(req: str) -> str:
    """A requirement's project name, normalized (``ml-dtypes[x]>=1`` -> ``ml_dtypes``)."""
    m = re.match(r"\s*([A-Za-z0-9_.\-]+)", req)
    return re.sub(r"[-_.]+", "_", m.group(1)).lower() if m else req


def build(name: str, rebuild: bool, pins: Sequence[str] = ()) -> Env:
    """The environment, from the cache when its requirements are the same. ``pins`` replace
    the requirements of the same projects (or are added): such an environment is named and
    cached apart (``lowest+numpy==2.0.0``)."""
    reqs, opts = _requirements(name)
    if pins:
        pinned = {_project(p) for p in pins}
        reqs = [r for r in reqs if _project(r) not in pinned] + list(pins)
        name = f"{name}+{','.join(pins)}"
    env = Env(name, CACHE / re.sub(r"[^A-Za-z0-9_.+-]", "_", name))
    marker = env.path / "jaxckpt-versions.json"
    wanted = {"python": sys.version, "requirements": reqs, "options": opts}
    if not rebuild and marker.exists():
        done = json.loads(marker.read_text())
        if {k: done.get(k) for k in wanted} == wanted:
            env.built = done["built"]
            return env
    shutil.rmtree(env.path, ignore_errors=True)
    print(f"[{name}] creating {env.path}", flush=True)
    start = time.monotonic()
    out = _run([sys.executable, "-m", "venv", str(env.path)], 300)
    if out.returncode:
        env.error = f"venv failed: {out.stderr.strip()[-2000:]}"
        return env
    print(f"[{name}] pip install {' '.join(opts + reqs)}", flush=True)
    try:
        pip = [env.python, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        out = _run(pip + opts + reqs, INSTALL_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        env.error = f"pip install took over {INSTALL_TIMEOUT_S} s"
        return env
    if out.returncode:
        env.error = "pip install failed:\n" + (out.stdout + out.stderr).strip()[-3000:]
        return env
    env.built = time.strftime("%Y-%m-%d %H:%M")
    marker.write_text(json.dumps({**wanted, "built": env.built}))
    print(f"[{name}] installed in {time.monotonic() - start:.0f} s", flush=True)
    return env


def _environ(tree: Path) -> dict[str, str]:
    """This process's environment, importing jaxckpt from ``tree``."""
    out = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**out, "PYTHONPATH": str(tree)}


def snapshot(into: Path) -> Path:
    """A copy of the working tree's files that git tracks or would (not ignored), as they
    are now; tracked files deleted in the tree are left out."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    for rel in sorted({r.decode() for r in listed if r}):
        src = ROOT / rel
        if src.is_file():
            (into / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, into / rel)
    return into


def installed(env: Env, tree: Path) -> dict[str, str]:
    """The versions of ``SHOWN`` in ``env``; ``env.error`` where jaxckpt (from ``tree``) does
    not import."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "out = {'python': sys.version.split()[0]}\n"
        f"for name in {SHOWN!r}:\n"
        "    try:\n"
        "        out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError:\n"
        "        out[name] = '-'\n"
        "print(json.dumps(out), flush=True)\n"
        "import jaxckpt\n"
    )
    out = _run([env.python, "-c", code], 300, cwd="/", env=_environ(tree))
    if out.returncode:
        last = out.stderr.strip().splitlines()[-1:] or ["?"]
        env.error = env.error or f"import jaxckpt failed: {last[0]}"
        env.detail = out.stderr.strip()[-3000:]
    return json.loads(out.stdout.splitlines()[0]) if out.stdout.strip() else {}


@dataclass
class Counts:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    note: str = ""
    failures: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        if self.note:
            return self.note
        s = f"{self.passed} passed / {self.failed} failed"
        return s + (f" / {self.skipped} skipped" if self.skipped else "")


def run_tests(env: Env, tree: Path, test: str, extra: list[str]) -> Counts:
    """One test file in its own pytest process; counts from its JUnit XML."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = os.path.join(tmp, "junit.xml")
        cmd = [env.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}"]
        start = time.monotonic()
        try:
            out = _run([*cmd, test, *extra], TEST_TIMEOUT_S, cwd=tree, env=_environ(tree))
        except subprocess.TimeoutExpired:
            return Counts(note=f"timed out ({TEST_TIMEOUT_S} s)")
        counts = Counts(seconds=time.monotonic() - start)
        if not os.path.exists(xml):
            counts.note = f"pytest exit {out.returncode}, no report"
            counts.failures = [(out.stdout + out.stderr).strip()[-2000:]]
            return counts
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                counts.failed += 1
                label = f"{case.get('classname', '')}::{case.get('name', '')}"
                counts.failures.append(f"{label}: {(bad.get('message') or '').splitlines()[:1]}")
            elif case.find("skipped") is not None:
                counts.skipped += 1
            else:
                counts.passed += 1
        if out.returncode not in (0, 1, 5):  # 5: nothing collected (e.g. -k matched none)
            counts.note = f"pytest exit {out.returncode}: {counts}"
            counts.failures.append((out.stdout + out.stderr).strip()[-2000:])
        return counts


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("envs", nargs="*", default=ENVS, help=", ".join(ENVS))
    parser.add_argument("--quick", action="store_true", help='format tests only, -m "not slow"')
    parser.add_argument("--tests", nargs="+", help="test files (default: the five)")
    parser.add_argument("--rebuild", action="store_true", help="recreate the environments")
    parser.add_argument("--build-only", action="store_true", help="build, run no tests")
    parser.add_argument(
        "--pin", action="append", default=[], help="a requirement that replaces pyproject's"
    )
    parser.add_argument("--live", action="store_true", help="test the tree in place, no copy")
    parser.add_argument("--json", help="also write the results here")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    tests = args.tests or (QUICK_TESTS if args.quick else TESTS)
    if args.quick:
        extra += ["-m", "not slow"]
    for t in tests:
        if not (ROOT / t).exists():
            raise SystemExit(f"{t}: no such test file")

    results: dict[str, dict[str, Counts]] = {}
    envs = [build(name, args.rebuild, args.pin) for name in args.envs]
    with tempfile.TemporaryDirectory(prefix="jaxckpt-tree-") as tmp:
        tree = ROOT if args.live else snapshot(Path(tmp))
        print(f"testing jaxckpt from {tree}", flush=True)
        for env in envs:
            results[env.name] = {}
            if not env.error:
                env.versions = installed(env, tree)
            if env.error:
                print(f"[{env.name}] {env.error}\n{env.detail}", flush=True)
                continue
            if args.build_only:
                print(f"[{env.name}] {env.path}: {env.versions}", flush=True)
                continue
            for t in tests:
                print(f"[{env.name}] {t} ...", end=" ", flush=True)
                c = results[env.name][t] = run_tests(env, tree, t, extra)
                print(f"{c} ({c.seconds:.0f} s)", flush=True)

    print()
    head = ["env", "jax", "tensorstore", *(Path(t).stem.removeprefix("test_") for t in tests)]
    rows = [head]
    for env in envs:
        v = env.versions
        cells = [str(results[env.name].get(t, "not run")) for t in tests]
        if env.error:
            cells = [env.error.splitlines()[0]] + [""] * (len(tests) - 1)
        rows.append([env.name, v.get("jax", "?"), v.get("tensorstore", "?"), *cells])
    print(_table(rows))
    print()
    versions = [["env", "built", "python", *SHOWN]]
    for e in envs:
        versions.append(
            [e.name, e.built or "-", *(e.versions.get(k, "?") for k in ["python", *SHOWN])]
        )
    print(_table(versions))
    for env in envs:
        for t, c in results[env.name].items():
            for f in c.failures:
                print(f"\n[{env.name}] {t}: {f}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    e.name: {
                        "versions": e.versions,
                        "built": e.built,
                        "error": e.error,
                        "tests": {t: vars(c) for t, c in results[e.name].items()},
                    }
                    for e in envs
                },
                indent=1,
            )
        )
    bad = any(e.error for e in envs) or any(
        c.failed or c.note for r in results.values() for c in r.values()
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
