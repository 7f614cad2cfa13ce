"""Fault soak: a small training loop under the managers, with real faults injected at random.

usage: python bench/faults.py --minutes N [--seed S] [--lost-answers] [--json PATH]

A training job (a worker process: 8 CPU devices, a 2.3 MB state sharded over a 4x2 mesh,
each step's values a deterministic function of the step: the bit patterns
``numpy.random.default_rng(step)`` draws, as float32 with NaN payloads, bfloat16 and both
float8s) saves under a ``CheckpointManager`` or an ``EmergencyCheckpointManager`` and
resumes from the newest step at its start (checked bit for bit). Episode after episode,
each with one fault drawn from a seeded ``random.Random``:

  sigterm     SIGTERM mid-training: the job saves the step it reached
              (``reached_preemption`` -> ``save(step, force=True)``), waits, exits 0;
  sigkill     SIGKILL right after a save call returned (its write in flight);
  second_job  a second job started on the run directory while the first runs: refused with
              DirectoryInUseError naming the first job's pid; the first goes on;
  disk_full   the run directory's filesystem fills up (ext4 on a loop device, or a tmpfs
              holding the emergency tier's local steps): the save that does not fit fails
              naming ENOSPC; the job frees space (``mgr.delete`` of old steps, or another
              file removed) and saves again;
  read_only   the filesystem remounted read-only: a manager opened there lists and
              restores every step; a save is refused up front (StorageError, errno 30);
  s3          the job saves to ``s3://`` on a moto server through tests/faultproxy.py (503
              SlowDown 10 %, connections reset 3 %, answers held back 5 %); the job ends by
              itself, by SIGTERM or by SIGKILL. By default a request carrying If-Match /
              If-None-Match is reset only before it reaches the server (what TensorStore
              can retry blindly); ``--lost-answers`` also cuts such answers after the
              server acted: a save whose OCDBT commit loses its answer fails (TensorStore's
              retried commit meets its own write: ALREADY_EXISTS), so save errors are then
              counted, not judged.

The managers work on: a directory of the local disk, an ext4 filesystem of 40 MB on a
loop device (saves there use O_DIRECT), an EmergencyCheckpointManager whose local tier is
a 16 MB tmpfs (remote tier: a local directory) and the moto bucket. A mount that is
refused (no root) falls back to a plain directory and drops the faults that need it.

After every episode, and at the end, every run directory is opened read-only
(``CheckpointManager(d, Options(read_only=True))``; the emergency tier's local steps through
an ``EmergencyCheckpointManager``, the job being gone) and EVERY listed step is restored and
compared bit for bit with the values of that step. ``broken steps listed`` counts the
listed steps that did not restore exactly: it must be 0. Any other broken promise (a job
preempted that did not exit 0 with its step saved, a second job let in, a save on a
read-only filesystem accepted, a save failing for no injected reason, a leftover temporary
directory after a clean run) is a violation. Exit status 1 if either happened.

No episode starts after ``--minutes``; the first ones go through every fault once (in a
seeded order), then faults are drawn at random. Mounts, loop devices, processes, the S3
server and the proxy are cleaned up on the way out (Ctrl-C and SIGTERM too).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import harness  # (puts tests/ on sys.path)
import numpy as np

SCRIPT = os.path.abspath(__file__)
RESULTS = os.path.join(harness.RESULTS, "faults.json")
EV = "EV "  # a worker's event lines: EV <json>
ROWS = 512  # the state: (512, 1024) float32 + small leaves, about 2.3 MB
STEP_BYTES = 2_400_000  # about a step's size on disk
BUCKET = "jaxckpt-faults"
KINDS = ("sigterm", "sigkill", "second_job", "disk_full", "read_only", "s3")
JOB_TIMEOUT_S = 240.0  # a job that runs longer is a hang: killed, a violation


# --- the state: a deterministic function of the step -----------------------------------------


def values(step: int) -> dict:
    """The NumPy values of ``step``: every bit pattern its seed draws, NaN payloads too."""
    from hostile import step_values  # tests/, on the path through harness

    return step_values(step, ROWS, 1024)


def sharded(step: int) -> dict:
    """``values(step)`` as jax arrays over a 4x2 mesh of the 8 CPU devices."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((4, 2), ("data", "model"))
    v = values(step)
    specs = {"w": P("data", "model"), "bf16": P("data"), "e4m3": P(None, "model"), "e5m2": P()}
    for name, spec in specs.items():
        v[name] = jax.device_put(v[name], NamedSharding(mesh, spec))
    return v


