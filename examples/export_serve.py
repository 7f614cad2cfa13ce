"""Export a Flax MLP for serving, then serve it from fresh processes on 8, 4 and 1 devices.

    python examples/export_serve.py [WORKDIR]

Builds a small MLP (no training: random weights), shards it over a (data=4, model=2) mesh,
saves the parameters with ``jaxckpt.save`` and restores them as a training job would hand
them over, exports the apply function for 1, 4 and 8 devices with a symbolic batch size,
and serves a few batches of different sizes in new processes that never import Flax or
this file: they only need ``jaxckpt.export.load``.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import subprocess
import sys
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt

BATCHES = (4, 12, 20)  # multiples of the data axis (4 on the 8-device mesh)

SERVE = """
import sys
import jax
import numpy as np
import jaxckpt

path, data = sys.argv[1], sys.argv[2]
served = jaxckpt.export.load(path)
axes = dict(zip(served.mesh.axis_names, served.mesh.devices.shape))
print(f"[serving process] {jax.device_count()} device(s), mesh {axes}")
for b in sys.argv[3].split(","):
    x, want = np.load(f"{data}/x_{b}.npy"), np.load(f"{data}/y_{b}.npy")
    y = served(x)
    err = float(np.max(np.abs(np.asarray(y) - want)))
    print(f"  batch {b:>2}: out {y.shape} sharded {y.sharding.spec}, max |served - original| {err:.1e}")
"""


class MLP(nn.Module):
    hidden: int = 256
    out: int = 10

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(self.hidden, name="hidden")(x))
        return nn.Dense(self.out, name="head")(x)


def apply(params, x):
    return MLP().apply(params, x)


def main(workdir: str) -> None:
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    specs = {
        "params": {
            "hidden": {"kernel": P(None, "model"), "bias": P("model")},
            "head": {"kernel": P("model", None), "bias": P()},
        }
    }
    params = MLP().init(jax.random.key(0), jnp.zeros((1, 32)))
    params = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)

    # What training leaves behind, and how serving picks it up: a jaxckpt checkpoint.
    ckpt = os.path.join(workdir, "ckpt", "step_1000")
    jaxckpt.save(ckpt, {"params": params, "step": 1000})
    target = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)),
        params,
        specs,
    )
    params = jaxckpt.restore(ckpt, target={"params": target})["params"]
    print(f"restored {len(jax.tree.leaves(params))} parameter arrays from {ckpt}")

    export_dir = os.path.join(workdir, "export", "mlp")
    x_spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape("batch, 32"), jnp.float32)
    sig = jaxckpt.export.save(
        export_dir,
        apply,
        params,
        x_spec,
        mesh=mesh,
        in_specs=(P("data", None),),
        out_specs=P("data", None),
        device_counts=[1, 4, 8],
    )
    print(f"exported to {export_dir}")
    for i in sig["inputs"]:
        print(f"  input  {i['name']}: {i['shape']} {i['dtype']} spec {i['spec']}")
    for o in sig["outputs"]:
        print(f"  output {o['name']}: {o['shape']} {o['dtype']} spec {o['spec']}")
    for v in sig["variants"]:
        print(f"  {v['device_count']} device(s): axis sizes {v['axis_sizes']}, {v['bytes']} bytes")
    print(f"  parameters stored once: {sig['params']['nbytes']} bytes in params/")

    data = os.path.join(workdir, "data")
    os.makedirs(data, exist_ok=True)
    host_params = jax.device_get(params)
    rng = np.random.default_rng(0)
    for b in BATCHES:
        x = rng.standard_normal((b, 32)).astype(np.float32)
        np.save(os.path.join(data, f"x_{b}.npy"), x)
        np.save(os.path.join(data, f"y_{b}.npy"), np.asarray(apply(host_params, x)))

    for n in (8, 4, 1):
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
        batches = ",".join(map(str, BATCHES))
        cmd = [sys.executable, "-c", SERVE, export_dir, data, batches]
        subprocess.run(cmd, env=env, check=True, cwd=workdir)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(tmp)
