"""read_once: which spec a shared leaf is read with (pure logic; the multi-process reads are
measured in tests/test_multihost.py)."""

import jax
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