def mismatch(got, step: int) -> str | None:
    """Why the restored tree ``got`` is not ``values(step)`` bit for bit (None: it is)."""
    want = values(step)
    if not isinstance(got, dict) or sorted(got) != sorted(want):
        return f"tree {sorted(got) if isinstance(got, dict) else type(got)}"
    for name, w in want.items():
        g = got[name]
        if isinstance(w, np.ndarray):
            g = np.asarray(g)
            if g.dtype != w.dtype or g.shape != w.shape:
                return f"{name}: {g.dtype}{g.shape} != {w.dtype}{w.shape}"
            if g.tobytes() != w.tobytes():
                return f"{name}: bytes differ"
        elif type(g) is not type(w) or g != w:
            return f"{name}: {g!r} != {w!r}"
    return None


def errno_of(e: BaseException) -> int | None:
    """The errno of ``e`` or of its causes, else one named in their text."""
    import re

    chain = e
    while chain is not None:
        if isinstance(chain, OSError) and chain.errno:
            return chain.errno
        chain = chain.__cause__
    found = re.search(r"\[Errno (\d+)\]", chain_text(e))
    return int(found.group(1)) if found else None


def chain_text(e: BaseException) -> str:
    parts, chain = [], e
    while chain is not None:
        parts.append(f"{type(chain).__name__}: {chain}")
        chain = chain.__cause__
    return " <- ".join(parts)


# --- the worker: a training job --------------------------------------------------------------


def emit(event: str, **fields) -> None:
    print(EV + json.dumps({"ev": event, **fields}), flush=True)


def open_manager(cfg: dict):
    import jaxckpt

    if cfg["manager"] == "emergency":
        opts = jaxckpt.EmergencyOptions(
            local_interval_steps=cfg["interval"],
            local_max_to_keep=cfg["keep"],
            lease_stale_s=cfg["lease_stale_s"],
            remote=jaxckpt.Options(
                save_interval_steps=cfg["remote_interval"],
                max_to_keep=2,
                lease_stale_s=cfg["lease_stale_s"],
            ),
        )
        return jaxckpt.EmergencyCheckpointManager(cfg["dir"], cfg["remote"], opts)
    opts = jaxckpt.Options(
        save_interval_steps=cfg["interval"],
        max_to_keep=cfg["keep"],
        lease_stale_s=cfg["lease_stale_s"],
    )
    return jaxckpt.CheckpointManager(cfg["dir"], opts)


