"""Worker: one of two jobs that write one run directory at the same moment (a relaunch
while the previous incarnation still drains, or a job started twice).

usage: two_jobs.py ROOT TRIALS JOB [different]
                                     for each trial t: waits for ROOT/go-t, then
                                     ``CheckpointManager(ROOT/t).save(step, values(JOB, t))``
                                     (step 7, or 7 + JOB with ``different``) and close;
                                     prints one JSON line a trial: saved, or the error's
                                     class and text
"""

import json
import os
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import numpy as np  # noqa: E402

import jaxckpt  # noqa: E402


def values(job: int, trial: int) -> dict:
    bits = np.random.default_rng(1000 * trial + job).integers(0, 2**32, (256, 64), np.uint32)
    return {"w": bits.view(np.float32), "job": job}


def main(root: str, trials: int, job: int, step: int) -> None:
    for t in range(trials):
        go = os.path.join(root, f"go-{t}")
        while not os.path.exists(go):
            time.sleep(0.0005)
        out: dict = {"trial": t, "job": job, "step": step}
        try:
            with jaxckpt.CheckpointManager(os.path.join(root, str(t))) as mgr:
                # False: the step is committed already (the other job saved it and closed)
                out["saved"] = mgr.save(step, values(job, t))
        except jaxckpt.errors.CheckpointError as e:
            out["error"] = type(e).__name__
            out["text"] = str(e)
        print(json.dumps(out), flush=True)
        open(os.path.join(root, f"done-{t}-{job}"), "w").close()


if __name__ == "__main__":
    job = int(sys.argv[3])
    main(sys.argv[1], int(sys.argv[2]), job, 7 + job if sys.argv[4:] == ["different"] else 7)
