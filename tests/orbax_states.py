"""The Flax TrainState (an MLP, optax.adamw) that tests/test_orbax.py has Orbax save."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state as flax_train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

SPECS = {
    "Dense_0": {"kernel": P("data", "model"), "bias": P("model")},
    "Dense_1": {"kernel": P("model", None), "bias": P()},
}


def params_host() -> dict:
    rng = np.random.default_rng(0)
    return {
        "Dense_0": {
            "kernel": rng.standard_normal((32, 64)).astype(np.float32),
            "bias": rng.standard_normal(64).astype(np.float32),
        },
        "Dense_1": {
            "kernel": rng.standard_normal((64, 8)).astype(np.float32),
            "bias": np.arange(8, dtype=np.float32),
        },
    }


def train_state(mesh) -> flax_train_state.TrainState:
    """The state after one AdamW step, every array on ``mesh`` with the SPECS."""
    host = params_host()
    params = jax.tree.map(
        lambda v, s: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, s), lambda i, v=v: v[i]
        ),
        host,
        SPECS,
    )
    state = flax_train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adamw(1e-2))
    grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.5, state.params)
    return jax.jit(lambda s, g: s.apply_gradients(grads=g))(state, grads)
