"""bits: moving bytes between shardings, every dtype's bits kept, one program per device order."""

import jax
import ml_dtypes
import numpy as np
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._src import bits


def test_reshard_moves_every_dtype_on_two_device_orders_in_few_programs(mesh42, x64):
    """Random bits of every dtype, half on a mesh of the devices in order and half on the same
    devices permuted (jit needs one device order a call), resharded in one call: every byte
    kept, the inputs kept, and one bitcast program a device order each way, not one a leaf."""
    rng = np.random.default_rng(7)
    permuted = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    values, arrays, targets = [], [], []
    for i, dtype in enumerate(DTYPES):
        mesh = (mesh42, permuted)[i % 2]
        x = random_bits((8, 16), dtype, rng)
        values.append(x)
        arrays.append(jax.device_put(x, NamedSharding(mesh, P("data"))))
        targets.append(NamedSharding(mesh, P(None, "model")))
    arrays.append(jax.device_put(values[0], targets[0]))  # already there: passed through
    targets.append(targets[0])
    values.append(values[0])
    before = bits._bitcast_fn.cache_info().misses
    moved = bits.reshard(arrays, targets)
    assert bits._bitcast_fn.cache_info().misses - before <= 4  # 2 device orders x 2 ways
    assert moved[-1] is arrays[-1]
    for x, a, b, s in zip(values, arrays, moved, targets, strict=True):
        assert b.sharding == s and b.dtype == x.dtype, (x.dtype, b.sharding)
        assert_same_bits(x, np.asarray(b), str(x.dtype))
        assert_same_bits(x, np.asarray(a), f"{x.dtype} (the input, kept)")


def test_reshard_never_donates_its_inputs(mesh42, x64):
    """Onto the same devices in another order with shards of the same shape, where jax's put
    can reuse a donated buffer: an integer array is its own bits, and was deleted."""
    permuted = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(3)
    values = [random_bits((8, 8), d, rng) for d in (np.int32, np.int8, np.float32, np.uint64)]
    arrays = [jax.device_put(v, NamedSharding(mesh42, P("data"))) for v in values]
    moved = bits.reshard(arrays, [NamedSharding(permuted, P("data"))] * len(arrays))
    for x, a, b in zip(values, arrays, moved, strict=True):
        assert not a.is_deleted(), x.dtype
        assert_same_bits(x, np.asarray(a), f"{x.dtype} (the input)")
        assert_same_bits(x, np.asarray(b), f"{x.dtype} (moved)")


def test_to_bits_and_back_leave_arrays_of_integer_dtypes_alone(mesh42):
    a = jax.device_put(np.arange(16, dtype=np.int32), NamedSharding(mesh42, P("data")))
    f = jax.device_put(np.full(16, np.nan, np.float32), NamedSharding(mesh42, P("data")))
    got_a, got_f = bits.to_bits([a, f], donate=False)
    assert got_a is a and got_f.dtype == np.uint32
    assert (np.asarray(got_f) == np.float32(np.nan).view(np.uint32)).all()
    (back,) = bits.from_bits([got_f], [np.float32])
    assert back.dtype == np.float32 and np.isnan(np.asarray(back)).all()


def test_transfer_across_device_orders_and_without_warnings(mesh42, x64, recwarn):
    """Carriers moved onto shardings of the same devices in the same order and in another
    order: bytes kept, and no warning for the caller (jax warns of each donated buffer it
    can't reuse)."""
    rng = np.random.default_rng(11)
    permuted = Mesh(np.array(jax.devices()[::-1]).reshape(4, 2), ("data", "model"))
    values = [random_bits((8, 16), d, rng) for d in (np.uint16, np.uint8, np.int32, np.uint64)]
    arrays = [jax.device_put(v, NamedSharding(mesh42, P("data"))) for v in values]
    targets = [NamedSharding(m, P(None, "model")) for m in (mesh42, permuted, mesh42, permuted)]
    moved = bits.transfer(arrays, targets)
    for x, b, s in zip(values, moved, targets, strict=True):
        assert b.sharding == s
        assert_same_bits(x, np.asarray(b), str(x.dtype))
    said = [str(w.message) for w in recwarn.list if not issubclass(w.category, DeprecationWarning)]
    assert not said, said


def test_leaves_of_one_shape_share_a_program_and_unique_ones_share_another(mesh42):
    """Leaves of one shape, dtype and sharding share one compiled program (jax's, per
    signature), and leaves of their own go in one program together: twice as many leaves
    of the shared shape compile nothing more (one program of every leaf would compile
    again, its time growing with the leaves); bits kept."""
    rng = np.random.default_rng(5)
    sharding = NamedSharding(mesh42, P("data"))
    values = [random_bits((8, 16), ml_dtypes.bfloat16, rng) for _ in range(60)]
    uniques = [random_bits((8 * k, 4), np.float32, rng) for k in (1, 2, 3)]
    arrays = [jax.device_put(v, sharding) for v in values + uniques]
    compiles: list[str] = []

    def count(name: str, secs: float, **kw) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        bits.to_bits(arrays[:30] + arrays[60:], donate=False)
        first = len(compiles)
        got = bits.to_bits(arrays, donate=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert first <= 2 and len(compiles) == first, compiles
    for v, g in zip(values + uniques, got, strict=True):
        assert g.dtype == bits.carrier(v.dtype)
        assert_same_bits(v.view(g.dtype), np.asarray(g), str(v.dtype))
