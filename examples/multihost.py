"""Launch the Flax example as N processes of one jax.distributed job on this machine.

    python examples/multihost.py --processes 2 --dir /tmp/run_mh --steps 40
    python examples/multihost.py --processes 4 --dir /tmp/run_mh --steps 80 --resume

Each process gets 8/N CPU devices; together they form the (4, 2) mesh, and every process
writes only its own shards of each checkpoint. On a real cluster, run train_flax.py once
per host with --coordinator host0:port --num-processes N --process-id i.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2, choices=[1, 2, 4, 8])
    ap.add_argument("--timeout", type=float, default=600.0, help="kill everyone after this")
    args, rest = ap.parse_known_args()
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(
        os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={8 // args.processes}"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "train_flax.py"), *rest]
            + ["--coordinator", coordinator, "--num-processes", str(args.processes)]
            + ["--process-id", str(i)],
            env=env,
        )
        for i in range(args.processes)
    ]
    try:
        codes = [p.wait(timeout=args.timeout) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [-1]
    finally:
        for p in procs:  # a straggler must not outlive the job
            if p.poll() is None:
                p.kill()
    sys.exit(0 if all(c == 0 for c in codes) else 1)


if __name__ == "__main__":
    main()
