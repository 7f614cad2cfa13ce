"""read_once: which spec a shared leaf is read with (pure logic; the multi-process reads are
measured in tests/test_multihost.py)."""

import os

import jax
import ml_dtypes
import multiproc
import numpy as np
import pytest
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._src import read_once

AXES = {"data": 4, "model": 2}


def test_replicated_axis_goes_to_the_dimension_with_the_largest_slices():
    # replicated over 'data': rows split 4 ways, in whole chunks of 256 rows
    got = read_once.read_spec(P(None, "model"), AXES, (1024, 512), (256, 256))
    assert got == P("data", "model")
    # a fully replicated leaf: the biggest axis first, each to the largest slices
    assert read_once.read_spec(P(), AXES, (1024, 512), (128, 256)) == P("data", "model")


def test_no_axis_where_slices_would_cut_chunks_or_shapes_do_not_divide():
    # one chunk a shard (small shards): splitting would read each chunk whole anyway
    assert read_once.read_spec(P(None, "model"), AXES, (1024, 512), (1024, 256)) is None
    assert read_once.read_spec(P(), AXES, (7,), (7,)) is None
    # 'data' fits dimension 1 only; 'model' then would cut its chunks of 2 in halves
    assert read_once.read_spec(P(), AXES, (3, 8), (3, 2)) == P(None, "data")
    assert read_once.read_spec(P(), AXES, (3, 8), (3, 1)) == P(None, ("data", "model"))


def test_one_process_never_reads_once(mesh42):
    s = NamedSharding(mesh42, P(None, "model"))
    assert not read_once.shared_across_processes(s, (1024, 512))
    assert read_once.read_sharding(s, (1024, 512), (256, 256), ("a",)) is None
    assert read_once.move([], []) == []
    assert jax.process_count() == 1


def test_moves_carry_bits_not_values(mesh42):
    """``move`` (and the bitcasts under it) gives back every dtype's bytes; the 1- and 2-bit
    integers, which devices can't carry safely, are never read once. (One process: the
    collectives that changed bits run only between processes, see the multi-process tests.)"""
    rng = np.random.default_rng(0)
    for dtype in DTYPES:
        if jax.dtypes.canonicalize_dtype(dtype) != dtype or not read_once.movable(dtype):
            continue
        x = random_bits((8, 16), dtype, rng)
        a = jax.device_put(x, NamedSharding(mesh42, P("data")))
        (b,) = read_once.move([a], [NamedSharding(mesh42, P(None, "model"))])
        assert b.sharding == NamedSharding(mesh42, P(None, "model"))
        assert_same_bits(x, np.asarray(b), str(dtype))
    assert not any(read_once.movable(d) for d in (ml_dtypes.int1, ml_dtypes.int2, ml_dtypes.uint1))
    assert not read_once.movable(ml_dtypes.uint2)


@pytest.mark.slow
def test_a_restore_across_hosts_moves_hundreds_of_leaves(tmp_path):
    """300 leaves of 10 shapes and dtypes, read once and moved by 2 processes as separate
    hosts: every byte arrives, in time. (With all 300 moves queued at once, such a job
    stopped for good in 2 runs of 4; this test did not catch it in the runs tried.)"""
    worker = os.path.join(os.path.dirname(__file__), "workers", "many_moves.py")
    res = multiproc.run(worker, 2, args=[str(tmp_path / "c"), "300"], timeout_s=60).check()
    assert all(f"ok {pid}" in out for pid, out in enumerate(res.outputs)), res.outputs
