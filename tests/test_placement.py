"""Host slices onto devices (jaxckpt/_src/placement.py): every device gets the right slice,
replicas are copies (no two devices share memory), bytes exact."""

import jax
import numpy as np
import pytest
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._src import arrays
from jaxckpt._src.boxes import extent, from_slices
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


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding ``address`` may use transparent huge pages (smaps)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_offered() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_replicas_are_exact_and_in_huge_page_buffers(dtype, x64, mesh42):
    """Slices of 2 MiB or more: every replica is a buffer of its own, its bytes exact; of a
    whole-byte dtype, in memory advised for huge pages that the device adopted (XLA packs
    1-, 2- and 4-bit types into buffers of its own)."""
    width = -(-arrays.HUGE_PAGE_MIN_BYTES // (2 * np.dtype(dtype).itemsize))
    full = random_bits((8, width), dtype, np.random.default_rng(1))
    sharding = NamedSharding(mesh42, P("data"))  # 4 slices of (2, width), 2 devices each
    out = Placement(sharding, full.shape, full.dtype)
    for index in out.indices:
        part = arrays.aligned_empty(extent(index), full.dtype)
        part[...] = full[tuple(slice(a, b) for a, b in index)]
        out.put(index, part)
    arr = out.array()
    assert_same_bits(full, np.asarray(arr), str(dtype))
    pointers = set()
    for shard in arr.addressable_shards:
        assert_same_bits(full[shard.index], np.asarray(shard.data), f"{dtype} {shard.device}")
        pointer = shard.data.unsafe_buffer_pointer()
        pointers.add(pointer)
        if _thp_offered() and jax.dtypes.itemsize_bits(dtype) % 8 == 0:
            assert _thp_eligible(pointer), f"{shard.device}'s buffer is not huge-page memory"
    assert len(pointers) == len(jax.devices())


@pytest.mark.parametrize("nbytes", [arrays.HUGE_PAGE_MIN_BYTES - 1, 3 * arrays.HUGE_PAGE_MIN_BYTES])
def test_restore_buffers_from_2_mib_are_huge_page_memory(nbytes):
    """aligned_empty: 64-byte aligned, writable; from 2 MiB in memory advised for huge pages
    (smaller ones come from NumPy's heap, which may or may not be)."""
    buf = arrays.aligned_empty((nbytes,), np.dtype(np.uint8))
    buf[:] = 7  # writable, and touched
    assert buf.ctypes.data % 64 == 0 and buf.size == nbytes and buf.flags.c_contiguous
    assert (buf == 7).all()
    if _thp_offered() and nbytes >= arrays.HUGE_PAGE_MIN_BYTES:
        assert _thp_eligible(buf.ctypes.data)
