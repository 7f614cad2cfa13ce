"""Shared fixtures. Eight virtual CPU devices, set before jax is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


@pytest.fixture
def mesh42():
    return jax.make_mesh((4, 2), ("data", "model"))


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


def sharded(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def assert_tree_equal(a, b):
    """Bit-exact equality of two pytrees (structure, dtypes and values)."""
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert ta == tb, f"structure differs:\n{ta}\n{tb}"
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert isinstance(y, jax.Array) and y.dtype == x.dtype
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype, (x.dtype, y.dtype)
            assert x.shape == y.shape, (x.shape, y.shape)
            assert x.tobytes() == y.tobytes()
        else:
            assert type(x) is type(y) and x == y, (x, y)
