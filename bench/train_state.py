"""The benches' train state: a transformer's params + Adam mu + nu (~170 float32 arrays and
two int32 counters, about ``size_gb`` GB) with mixed PartitionSpecs over a ('data',
'model') mesh, built with known bytes (a CRC32 per leaf) so a restore can be checked bit-exact.

Importing it picks no devices: bench/compare.py sets 8 CPU devices first, bench/gpu.py
takes what jax finds.
"""

from __future__ import annotations

import os
import zlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

GB = 1e9
AXES = ("data", "model")
LAYERS = 6


def width(size_gb: float) -> int:
    """Model width d (a multiple of 64) so params + mu + nu come to about size_gb."""
    per_d2 = 3 * 4 * (12 * LAYERS + 4)  # 3 trees, float32, 12 d^2 per layer + 4 d^2 embedding
    d = round((size_gb * GB / per_d2) ** 0.5 / 64) * 64
    return max(64, d)


def layout(size_gb: float) -> list[tuple[tuple[str, ...], tuple[int, ...], str, P]]:
    """(path, shape, dtype, spec) of every leaf of the train state."""
    d = width(size_gb)
    params: list[tuple[tuple[str, ...], tuple[int, ...], P]] = [
        (("embed",), (4 * d, d), P(None, "model")),
        (("final_norm",), (d,), P()),
    ]
    for i in range(LAYERS):
        layer = f"layer_{i}"
        params += [
            ((layer, "attn", "q"), (d, d), P("data", "model")),
            ((layer, "attn", "k"), (d, d), P(None, "model")),
            ((layer, "attn", "v"), (d, d), P("data", None)),
            ((layer, "attn", "o"), (d, d), P("model", "data")),
            ((layer, "mlp", "up"), (d, 4 * d), P("data", "model")),
            ((layer, "mlp", "up_bias"), (4 * d,), P("model")),
            ((layer, "mlp", "down"), (4 * d, d), P("model", "data")),
            ((layer, "ln1", "scale"), (d,), P()),
            ((layer, "ln2", "scale"), (d,), P()),
        ]
    out = [(("step",), (), "int32", P())]
    for tree in (("params",), ("opt_state", "mu"), ("opt_state", "nu")):
        out += [(tree + path, shape, "float32", spec) for path, shape, spec in params]
    out.append((("opt_state", "count"), (), "int32", P()))
    return out


def _nest(items):
    """Nested dicts from (path, value) pairs."""
    root: dict = {}
    for path, value in items:
        node = root
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return root


def leaf_name(path: tuple[str, ...]) -> str:
    return "/".join(path)


def state_bytes(size_gb: float) -> int:
    return sum(int(np.prod(s)) * np.dtype(t).itemsize for _, s, t, _ in layout(size_gb))


def make_mesh(shape: tuple[int, int], devices: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]).reshape(shape), AXES)


def build_state(size_gb: float, mesh: Mesh) -> tuple[dict, dict[str, int]]:
    """The sharded state and the CRC32 of each leaf's bytes."""
    leaves, crcs = [], {}
    for i, (path, shape, dtype, spec) in enumerate(layout(size_gb)):
        rng = np.random.default_rng(i)
        if dtype == "int32":
            host = np.asarray(rng.integers(0, 1 << 20), dtype=np.int32).reshape(shape)
        else:
            host = rng.standard_normal(shape, dtype=np.float32)
        crcs[leaf_name(path)] = zlib.crc32(host)
        sharding = NamedSharding(mesh, spec)
        arr = jax.make_array_from_callback(shape, sharding, lambda idx, h=host: h[idx].copy())
        leaves.append((path, arr))
    return _nest(leaves), crcs


def abstract_state(size_gb: float, mesh: Mesh) -> dict:
    return _nest(
        (path, jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=NamedSharding(mesh, spec)))
        for path, shape, dtype, spec in layout(size_gb)
    )


def device_bytes(tree: dict) -> int:
    """Bytes the tree takes on its devices, every replica counted (host memory on CPU)."""
    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape)))
        * x.dtype.itemsize
        * len(x.sharding.device_set)
        for x in jax.tree.leaves(tree)
    )


def leaf_crcs(tree: dict) -> dict[str, int]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {
        "/".join(k.key for k in path): zlib.crc32(np.ascontiguousarray(np.asarray(x)))
        for path, x in flat
    }


def count_files(path: str) -> int:
    return sum(len(files) for _, _, files in os.walk(path))