def worker(**cfg) -> dict:
    """One job (see the module); its story as EV lines, its figures returned."""
    harness.cpu_devices(8)
    from jaxckpt import errors

    if cfg["mode"] == "second":
        try:
            mgr = open_manager(cfg)
        except errors.DirectoryInUseError as e:
            emit("REFUSED", text=str(e), holder_pid=getattr(e.holder, "pid", None))
            return {"refused": True}
        emit("ADMITTED")
        mgr.close()
        return {"refused": False}

    try:
        mgr = open_manager(cfg)
    except errors.CheckpointError as e:
        emit("START_ERROR", kind=type(e).__name__, text=chain_text(e)[:2000])
        return {"started": False}
    if cfg.get("ballast"):
        fill(cfg["ballast"], leave=STEP_BYTES // 2)
    start = 0
    if (latest := mgr.latest_step()) is not None:
        got = mgr.restore()
        tier = getattr(getattr(mgr, "last_report", None), "tier", "dir")
        emit("RESUMED", step=latest, tier=tier, bad=mismatch(got, latest))
        start = latest
        del got
        gc.collect()
    emit("START", pid=os.getpid(), start=start)
    pending: int | None = None  # the step whose save is in flight
    fills = 0
    deadline = time.monotonic() + cfg["max_s"]

    def failed(step: int | None, e: BaseException) -> bool:
        """Reports a failed save; frees space after ENOSPC. False: give up."""
        nonlocal fills
        no = errno_of(e)
        emit("SAVE_ERROR", step=step, errno=no, kind=type(e).__name__, text=chain_text(e)[:2000])
        if no != 28:
            return True
        fills += 1
        if cfg.get("ballast") and os.path.exists(cfg["ballast"]):
            os.remove(cfg["ballast"])
            emit("FREED", how="ballast")
            return True
        if cfg["manager"] == "ckpt":
            with contextlib.suppress(errors.CheckpointError):
                mgr.wait_until_finished()
            old = mgr.all_steps()[:-1][:2]
            for s in old:
                mgr.delete(s)
            emit("FREED", how="delete", steps=old)
            return bool(old)
        return False

    def settle(saving: int | None) -> None:
        """Waits for the save in flight (of step ``saving``): reports it committed or failed."""
        try:
            mgr.wait_until_finished()
            if saving is not None:
                emit("COMMITTED", step=saving)
        except errors.CheckpointError as e:
            failed(saving, e)

    step = start
    for step in range(start + 1, start + cfg["steps"] + 1):
        state = sharded(step)  # "training"
        if mgr.reached_preemption(step):
            settle(pending)
            pending = None
            mgr.save(step, state, force=True)
            emit("SAVE", step=step)
            mgr.wait_until_finished()
            emit("COMMITTED", step=step)
            emit("PREEMPTED", step=step)
            mgr.close()
            return {"preempted": step}
        try:
            if mgr.save(step, state):
                if pending is not None:
                    emit("COMMITTED", step=pending)
                pending = step
                emit("SAVE", step=step)
        except (errors.BackgroundSaveError, errors.StorageError) as e:
            was, pending = pending, None
            if not failed(was, e):
                break
        if cfg.get("fills") and fills >= cfg["fills"]:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(cfg["step_s"])
    settle(pending)
    if cfg.get("prune_to") and cfg["manager"] == "ckpt":
        for s in mgr.all_steps()[: -cfg["prune_to"]]:
            mgr.delete(s)
    mgr.close()
    emit("DONE", step=step)
    return {"step": step}


def fill(path: str, leave: int) -> None:
    """Writes a file at ``path`` that leaves about ``leave`` bytes free on its filesystem."""
    free = shutil.disk_usage(os.path.dirname(path)).free
    block = b"\xa5" * (1 << 20)
    left = max(0, free - leave)
    with open(path, "wb") as f, contextlib.suppress(OSError):  # full already: that will do
        while left > 0:
            left -= f.write(block[: min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())


# --- jobs, seen from the launcher -------------------------------------------------------------

_jobs: list[Job] = []


class Job:
    """A worker process and the events it printed (read by a thread as they come)."""

    def __init__(self, cfg: dict, env: dict[str, str], log_dir: str) -> None:
        self.cfg = cfg
        self.log = os.path.join(log_dir, f"job-{len(_jobs)}-{cfg['mode']}.log")
        self.events: list[dict] = []
        self._queue: queue.Queue = queue.Queue()
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, SCRIPT, "--worker", json.dumps(cfg)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env,
                start_new_session=True,  # a Ctrl-C of the bench reaches it through us only
            )
        _jobs.append(self)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(EV):
                event = json.loads(line[len(EV) :])
                self.events.append(event)
                self._queue.put(event)
        self._queue.put(None)  # the end

    def wait_for(self, event: str, timeout_s: float = 120.0, count: int = 1) -> dict | None:
        """The ``count``-th ``event`` from now on (None: the job ended or the time ran out)."""
        deadline = time.monotonic() + timeout_s
        seen = 0
        while (left := deadline - time.monotonic()) > 0:
            try:
                got = self._queue.get(timeout=left)
            except queue.Empty:
                return None
            if got is None:
                self._queue.put(None)
                return None
            if got["ev"] == event:
                seen += 1
                if seen >= count:
                    return got
        return None

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    def finish(self, timeout_s: float = JOB_TIMEOUT_S) -> int | None:
        """The exit status (None: it hung and was killed)."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait()
            return None

    def of(self, event: str) -> list[dict]:
        return [e for e in self.events if e["ev"] == event]

    def tail(self, n: int = 3000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]


def kill_all() -> None:
    for job in _jobs:
        job.signal(signal.SIGKILL)
    for job in _jobs:
        with contextlib.suppress(Exception):
            job.proc.wait(timeout=10)


# --- where the runs live ----------------------------------------------------------------------


def _run(*cmd: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(cmd, 1, "", str(e))


@dataclass
class Mount:
    """A filesystem of ours (``kind``: "ext4", "tmpfs", or "dir" where mounting is refused)."""

    path: str
    kind: str
    device: str | None = None
    why: str = ""

    @property
    def mounted(self) -> bool:
        return self.kind != "dir"

    def remount(self, mode: str) -> bool:
        return _run("mount", "-o", f"remount,{mode}", self.path).returncode == 0

    def close(self) -> None:
        if self.mounted:
            _run("umount", "-l", self.path)
        if self.device:
            _run("losetup", "-d", self.device)


def mount_ext4(where: str, size_mb: int = 40) -> Mount:
    """ext4 on a loop device; a tmpfs, or a plain directory, where that is refused."""
    path = os.path.join(where, "ext4")
    os.makedirs(path)
    img = os.path.join(where, "ext4.img")
    with open(img, "wb") as f:
        f.truncate(size_mb << 20)
    why = ""
    if (res := _run("mkfs.ext4", "-q", "-F", img)).returncode == 0:
        lo = _run("losetup", "--find", "--show", img)
        if lo.returncode == 0:
            device = lo.stdout.strip()
            if (res := _run("mount", device, path)).returncode == 0:
                return Mount(path, "ext4", device)
            _run("losetup", "-d", device)
        else:
            res = lo
    why = f"ext4 on a loop device refused: {(res.stderr or res.stdout).strip()[:160]}"
    got = mount_tmpfs(where, size_mb, "ext4-fallback")
    got.why = why + (f"; {got.why}" if got.why else "")
    return got


def mount_tmpfs(where: str, size_mb: int, name: str = "tmpfs") -> Mount:
    path = os.path.join(where, name)
    os.makedirs(path, exist_ok=True)
    res = _run("mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", path)
    if res.returncode == 0:
        return Mount(path, "tmpfs")
    return Mount(path, "dir", why=f"tmpfs refused: {(res.stderr or res.stdout).strip()[:160]}")


class S3:
    """A moto S3 server (a thread of this process) and the faulty proxy in front of it."""

    def __init__(self, seed: int, lost_answers: bool) -> None:
        import logging

        import boto3
        from faultproxy import FaultProxy
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.direct = f"http://{host}:{port}"
        self.env = {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_SESSION_TOKEN": "testing",
            "AWS_REGION": "us-east-1",
            "NO_PROXY": "127.0.0.1",
            "no_proxy": "127.0.0.1",
        }
        for k in ("AWS_ENDPOINT_URL_S3", "AWS_PROFILE", "AWS_DEFAULT_REGION"):
            os.environ.pop(k, None)
        os.environ.update(self.env, AWS_ENDPOINT_URL=self.direct)  # this process: no faults
        boto3.client("s3", endpoint_url=self.direct, region_name="us-east-1").create_bucket(
            Bucket=BUCKET
        )
        self.proxy = FaultProxy(
            (host, port),
            p_503=0.1,
            p_drop=0.03,
            p_slow=0.05,
            slow_s=0.5,
            seed=seed,
            midway_conditional=lost_answers,
            lifetime_s=24 * 3600,
        )

    def close(self) -> None:
        self.proxy.close()
        self.server.stop()


# --- episodes ---------------------------------------------------------------------------------


@dataclass
class Run:
    """A run directory the jobs share, and how to open it."""

    name: str
    manager: str  # "ckpt" | "emergency"
    dir: str
    remote: str | None = None
    mount: Mount | None = None
    env: dict[str, str] = field(default_factory=dict)
    lease_stale_s: float = 60.0


@dataclass
class Tally:
    faults: Counter = field(default_factory=Counter)
    saves_attempted: int = 0
    saves_committed: int = 0
    save_errors: Counter = field(default_factory=Counter)  # "kind/errno": n
    killed_in_flight: int = 0  # saves in flight when SIGKILLed
    killed_committed: int = 0  # ... of which committed all the same
    restored: int = 0
    broken: int = 0
    resumes: int = 0
    episodes: Counter = field(default_factory=Counter)
    skipped: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, args: argparse.Namespace, scratch: str, stack: contextlib.ExitStack):
        self.args, self.scratch = args, scratch
        self.rng = random.Random(args.seed)
        self.t = Tally()
        self.logs = os.path.join(scratch, "logs")
        os.makedirs(self.logs)
        self.notes: list[str] = []
        ext4 = mount_ext4(scratch)
        stack.callback(ext4.close)
        tmpfs = mount_tmpfs(scratch, 16)
        stack.callback(tmpfs.close)
        for m in (ext4, tmpfs):
            if m.why:
                self.notes.append(m.why)
        self.runs = {
            "disk": Run("disk", "ckpt", os.path.join(scratch, "disk", "run")),
            "ext4": Run("ext4", "ckpt", os.path.join(ext4.path, "run"), mount=ext4),
            "emergency": Run(
                "emergency",
                "emergency",
                os.path.join(tmpfs.path, "local"),
                remote=os.path.join(scratch, "remote"),
                mount=tmpfs,
            ),
        }
        self.s3: S3 | None = None
        try:
            self.s3 = S3(args.seed, args.lost_answers)
            stack.callback(self.s3.close)
            env = {**self.s3.env, "AWS_ENDPOINT_URL": self.s3.proxy.endpoint}
            self.runs["s3"] = Run("s3", "ckpt", f"s3://{BUCKET}/run", env=env, lease_stale_s=20.0)
        except ImportError as e:
            self.notes.append(f"no S3 episodes: {e} (pip install 'moto[server]' boto3)")
        self.touched: set[str] = set()

    # --- helpers -----------------------------------------------------------------------

    def violation(self, text: str, job: Job | None = None) -> None:
        self.t.violations.append(text)
        harness.log(f"VIOLATION: {text}")
        if job is not None:
            sys.stderr.write(f"--- {job.log} (tail):\n{job.tail()}\n")

    def start(self, run: Run, mode: str = "train", **over) -> Job:
        cfg = {
            "mode": mode,
            "manager": run.manager,
            "dir": run.dir,
            "remote": run.remote,
            "interval": 2 if run.manager == "ckpt" else 1,
            "remote_interval": 5,
            "keep": 3 if run.manager == "ckpt" else 2,
            "lease_stale_s": run.lease_stale_s,
            "steps": 100_000,
            "max_s": 90.0,
            "step_s": 0.02,
            **over,
        }
        env = {**os.environ, **run.env, "PYTHONPATH": harness.ROOT}
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        self.touched.add(run.name)
        return Job(cfg, env, self.logs)

    def account(self, job: Job, killed: bool = False) -> int | None:
        """Adds a finished job's saves to the tally; the step in flight if it was killed."""
        self.t.saves_attempted += len(job.of("SAVE"))
        self.t.saves_committed += len(job.of("COMMITTED"))
        for e in job.of("SAVE_ERROR"):
            self.t.save_errors[f"{e['kind']}/errno {e['errno']}"] += 1
        for e in job.of("RESUMED"):
            self.t.resumes += 1
            self.t.restored += 1
            if e["bad"]:
                self.t.broken += 1
                self.violation(f"job resumed step {e['step']} not bit-exact: {e['bad']}", job)
        if not killed:
            return None
        done = {e["step"] for e in job.of("COMMITTED")} | {e["step"] for e in job.of("SAVE_ERROR")}
        flight = [e["step"] for e in job.of("SAVE") if e["step"] not in done]
        return flight[-1] if flight else None

    def started(self, job: Job) -> bool:
        if job.wait_for("START", 120) is not None:
            return True
        job.signal(signal.SIGKILL)
        job.finish(30)
        self.account(job)
        errors = job.of("START_ERROR")
        if errors and self.args.lost_answers and job.cfg["dir"].startswith("s3://"):
            self.t.save_errors[f"start: {errors[0]['kind']}"] += 1  # counted, not judged
            return False
        self.violation(f"a job on {job.cfg['dir']} did not start: {errors}", job)
        return False

    def unexpected_errors(self, job: Job, allowed: tuple[int, ...] = ()) -> None:
        if self.args.lost_answers and job.cfg["dir"].startswith("s3://"):
            return  # counted, not judged
        for e in job.of("SAVE_ERROR"):
            if e["errno"] not in allowed:
                self.violation(f"save of step {e['step']} failed: {e['text'][:400]}", job)

    def pick(self, *names: str) -> Run:
        return self.runs[self.rng.choice([n for n in names if n in self.runs])]

    # --- the faults --------------------------------------------------------------------

    def sigterm(self) -> None:
        run = self.pick("disk", "ext4", "emergency")
        job = self.start(run)
        if not self.started(job):
            return
        job.wait_for("SAVE", 120, count=self.rng.randint(1, 4))
        time.sleep(self.rng.uniform(0, 0.3))
        job.signal(signal.SIGTERM)
        self.t.faults["sigterm"] += 1
        rc = job.finish()
        self.account(job)
        got = job.of("PREEMPTED")
        if rc != 0 or not got:
            self.violation(f"SIGTERM: the job on {run.dir} exited {rc}, preempted: {got}", job)
            return
        self.unexpected_errors(job)
        self.expect_listed(run, got[0]["step"], newest=True)

    def sigkill(self) -> None:
        run = self.pick("disk", "ext4", "emergency")
        job = self.start(run, **({"interval": 1} if run.manager == "ckpt" else {}))
        if not self.started(job):
            return
        job.wait_for("SAVE", 120, count=self.rng.randint(1, 5))
        time.sleep(self.rng.uniform(0, 0.12))  # into the write in flight
        job.signal(signal.SIGKILL)
        self.t.faults["sigkill"] += 1
        rc = job.finish()
        flight = self.account(job, killed=True)
        if rc != -signal.SIGKILL:
            self.violation(f"SIGKILL: the job exited {rc} on its own", job)
        self.unexpected_errors(job)
        if flight is not None:
            self.t.killed_in_flight += 1
            if flight in self.listed(run):
                self.t.killed_committed += 1
                self.t.saves_committed += 1

    def second_job(self) -> None:
        run = self.pick("disk", "ext4", "emergency")
        first = self.start(run)
        if not self.started(first):
            return
        first.wait_for("SAVE", 120)
        second = self.start(run, mode="second")
        self.t.faults["second_job"] += 1
        rc = second.finish()
        refused = second.of("REFUSED")
        if rc != 0 or not refused:
            self.violation(f"a second job on {run.dir} was not refused (exit {rc})", second)
        elif str(first.proc.pid) not in refused[0]["text"]:
            self.violation(f"the refusal does not name pid {first.proc.pid}: {refused[0]}")
        if first.wait_for("SAVE", 60) is None:  # the first goes on saving
            self.violation(f"the first job on {run.dir} stopped saving", first)
        first.signal(signal.SIGTERM)
        rc = first.finish()
        self.account(first)
        if rc != 0 or not first.of("PREEMPTED"):
            self.violation(f"the first job on {run.dir} ended badly (exit {rc})", first)
        self.unexpected_errors(first)

    def disk_full(self) -> None:
        choices = [n for n in ("ext4", "emergency") if self.runs[n].mount.mounted]
        if not choices:
            self.t.skipped["disk_full"] += 1
            return
        run = self.runs[self.rng.choice(choices)]
        if run.manager == "ckpt":  # fills with steps, deletes two, and again
            over = {"keep": None, "interval": 1, "fills": 2, "steps": 60, "prune_to": 3}
        else:  # another file takes the room; removed after the save that did not fit
            over = {"ballast": os.path.join(run.mount.path, "ballast"), "steps": 6}
        job = self.start(run, step_s=0.0, **over)
        try:
            if not self.started(job):
                return
            rc = job.finish()
        finally:  # the other file goes, whatever happened (the next episodes need the room)
            if over.get("ballast") and os.path.exists(over["ballast"]):
                os.remove(over["ballast"])
        self.account(job)
        full = [e for e in job.of("SAVE_ERROR") if e["errno"] == 28]
        self.t.faults["disk_full"] += len(full)
        names = [e["ev"] for e in job.events]
        freed = names.index("FREED") if "FREED" in names else len(names)
        if rc != 0 or not full:
            self.violation(f"disk full on {run.dir}: exit {rc}, ENOSPC errors {len(full)}", job)
        elif "COMMITTED" not in names[freed:]:
            self.violation(f"disk full on {run.dir}: no save committed after freeing space", job)
        for e in full:
            if run.dir not in e["text"]:
                self.violation(f"the ENOSPC error does not name {run.dir}: {e['text'][:300]}")
        self.unexpected_errors(job, allowed=(28,))

    def read_only(self) -> None:
        choices = [n for n in ("ext4", "emergency") if self.runs[n].mount.mounted]
        if not choices:
            self.t.skipped["read_only"] += 1
            return
        run = self.runs[self.rng.choice(choices)]
        import jaxckpt
        from jaxckpt import errors

        if not self.listed(run):  # something to list and restore there first
            job = self.start(run, steps=4, step_s=0.0)
            if not self.started(job) or job.finish() != 0:
                self.violation(f"a short job on {run.dir} failed", job)
                return
            self.account(job)
        gc.collect()
        if not run.mount.remount("ro"):
            self.t.skipped["read_only"] += 1
            self.notes.append(f"remounting {run.mount.path} read-only was refused once")
            return
        self.t.faults["read_only"] += 1
        try:
            if run.manager == "ckpt":
                with jaxckpt.CheckpointManager(run.dir) as mgr:  # read-only by itself
                    steps = mgr.all_steps()
                    self.restore_all(run, mgr, steps)
                    nxt = (steps[-1] if steps else 0) + 1
                    try:
                        mgr.save(nxt, sharded(nxt), force=True)
                        self.violation(f"a save on read-only {run.dir} was accepted")
                    except errors.StorageError as e:
                        if e.errno != 30:
                            self.violation(f"read-only {run.dir}: errno {e.errno}: {e}")
            else:
                self.read_only_emergency(run)
            self.verify(run)
        finally:
            gc.collect()
            if not run.mount.remount("rw"):
                raise RuntimeError(f"remounting {run.mount.path} read-write failed")

    def read_only_emergency(self, run: Run) -> None:
        """The local tier read-only: its steps list and restore; a save fails, EROFS."""
        import jaxckpt

        with self.emergency(run) as mgr:
            steps = mgr.local_steps()
            self.restore_emergency(run, mgr, steps)
            nxt = max(mgr.all_steps(), default=0) + 1
            try:
                mgr.save(nxt, sharded(nxt), force=True)
                mgr.wait_until_finished()
                self.violation(f"a save on read-only {run.dir} was accepted")
            except jaxckpt.errors.CheckpointError as e:
                if errno_of(e) != 30:
                    self.violation(f"read-only {run.dir}: {chain_text(e)[:300]}")

    def s3_faults(self) -> None:
        if "s3" not in self.runs or self.s3 is None:
            self.t.skipped["s3"] += 1
            return
        run, proxy = self.runs["s3"], self.s3.proxy
        before = Counter(proxy.injected)
        end = self.rng.choice(["itself", "sigterm", "sigkill"])
        job = self.start(run, steps=4 if end == "itself" else 100_000, step_s=0.05)
        started = self.started(job)
        flight = None
        if started and end != "itself":
            job.wait_for("SAVE", 180, count=self.rng.randint(1, 2))
            if end == "sigkill":
                time.sleep(self.rng.uniform(0, 0.3))
            job.signal(signal.SIGTERM if end == "sigterm" else signal.SIGKILL)
            self.t.faults[end] += 1
        if started:
            rc = job.finish()
            flight = self.account(job, killed=end == "sigkill")
            if end == "sigterm" and (rc != 0 or not job.of("PREEMPTED")):
                self.violation(f"SIGTERM on S3: exit {rc}, {job.of('PREEMPTED')}", job)
            if end == "itself" and rc != 0:
                self.violation(f"the S3 job exited {rc}", job)
            self.unexpected_errors(job)
        for kind, n in (Counter(proxy.injected) - before).items():
            self.t.faults[f"s3 {kind}"] += n
        if flight is not None:
            self.t.killed_in_flight += 1
            if flight in self.listed(run):
                self.t.killed_committed += 1
                self.t.saves_committed += 1
        if started and end == "sigterm" and job.of("PREEMPTED"):
            self.expect_listed(run, job.of("PREEMPTED")[0]["step"], newest=True)

    # --- checking ----------------------------------------------------------------------

    def listed(self, run: Run) -> list[int]:
        import jaxckpt

        if run.manager == "emergency":
            from jaxckpt._src import steps
            from jaxckpt._src.storage import location

            return steps.committed(location(run.dir))
        if not run.dir.startswith("s3://") and not os.path.isdir(run.dir):
            return []  # no job ran there yet
        with jaxckpt.CheckpointManager(run.dir, jaxckpt.Options(read_only=True)) as mgr:
            return mgr.all_steps()

    def expect_listed(self, run: Run, step: int, newest: bool) -> None:
        got = self.listed(run)
        if step not in got or (newest and max(got) != step):
            self.violation(f"{run.dir}: preempted at step {step}, but listed {got}")

    def restore_all(self, run: Run, mgr, steps: list[int]) -> None:
        self.compare_steps(run, steps, lambda s: (mgr.restore(s), None), "listed step")

    def restore_emergency(self, run: Run, mgr, steps: list[int]) -> None:
        def local(s: int):
            got = mgr.restore(step=s)
            tier = mgr.last_report.tier
            return got, None if tier == "local" else f"restored from {tier}, not the local step"

        self.compare_steps(run, steps, local, "local step")

    def compare_steps(self, run: Run, steps: list[int], restore, what: str) -> None:
        """Restores each step (``restore(s)`` -> (tree, a fault of its own or None)) and
        compares it bit for bit with the step's values; counts the broken ones."""
        for s in steps:
            try:
                got, bad = restore(s)
                bad = bad or mismatch(got, s)
                del got
            except Exception as e:
                bad = chain_text(e)[:300]
            self.t.restored += 1
            if bad:
                self.t.broken += 1
                self.violation(f"{run.dir}: {what} {s} does not restore exactly: {bad}")
        gc.collect()

    @contextlib.contextmanager
    def emergency(self, run: Run):
        import jaxckpt

        opts = jaxckpt.EmergencyOptions(
            local_max_to_keep=None, remote=jaxckpt.Options(save_interval_steps=1000)
        )  # every step kept in both tiers
        mgr = jaxckpt.EmergencyCheckpointManager(run.dir, run.remote, opts)
        try:
            yield mgr
        finally:
            with contextlib.suppress(jaxckpt.errors.CheckpointError):
                mgr.close()

    def verify(self, run: Run) -> None:
        """Every listed step of ``run``, restored read-only and compared bit for bit."""
        import jaxckpt

        if run.manager == "emergency":
            if os.path.isdir(run.dir):
                with self.emergency(run) as mgr:
                    self.restore_emergency(run, mgr, mgr.local_steps())
            remote = Run(run.name + "-remote", "ckpt", run.remote)
            if os.path.isdir(remote.dir):
                self.verify(remote)
            return
        if run.dir.startswith("/") and not os.path.isdir(run.dir):
            return
        with jaxckpt.CheckpointManager(run.dir, jaxckpt.Options(read_only=True)) as mgr:
            self.restore_all(run, mgr, mgr.all_steps())

    def leftovers(self, run: Run) -> list[str]:
        if not run.dir.startswith("/") or not os.path.isdir(run.dir):
            return []
        return [n for n in os.listdir(run.dir) if ".tmp-" in n or n.startswith(".init-")]

    # --- the soak ----------------------------------------------------------------------

    def episode(self, kind: str) -> None:
        first = len(_jobs)
        self.touched = set()
        {
            "sigterm": self.sigterm,
            "sigkill": self.sigkill,
            "second_job": self.second_job,
            "disk_full": self.disk_full,
            "read_only": self.read_only,
            "s3": self.s3_faults,
        }[kind]()
        self.t.episodes[kind] += 1
        # a job that ran to its end cleaned up what kills left before it (its manager's
        # start) and left nothing of its own (checked before the emergency tier's check,
        # whose manager cleans up too)
        trains = [j for j in _jobs[first:] if j.cfg["mode"] == "train"]
        if trains and trains[-1].proc.returncode == 0:
            run = next(r for r in self.runs.values() if r.dir == trains[-1].cfg["dir"])
            if left := self.leftovers(run):
                self.violation(f"{run.dir}: leftovers after a job that ended cleanly: {left}")
        for name in sorted(self.touched):
            self.verify(self.runs[name])

    def soak(self) -> None:
        deadline = time.monotonic() + self.args.minutes * 60
        order = self.rng.sample(KINDS, len(KINDS))
        n = 0
        while time.monotonic() < deadline and n < self.args.max_episodes:
            kind = order[n] if n < len(order) else self.rng.choice(KINDS)
            n += 1
            harness.log(f"episode {n}: {kind}")
            self.episode(kind)
        harness.log("final check of every run directory")
        for run in self.runs.values():
            self.verify(run)


# --- main -------------------------------------------------------------------------------------


def report(soak: Soak, elapsed_s: float) -> dict:
    t = soak.t
    print(f"\nfault soak: {sum(t.episodes.values())} episodes in {elapsed_s / 60:.1f} min, "
          f"seed {soak.args.seed}")  # fmt: skip
    for note in soak.notes:
        print(f"  note: {note}")
    table = harness.Table((("fault injected", "<22"), ("count", ">7")), sep="  ")
    print()
    table.print(sorted(t.faults.items()), rule=True)
    print()
    figures = [
        ("episodes", ", ".join(f"{k} {v}" for k, v in sorted(t.episodes.items()))),
        ("skipped", ", ".join(f"{k} {v}" for k, v in sorted(t.skipped.items())) or "none"),
        ("saves attempted", t.saves_attempted),
        ("saves committed", t.saves_committed),
        ("save errors", ", ".join(f"{k} {v}" for k, v in sorted(t.save_errors.items())) or 0),
        ("saves in flight at SIGKILL", f"{t.killed_in_flight} ({t.killed_committed} committed)"),
        ("resumes checked", t.resumes),
        ("steps restored and compared", t.restored),
        ("violations", len(t.violations)),
    ]
    for name, value in figures:
        print(f"{name:<30}{value}")
    print(f"broken steps listed: {t.broken}")
    for v in t.violations:
        print(f"  VIOLATION {v}")
    ok = t.broken == 0 and not t.violations
    print(f"{harness.verdict(ok)} every listed step restored bit-exactly, every fault handled")
    return {
        "seed": soak.args.seed,
        "minutes": soak.args.minutes,
        "elapsed_s": elapsed_s,
        "faults": dict(t.faults),
        "episodes": dict(t.episodes),
        "skipped": dict(t.skipped),
        "saves_attempted": t.saves_attempted,
        "saves_committed": t.saves_committed,
        "save_errors": dict(t.save_errors),
        "killed_in_flight": t.killed_in_flight,
        "killed_committed": t.killed_committed,
        "resumes": t.resumes,
        "restored": t.restored,
        "broken": t.broken,
        "violations": t.violations,
        "notes": soak.notes,
        "pass": ok,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lost-answers", action="store_true", help="cut answers to conditional writes")
    p.add_argument("--max-episodes", type=int, default=10_000)
    p.add_argument("--json", default=RESULTS, help="where the figures go ('' for nowhere)")
    args = p.parse_args()
    harness.cpu_devices(8)  # this process restores the steps it checks
    import jax  # noqa: F401  (before any fork of ours: the devices are set)

    def stop(signum, frame):  # SIGTERM ends the soak like Ctrl-C: cleaned up on the way out
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        scratch = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="jaxckpt-faults-", ignore_cleanup_errors=True)
        )
        soak = Soak(args, scratch, stack)
        stack.callback(kill_all)  # (first: the jobs go before their mounts)
        try:
            soak.soak()
        except KeyboardInterrupt:
            soak.notes.append("interrupted")
        out = report(soak, time.monotonic() - started)
        if args.json:
            harness.write_json(args.json, out)
    sys.exit(0 if out["pass"] else 1)


if __name__ == "__main__":
    harness.entry(main, worker)
