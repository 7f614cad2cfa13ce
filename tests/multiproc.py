"""Launch N jax.distributed processes on 127.0.0.1, collect output, bound time, kill stragglers.

Parent side: ``run(script, n, ...)``. Worker side: ``init()`` at the top of the script
(before any other jax use) joins the job with the env vars the parent set.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Result:
    returncodes: list[int]
    outputs: list[str]

    def check(self) -> Result:
        bad = [i for i, rc in enumerate(self.returncodes) if rc != 0]
        assert not bad, "\n".join(
            f"--- process {i} (rc={self.returncodes[i]})\n{self.outputs[i]}" for i in bad
        )
        return self


@dataclass
class Job:
    """Running worker processes; ``wait`` collects them within a time bound."""

    procs: list[subprocess.Popen]

    def wait(self, timeout_s: float = 120.0) -> Result:
        """Every process's output, read concurrently: a process whose pipe filled while
        another was read would block, and its peers with it in the next collective."""
        deadline = time.monotonic() + timeout_s
        outputs = [""] * len(self.procs)

        def collect(i: int) -> None:
            p = self.procs[i]
            try:
                outputs[i], _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                out, _ = p.communicate()
                outputs[i] = out + "\n[killed: time bound exceeded]"

        readers = [threading.Thread(target=collect, args=(i,)) for i in range(len(self.procs))]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        return Result([p.returncode for p in self.procs], outputs)


def start(
    script: str,
    n: int,
    *,
    devices_per_process: int = 4,
    args: list[str] | None = None,
    env: dict | None = None,
    process_ids: list[int] | None = None,
) -> Job:
    """Starts ``script`` (a file path) as ``n`` processes of one jax.distributed job.

    ``process_ids[rank]`` is the jax process id of the rank-th process started.
    """
    port = free_port()
    procs = []
    ids = process_ids or list(range(n))
    for rank in range(n):
        penv = dict(os.environ)
        penv.update(env or {})
        penv.update(
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process}",
            JAXCKPT_COORD=f"127.0.0.1:{port}",
            JAXCKPT_NPROC=str(n),
            JAXCKPT_PID=str(ids[rank]),
            PYTHONPATH=os.pathsep.join([HERE, ROOT, penv.get("PYTHONPATH", "")]),
            JAX_PLATFORMS="cpu",
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, script, *(args or [])],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return Job(procs)


def run(
    script: str,
    n: int,
    *,
    devices_per_process: int = 4,
    args: list[str] | None = None,
    timeout_s: float = 120.0,
    env: dict | None = None,
    process_ids: list[int] | None = None,
) -> Result:
    """Runs ``script`` as ``n`` processes of one jax.distributed job and collects them."""
    job = start(
        script,
        n,
        devices_per_process=devices_per_process,
        args=args,
        env=env,
        process_ids=process_ids,
    )
    return job.wait(timeout_s)


def init() -> None:
    """Worker side: join the job described by the parent's environment variables."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if os.environ.get("JAXCKPT_TEST_NO_PREEMPTION_SERVICE"):
        jax.config.update("jax_enable_preemption_service", False)
    if "JAXCKPT_COORD" in os.environ:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAXCKPT_COORD"],
            num_processes=int(os.environ["JAXCKPT_NPROC"]),
            process_id=int(os.environ["JAXCKPT_PID"]),
            initialization_timeout=60,
            # a survivor of a dead peer waits this long for it at exit, then exits anyway
            shutdown_timeout_seconds=int(os.environ.get("JAXCKPT_SHUTDOWN_TIMEOUT", "5")),
        )
