"""Worker: restore a checkpoint sharded over the job's processes (one device each) with a
short stall bound, and print how it ended.

usage: stall_job.py URL STALL_S TIMEOUT_S

Each process names its host ``h<index>`` (``$JAXCKPT_HOST``). Prints ``restored`` and exits
0, or prints ``failed <class> after <seconds>s: <message>`` and exits 3.
"""

import os
import sys
import time

import multiproc

multiproc.init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def main(url: str, stall_s: float, timeout_s: float) -> None:
    os.environ["JAXCKPT_HOST"] = f"h{jax.process_index()}"
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    target = {
        "w": jax.ShapeDtypeStruct((64, 256), np.float32, sharding=NamedSharding(mesh, P("d")))
    }
    started = time.perf_counter()
    try:
        jaxckpt.restore(url, target=target, timeout_s=timeout_s, stall_timeout_s=stall_s)
    except jaxckpt.errors.CheckpointError as e:
        took = time.perf_counter() - started
        print(f"failed {type(e).__name__} after {took:.1f}s: {e}", flush=True)
        sys.exit(3)
    print("restored", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), float(sys.argv[3]))
