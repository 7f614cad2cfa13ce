"""Host slices onto devices (jaxckpt/_src/placement.py): every device gets the right slice,
replicas are copies (no two devices share memory), bytes exact."""

import jax
import numpy as np
import pytest
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._src.boxes import from_slices
from jaxckpt._src.placement import Placement


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_replicas_are_exact_copies_that_share_no_memory(dtype, x64, mesh42):
    full = random_bits((8, 6), dtype, np.random.default_rng(0))  # NaN payloads, -0.0, ...
    sharding = NamedSharding(mesh42, P("data"))  # each row block on the 2 "model" devices
    out = Placement(sharding, full.shape, full.dtype)
    assert len(out.indices) == 4
    for index in out.indices:
        out.put(index, np.ascontiguousarray(full[tuple(slice(a, b) for a, b in index)]))
    arr = out.array()
    assert arr.sharding == sharding
    assert_same_bits(full, np.asarray(arr), str(dtype))
    pointers = set()
    for shard in arr.addressable_shards:
        assert_same_bits(full[shard.index], np.asarray(shard.data), f"{dtype} {shard.device}")
        pointers.add(shard.data.unsafe_buffer_pointer())
    assert len(pointers) == len(jax.devices())  # 8 buffers: replicas are copies


def test_a_leaf_replicated_everywhere(mesh42):
    value = np.arange(12, dtype=np.int32).reshape(3, 4)
    out = Placement(NamedSharding(mesh42, P()), value.shape, value.dtype)
    (index,) = out.indices
    assert index == from_slices((slice(None), slice(None)), value.shape)
    out.put(index, value.copy())
    arr = out.array()
    assert len({s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}) == 8
    for shard in arr.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value)
