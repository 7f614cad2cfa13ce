"""Quickstart: save a sharded Flax/Optax train state, restore it onto another mesh.

python -m pip install -e ".[examples]" && python examples/quickstart.py
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import tempfile  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def shard_like(mesh):
    """Matrices over (data, model), everything else replicated."""

    def spec(x):
        return NamedSharding(mesh, P("data", "model") if np.ndim(x) == 2 else P())

    return spec


def main() -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    model = nn.Sequential([nn.Dense(256), nn.relu, nn.Dense(16)])
    params = model.init(jax.random.key(0), jnp.ones((1, 64)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))
    spec = shard_like(mesh)
    state = jax.tree.map(lambda x: jax.device_put(x, spec(x)) if hasattr(x, "ndim") else x, state)

    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/step_0"
        jaxckpt.save(path, state, custom_metadata={"note": "quickstart"})
        print("saved:", sorted(os.listdir(path)))

        # Restore onto a different mesh: (2, 4) instead of (4, 2).
        new_spec = shard_like(jax.make_mesh((2, 4), ("data", "model")))
        target = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=new_spec(x))
                if hasattr(x, "ndim")
                else x
            ),
            state,
        )
        restored = jaxckpt.restore(path, target=target)
        kernel = restored.params["params"]["layers_0"]["kernel"]
        print("restored kernel", kernel.shape, "on mesh", dict(kernel.sharding.mesh.shape))
        same = jax.tree.map(
            lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()), state, restored
        )
        assert all(jax.tree.leaves(same)), "restore differs from what was saved"

        # Without a target: the saved mesh rebuilt over the current devices.
        plain = jaxckpt.restore(path)
        print("no-target restore, step =", plain["step"])
        print("metadata:", jaxckpt.metadata(path)["params"]["params"]["layers_0"]["kernel"])
    print("quickstart ok")


if __name__ == "__main__":
    main()
