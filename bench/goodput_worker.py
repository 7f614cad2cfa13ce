"""One life of bench/goodput.py's training job: a process of a 2-process jax.distributed job
that trains until it is killed.

A Flax MLP (``--width`` wide) with Optax AdamW on a (4, 2) mesh, fed by a Grain pipeline on
each process (examples/train_flax.py's records, shuffling and global batches), checkpointed
by an ``EmergencyCheckpointManager`` (replication=1, local tier only: the remote interval is
huge, and only the first job's forced save writes there) with each process's iterator state as its ``per_process=`` value.

A fresh job first times at least ``baseline_steps`` steps without saves (the pure step
time), up to a save step, saves it (``force=True``: the window starts from a checkpoint) and
restores it at once (the step of a restored state compiles into the persistent cache then,
not in the first relaunch). A relaunched job restores the newest step (a wiped host's shards
and iterator state from its peer's copy), records whether the restored step, the model's step
counter and the data position agree, saves that step again (a replaced host gets its local
copy back; the peer exchange compiles, a restart cost) and trains on. Every process appends
what it measures, by its own clocks, to ``<root>/events-p<i>.jsonl`` (one ``os.write`` of a
whole line: a SIGKILL loses at most that line); process 0 also writes
``<root>/first-<life>.json`` when its first training step is done: the launcher starts the
failure clock there.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import harness


class Events:
    """Appends ``{"e": kind, "t": unix seconds, "life": n, ...}`` lines to one file."""

    def __init__(self, path: str, life: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.life = life

    def __call__(self, kind: str, **fields: Any) -> None:
        line = {"e": kind, "t": time.time(), "life": self.life, **fields}
        os.write(self.fd, (json.dumps(line) + "\n").encode())


def written() -> int:
    """Bytes of files this process has written so far, as the kernel counts them for the
    storage (``/proc/self/io`` write_bytes: pages dirtied or written directly; not the
    collectives' socket traffic, which ``wchar`` would count too)."""
    return int(harness.io()["write_bytes"])


def options(interval: int | str, mtbf_hours: float) -> Any:
    """The managers' options: local saves every ``interval`` steps (or ``"auto"``, or
    ``"continuous"``), one peer copy, no remote saves in practice."""
    import jaxckpt

    extra = {"mtbf_hours": mtbf_hours} if interval == "auto" else {}
    return jaxckpt.EmergencyOptions(
        local_interval_steps=interval,  # type: ignore[arg-type]  ("auto": newer jaxckpt)
        replication=1,
        timeout_s=120,
        remote=jaxckpt.Options(save_interval_steps=10**9, timeout_s=120),
        **extra,
    )


def model_state(mesh: Any, width: int) -> Any:
    """A 3-layer Flax MLP ``width`` wide and its Optax AdamW state, sharded as in
    examples/train_flax.py."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state
    from train_flax import FEATURES, shardings

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = nn.relu(nn.Dense(width)(x))
            x = nn.relu(nn.Dense(width)(x))
            return nn.Dense(1)(x)

    model = MLP()
    params = model.init(jax.random.key(0), jnp.ones((1, FEATURES)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    state = state.replace(step=jnp.asarray(0, jnp.int32))
    return jax.device_put(state, shardings(mesh, state))


def data(batch: int) -> Any:
    """This process's Grain iterator: examples/train_flax.py's pipeline with ``batch`` records
    per global batch."""
    import grain
    import jax
    from train_flax import record

    pid, count = jax.process_index(), jax.process_count()
    ds = grain.MapDataset.range(4096).shuffle(seed=42).repeat()[pid::count].map(record)
    return iter(ds.batch(batch // count, drop_remainder=True).to_iter_dataset())


def worker(
    root: str,
    life: int,
    interval: int | str,
    mtbf_hours: float,
    width: int,
    batch: int,
    baseline_steps: int,
    compile_cache: str | None,
    deadline: float,
) -> dict:
    """Trains until killed (or until ``deadline``, unix seconds: no orphans if the launcher
    dies); what it measures goes to its events file."""
    sys.path.insert(0, os.path.join(harness.ROOT, "examples"))
    import jax
    from jax.sharding import AxisType
    from train_flax import global_batch, train_step

    import jaxckpt

    threading.Timer(max(0.0, deadline - time.time()), os._exit, (2,)).start()
    if compile_cache:  # as a production job would: a relaunch does not compile again
        jax.config.update("jax_compilation_cache_dir", compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    pid = jax.process_index()
    events = Events(os.path.join(root, f"events-p{pid}.jsonl"), life)
    events("start")
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    mgr = jaxckpt.EmergencyCheckpointManager(
        os.path.join(root, f"host{pid}"),
        os.path.join(root, "remote"),
        options(interval, mtbf_hours),
    )
    state, it = model_state(mesh, width), data(batch)

    def one_step(state: Any) -> tuple[Any, float]:
        t = time.perf_counter()
        state, loss = train_step(state, *global_batch(next(it), mesh))
        jax.block_until_ready(loss)
        return state, time.perf_counter() - t

    def timed_save(step: int, force: bool) -> None:
        """The save a (re)started job begins with (its peer exchange compiles), until committed."""
        t = time.perf_counter()
        if mgr.save(step, state, per_process=it.get_state(), force=force):
            mgr.wait_until_finished()
            events("save", step=step, blocking_s=time.perf_counter() - t, first=True)

    events("init")
    if mgr.latest_step() is None:  # a fresh job: the baseline, then the window's checkpoint
        state, _ = one_step(state)  # compiles
        # ends on a save step, so that the saves are evenly spaced from the window's start
        while int(state.step) <= baseline_steps or (
            isinstance(interval, int) and int(state.step) % interval
        ):
            state, dt = one_step(state)
            events("baseline", dt=dt)
        step = int(state.step)
        timed_save(step, force=True)
        # restored at once: the step of a restored state compiles now (into the persistent
        # cache), not in the first relaunch
        state = mgr.restore(target=state)
        train_step.lower(state, *global_batch(next(data(batch)), mesh)).compile()
    else:
        t = time.perf_counter()
        state = mgr.restore(target=state)
        it.set_state(mgr.per_process())
        rep = mgr.last_report
        assert rep is not None
        step = rep.step
        events(
            "restored",
            step=step,
            model_step=int(state.step),
            data=it.get_state()["next_index"],  # batches consumed: one per step
            tier=rep.tier,
            from_peers=len(rep.from_peers),
            per_process_from=rep.per_process_from,
            seconds=time.perf_counter() - t,
        )
        # the restored step again, where the interval allows (no remote write): a replaced
        # host gets its local copy back and the peer exchange compiles as a restart cost
        timed_save(step, force=False)
    first, top = True, None
    while True:
        # lap: the whole previous iteration (its step, save call, events), the loop's wall
        now = time.perf_counter()
        lap, top = (None if top is None else now - top), now
        state, dt = one_step(state)
        step += 1
        events("step", step=step, dt=dt, lap=lap, written=written())
        if first and pid == 0:
            with open(os.path.join(root, f"first-{life}.tmp"), "w") as f:
                json.dump({"t": time.time(), "step": step}, f)
            os.rename(f.name, os.path.join(root, f"first-{life}.json"))
        first = False
        t = time.perf_counter()
        if mgr.save(step, state, per_process=it.get_state()):
            events("save", step=step, blocking_s=time.perf_counter() - t)


def _not_alone() -> None:
    raise SystemExit("bench/goodput_worker.py is started by bench/goodput.py")


if __name__ == "__main__":
    harness.entry(_not_alone, worker)
