"""Worker: Flax/Optax training fed by a per-process Grain pipeline, checkpointing the
iterator's position with ``per_process=`` every step.

usage: grain_train.py MODE ROOT STEPS [KILL_AT]
  MODE: ``manager`` (CheckpointManager in ROOT/ckpt) or ``emergency``
        (EmergencyCheckpointManager: ROOT/host<pid> local, ROOT/remote remote, replication 1)
  Resumes from the newest step if there is one. KILL_AT: every process SIGKILLs itself right
  after ``save(KILL_AT)`` returns (its write still in flight).
Appends ``{"step", "ids"}`` per step to ROOT/seen<pid>.jsonl (the record ids of the batch
this process fed); prints ``RESUMED <step> <report json>`` and ``DIGEST <hex>`` at the end.
"""

import hashlib
import json
import os
import signal
import sys

import multiproc

multiproc.init()

import flax.linen as nn  # noqa: E402
import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

RECORDS, LOCAL_BATCH, FEATURES = 256, 4, 8


def record(i: int) -> dict:
    """Synthetic record ``i``: features and a target, a pure function of the id."""
    x = np.random.default_rng(i).standard_normal(FEATURES).astype(np.float32)
    return {"id": np.int64(i), "x": x, "y": np.float32(np.sin(x).sum())}


def pipeline() -> grain.MapDataset:
    """This process's shard of the shuffled records, batched."""
    pid, count = jax.process_index(), jax.process_count()
    ds = grain.MapDataset.range(RECORDS).shuffle(seed=7)[pid::count].map(record)
    return ds.batch(LOCAL_BATCH)


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(16)(x)))


def main(mode: str, root: str, steps: int, kill_at: int | None) -> None:
    pid = jax.process_index()
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    data = NamedSharding(mesh, P("data"))
    model = Model()
    params = model.init(jax.random.key(0), jnp.ones((1, FEATURES)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
    state = jax.device_put(state, NamedSharding(mesh, P()))

    @jax.jit
    def train_step(state, x, y):
        def loss(p):
            return jnp.mean((state.apply_fn(p, x)[:, 0] - y) ** 2)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    if mode == "manager":
        mgr = jaxckpt.CheckpointManager(os.path.join(root, "ckpt"), jaxckpt.Options(max_to_keep=3))
    else:
        opts = jaxckpt.EmergencyOptions(
            local_interval_steps=1,
            replication=1,
            timeout_s=60,
            remote=jaxckpt.Options(save_interval_steps=10**6, max_to_keep=3, timeout_s=60),
        )
        mgr = jaxckpt.EmergencyCheckpointManager(
            os.path.join(root, f"host{pid}"), os.path.join(root, "remote"), opts
        )
    it = iter(pipeline().to_iter_dataset())
    start = 0
    with mgr:
        if mgr.latest_step() is not None:
            state = mgr.restore(target=state)
            it.set_state(mgr.per_process())
            start = int(state.step)
            report = getattr(mgr, "last_report", None)
            source = None if report is None else [report.tier, report.per_process_from]
            print("RESUMED", start, json.dumps(source), flush=True)
        with open(os.path.join(root, f"seen{pid}.jsonl"), "a") as seen:
            for step in range(start, steps):
                batch = next(it)
                seen.write(json.dumps({"step": step, "ids": batch["id"].tolist()}) + "\n")
                seen.flush()
                x = jax.make_array_from_process_local_data(data, batch["x"])
                y = jax.make_array_from_process_local_data(data, batch["y"])
                state = train_step(state, x, y)
                mgr.save(step + 1, state, per_process=it.get_state())
                if step + 1 == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state.params):
        h.update(np.asarray(jax.device_get(leaf)).tobytes())
    print("DIGEST", h.hexdigest(), flush=True)


if __name__ == "__main__":
    main(
        sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None
    )
