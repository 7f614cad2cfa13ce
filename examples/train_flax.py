"""Train a small Flax MLP with Optax AdamW on a (4, 2) mesh, checkpointing with the manager.

    python examples/train_flax.py --dir /tmp/run --steps 200 --save-every 50
    python examples/train_flax.py --dir /tmp/run --steps 400 --save-every 50 --resume

A SIGTERM (``kill <pid>``, or ``--term-at STEP``) saves the step reached and exits 0.

Batches come from a Grain pipeline on each process (synthetic records, shuffled with a
seed, sharded by process, batched). Each save also keeps every process's iterator position
(``per_process=it.get_state()``), so a resumed run feeds the batches an uninterrupted one
would have, and ends with bit-identical parameters.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
from functools import partial  # noqa: E402

import flax.linen as nn  # noqa: E402
import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

BATCH, FEATURES = 64, 32


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(128)(x))
        return nn.Dense(1)(x)


def shardings(mesh, tree):
    """Matrices split over (data, model); vectors over model when they divide; else replicated."""

    def one(x):
        if np.ndim(x) == 2 and x.shape[1] % mesh.shape["model"] == 0:
            return NamedSharding(mesh, P("data", "model"))
        if np.ndim(x) == 1 and x.shape[0] % mesh.shape["model"] == 0:
            return NamedSharding(mesh, P("model"))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, tree)


def create_state(mesh):
    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, FEATURES)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    state = state.replace(step=jnp.asarray(0, jnp.int32))
    return jax.device_put(state, shardings(mesh, state))


def record(i: int) -> dict:
    """Synthetic record ``i``: y = sum(sin(x)) + noise, a pure function of the id."""
    rng = np.random.default_rng(i)
    x = rng.standard_normal(FEATURES).astype(np.float32)
    return {"x": x, "y": np.float32(np.sin(x).sum() + 0.01 * rng.standard_normal())}


def batches() -> grain.DatasetIterator:
    """This process's Grain iterator: its shard of the shuffled records, endlessly, in local
    batches of BATCH / process_count."""
    pid, count = jax.process_index(), jax.process_count()
    ds = grain.MapDataset.range(4096).shuffle(seed=42).repeat()[pid::count].map(record)
    return iter(ds.batch(BATCH // count, drop_remainder=True).to_iter_dataset())


def global_batch(local: dict, mesh) -> tuple[jax.Array, jax.Array]:
    """Every process's local batch as one batch sharded over ``data``."""
    data = NamedSharding(mesh, P("data"))
    x = jax.make_array_from_process_local_data(data, local["x"])
    y = jax.make_array_from_process_local_data(data, local["y"][:, None])
    return x, y


@partial(jax.jit, donate_argnums=0)
def train_step(state, x, y):
    def loss_fn(params):
        return jnp.mean((state.apply_fn(params, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def params_digest(state) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state.params):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="checkpoint directory")
    ap.add_argument("--steps", type=int, default=200, help="train until this step")
    ap.add_argument("--save-every", type=int, default=50)
    ap.add_argument("--resume", action="store_true", help="continue from the newest step")
    ap.add_argument("--kill-at", type=int, help="SIGKILL this process after saving this step")
    ap.add_argument("--term-at", type=int, help="SIGTERM (a preemption notice) at this step")
    ap.add_argument("--log", help="append one JSON line per step (step, loss) to this file")
    ap.add_argument("--coordinator", help="host:port of process 0 (multi-process runs)")
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--process-id", type=int, default=0)
    args = ap.parse_args()
    if args.coordinator:  # one process per host; see examples/multihost.py
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)

    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    state = create_state(mesh)
    opts = jaxckpt.Options(save_interval_steps=args.save_every, max_to_keep=3)
    it = batches()
    with jaxckpt.CheckpointManager(args.dir, opts) as mgr:
        if args.resume and mgr.latest_step() is not None:
            state = mgr.restore(target=state)
            it.set_state(mgr.per_process())  # this process's iterator position
            print(f"resumed from step {int(state.step)}")
        log = open(args.log, "a") if args.log and jax.process_index() == 0 else None  # noqa: SIM115
        while int(state.step) < args.steps:
            step = int(state.step)
            state, loss = train_step(state, *global_batch(next(it), mesh))
            if log:
                log.write(json.dumps({"step": step, "loss": float(loss)}) + "\n")
                log.flush()
            if args.term_at is not None and int(state.step) == args.term_at:
                os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler sends
            if mgr.reached_preemption(int(state.step)):  # SIGTERM: the same step everywhere
                mgr.save(int(state.step), state, force=True, per_process=it.get_state())
                mgr.wait_until_finished()
                print(f"preempted: saved step {int(state.step)}; resume with --resume")
                return  # exit 0; the manager closes (and puts SIGTERM's handler back)
            mgr.save(
                int(state.step), state, metrics={"loss": float(loss)}, per_process=it.get_state()
            )
            if step % 50 == 0 and jax.process_index() == 0:
                print(f"step {step:5d}  loss {float(loss):.5f}")
            if args.kill_at is not None and int(state.step) == args.kill_at:
                mgr.wait_until_finished()
                os.kill(os.getpid(), signal.SIGKILL)
    if jax.process_count() == 1:
        print(f"done at step {int(state.step)}; params digest {params_digest(state)}")
    else:
        print(f"process {jax.process_index()} done at step {int(state.step)}")


if __name__ == "__main__":
    main()
