"""Property: a tree round-trips through ``jaxckpt.safetensors`` with random ``names`` and
``transforms`` chains (Reshape and Transpose in any order, Stack), bit for bit.

Each case draws file tensors (random bit patterns of a safetensors dtype, NaN payloads
included), a chain of steps, and the leaf a plain NumPy model of that chain makes of them.
``save`` of the leaf must write exactly the file tensors (read by the reference, the
``safetensors`` package), and ``load`` onto a random sharding must give back exactly the leaf.
"""

import math
import os
import tempfile

import jax
import numpy as np
import pytest
from hostile import random_bits
from hypothesis import event, given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src.safetensors.format import DTYPES
from jaxckpt.safetensors import Reshape, Stack, Transpose

safetensors = pytest.importorskip("safetensors")


def _factor(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


@st.composite
def new_shape(draw, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A random shape with as many elements as ``shape``."""
    dims = draw(st.integers(1, 4))
    out = [1] * dims
    for f in _factor(math.prod(shape)):
        out[draw(st.integers(0, dims - 1))] *= f
    return tuple(out)


@st.composite
def chains(draw, shape: tuple[int, ...]) -> list:
    """Reshape/Transpose steps from a tensor of ``shape``, in a random order."""
    steps = []
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            axes = tuple(draw(st.permutations(range(len(shape)))))
            steps.append(Transpose(axes))
            shape = tuple(shape[a] for a in axes)
        else:
            to = draw(new_shape(shape))
            steps.append(Reshape(shape, to))
            shape = to
    return steps


def model(steps: list, x: np.ndarray) -> np.ndarray:
    """The chain in plain NumPy, from the file's tensor towards the leaf."""
    for s in steps:
        if isinstance(s, Transpose):
            x = np.transpose(x, s.axes)
        else:
            assert x.shape == tuple(s.file_shape)
            x = x.reshape(s.shape)
    return x


def spec_for(draw, shape: tuple[int, ...]) -> P:
    free = {"data": 4, "model": 2}
    out = []
    for d in shape:
        axis = draw(st.sampled_from([None, *[a for a, n in free.items() if d % n == 0]]))
        out.append(axis)
        free.pop(axis, None)
    return P(*out)


def reference(directory: str) -> dict:
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with open(os.path.join(directory, name), "rb") as f:
                for tensor, t in safetensors.deserialize(f.read()):
                    raw = np.frombuffer(bytes(t["data"]), DTYPES[t["dtype"]])
                    out[tensor] = raw.reshape(t["shape"])
    return out


@pytest.mark.property
@given(st.data())
def test_round_trip_through_random_names_and_transform_chains(data):
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    draw = data.draw
    dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    steps = draw(chains(shape))
    layers = draw(st.one_of(st.none(), st.integers(1, 3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    files = [random_bits(shape, dtype, rng) for _ in range(layers or 1)]
    leaf = np.stack([model(steps, f) for f in files]) if layers else model(steps, files[0])
    bias = random_bits((4,), dtype, rng)
    event(f"{len(steps)} steps, {'stacked' if layers else 'one tensor'}")

    pattern = "model.layers.{i}.\\1.weight" if layers else "model.\\1.weight"
    names = [(r"^params\.(\w+)\.kernel$", pattern), (r"^params\.bias$", "bias")]
    chain = [Stack(), *steps] if layers else steps
    transforms = [(r"kernel$", chain)]
    on_devices = dtype.itemsize < 8  # 64-bit dtypes stay NumPy (jax_enable_x64 is off)
    if on_devices:
        sharding = NamedSharding(mesh, spec_for(draw, leaf.shape))
        value = jax.device_put(leaf, sharding)
        # bits, not values: device_put of a NaN-holding host array moves its bytes as is
        assert np.asarray(value).tobytes() == leaf.tobytes()
    else:
        value = leaf
    tree = {"params": {"up": {"kernel": value}, "bias": bias}}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m")
        max_file_bytes = draw(st.sampled_from([16, 5e9]))
        jaxckpt.safetensors.save(
            path, tree, names=names, transforms=transforms, max_file_bytes=max_file_bytes
        )
        ref = reference(path)
        want = {"bias": bias}
        for i, f in enumerate(files):
            want[f"model.layers.{i}.up.weight" if layers else "model.up.weight"] = f
        assert sorted(ref) == sorted(want)
        for name, a in want.items():
            assert ref[name].dtype == a.dtype and ref[name].shape == a.shape, name
            assert ref[name].tobytes() == a.tobytes(), name
        if on_devices:
            spec = NamedSharding(mesh, spec_for(draw, leaf.shape))
            kernel = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=spec)
        else:
            kernel = np.zeros(leaf.shape, leaf.dtype)
        target = {"params": {"up": {"kernel": kernel}, "bias": np.zeros(4, dtype)}}
        out = jaxckpt.safetensors.load(path, target, names=names, transforms=transforms)
        got = out["params"]["up"]["kernel"]
        assert got.shape == leaf.shape and np.dtype(got.dtype) == leaf.dtype
        if on_devices:
            assert got.sharding == spec
            for shard in got.addressable_shards:
                assert np.asarray(shard.data).tobytes() == leaf[shard.index].tobytes()
        assert np.asarray(got).tobytes() == leaf.tobytes()
        assert np.asarray(out["params"]["bias"]).tobytes() == bias.tobytes()
