"""Device->host snapshots (jaxckpt/_src/staging.py): bytes exact on every way a snapshot is
made (a CPU device's view, pinned host memory, reused buffers), parts of shards, and the
snapshot outliving the arrays it was taken from."""

import gc

import jax
import numpy as np
import pytest
from conftest import Calls
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src import staging


def _device_array(dtype, shape=(8, 6), device=None):
    """Random bits on ``device`` (default: jax's first; a GPU's where there is one, so
    these tests check the accelerator's ways there)."""
    host = random_bits(shape, dtype, np.random.default_rng(3))
    return host, jax.device_put(host, device or jax.devices()[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pinned", [True, False, None], ids=["pinned", "buffers", "auto"])
def test_a_snapshot_holds_the_bytes(dtype, pinned, x64):
    host, arr = _device_array(dtype)
    copies = staging.HostCopies(pinned=pinned)
    get = copies.snapshot(("leaf", 0), arr)
    copies.run_copies()
    assert_same_bits(host, get(), f"{dtype} pinned={pinned}")


def test_ways_of_making_a_snapshot_on_a_cpu_device():
    host, arr = _device_array(np.float32, device=jax.devices("cpu")[0])
    ptr = arr.unsafe_buffer_pointer()
    auto, pinned, buffers = (staging.HostCopies(p) for p in (None, True, False))
    got = {c.pinned: c.snapshot(("x",), arr) for c in (auto, pinned, buffers)}
    for c in (auto, pinned, buffers):
        c.run_copies()
    assert got[None]().ctypes.data == ptr  # a CPU device's buffer is host memory: a view
    assert got[True]().ctypes.data != ptr  # a copy in pinned host memory
    assert got[False]().ctypes.data != ptr  # a copy in the buffer kept for the next save
    assert buffers.buffers[("x",)] is got[False]()
    assert not auto.buffers and not pinned.buffers


def test_device_buffers_copied_into_buffers_reused_across_snapshots():
    """The way of devices without pinned host memory (and where it runs out)."""
    copies = staging.HostCopies(pinned=False)
    host, arr = _device_array(np.dtype("bfloat16"))
    first = copies.snapshot(("x",), arr)
    copies.run_copies()
    kept = first()
    assert_same_bits(host, kept, "bfloat16 into a buffer")
    again = jax.device_put(host[::-1].copy(), jax.devices()[0])
    second = copies.snapshot(("x",), again)
    copies.run_copies()
    assert second() is kept  # the same buffer, refilled
    assert_same_bits(host[::-1], second(), "bfloat16 into the reused buffer")


def test_a_leaf_already_in_host_memory():
    """An offloaded leaf (memory_kind pinned_host): an accelerator's is copied into a reused
    buffer (a device_put to where it is already could hand back the array itself); a CPU
    device's is host memory like any of its buffers, and viewed."""
    dev = jax.devices()[0]
    host = random_bits((8, 6), np.dtype("float32"), np.random.default_rng(2))
    arr = jax.device_put(host, staging._pinned_on(dev))
    copies = staging.HostCopies()
    get = copies.snapshot(("x",), arr)
    copies.run_copies()
    assert_same_bits(host, get(), "float32 offloaded")
    copied = ("x",) in copies.buffers and get() is copies.buffers[("x",)]
    assert copied == (dev.platform != "cpu")
    assert np.shares_memory(get(), np.asarray(arr)) == (dev.platform == "cpu")


def test_numpy_leaves_are_copied_into_buffers_reused_across_snapshots():
    copies = staging.HostCopies()
    host = random_bits((8, 6), np.dtype("float16"), np.random.default_rng(1))
    first = copies.snapshot(("x",), host)
    copies.run_copies()
    kept = first()
    assert kept is copies.buffers[("x",)] and not np.shares_memory(kept, host)
    again = host[::-1].copy()
    second = copies.snapshot(("x",), again)
    copies.run_copies()
    assert second() is kept
    assert_same_bits(again, second(), "float16 into a reused buffer")


def test_a_pinned_snapshot_outlives_its_source_and_its_device_copy():
    host, arr = _device_array(np.uint8, (1 << 20,))
    copies = staging.HostCopies(pinned=True)
    get = copies.snapshot(("x",), arr)
    copies.run_copies()
    del arr
    gc.collect()
    churn = [jax.device_put(np.full(1 << 20, 7, np.uint8), staging._pinned_on(d))
             for d in jax.devices() for _ in range(4)]  # fmt: skip
    jax.block_until_ready(churn)
    assert_same_bits(host, get(), "pinned snapshot after its source was freed")


def test_reading_a_snapshot_before_the_copies_ran_is_an_error():
    copies = staging.HostCopies(pinned=True)
    get = copies.snapshot(("x",), _device_array(np.float32)[1])
    with pytest.raises(RuntimeError, match="before HostCopies.run_copies"):
        get()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pinned", [True, False, None], ids=["pinned", "buffers", "auto"])
def test_a_part_of_a_shard_is_snapshot_and_read_exactly(dtype, pinned, x64):
    """A part of a shard (a shard several processes hold is split among them): staged, and
    read by a synchronous save, bytes exact. Through pinned memory the part is sliced on its
    device first (1-bit types, which jax does not slice, on the host)."""
    host, arr = _device_array(dtype, (8, 6))
    shard = ((8, 16), (0, 6))  # the buffer's box in a (16, 6) leaf
    for region in [((10, 14), (0, 6)), ((8, 16), (2, 5)), ((12, 13), (5, 6))]:
        part = staging.Part("w", arr, shard, region)
        want = host[
            tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(region, shard, strict=True))
        ]
        copies = staging.HostCopies(pinned=pinned)
        get = part.on_host(copies)
        copies.run_copies()
        assert_same_bits(want, get(), f"{dtype} staged {region} pinned={pinned}")
        assert_same_bits(want, part(), f"{dtype} read {region}")


def test_a_leaf_staged_and_saved(mesh42, tmp_path):
    """A snapshot through pinned memory is what a save writes (the arrays freed first)."""
    full = random_bits((16, 32), np.dtype("bfloat16"), np.random.default_rng(5))
    arr = jax.device_put(full, NamedSharding(mesh42, P("data")))
    described = staging.describe({"w": arr, "n": np.arange(5)})
    staged = staging.snapshot(described, staging.HostCopies(pinned=True))
    assert staged.host_bytes == full.nbytes + 5 * 8
    del arr
    jaxckpt.save(tmp_path / "c", staged)
    target = {"w": jax.ShapeDtypeStruct(full.shape, full.dtype, sharding=NamedSharding(mesh42, P())),
              "n": np.zeros(5, np.int64)}  # fmt: skip
    out = jaxckpt.restore(tmp_path / "c", target)
    assert_same_bits(full, np.asarray(out["w"]), "bfloat16")
    np.testing.assert_array_equal(out["n"], np.arange(5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunk_bytes", [None, 64], ids=["whole", "parts"])
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "auto"])
def test_a_save_from_device_arrays_keeps_every_bit(
    dtype, chunk_bytes, pinned, x64, tmp_path, monkeypatch
):
    """``jaxckpt.save`` reads each part straight from its device (pinned memory on an
    accelerator, forced here on CPU devices: the small pieces of two leaves in one batched
    copy): whole shards, and parts of one (small chunks)."""
    if pinned:
        monkeypatch.setattr(staging, "_via_pinned", lambda data: True)
    host, arr = _device_array(dtype, (16, 8))
    other = random_bits((16, 8), dtype, np.random.default_rng(8))
    tree = {"x": arr, "y": jax.device_put(other, jax.devices()[1])}
    jaxckpt.save(tmp_path / "c", tree, chunk_bytes=chunk_bytes)
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()
    }
    out = jaxckpt.restore(tmp_path / "c", target)
    assert_same_bits(host, np.asarray(out["x"]), f"{dtype} chunk_bytes={chunk_bytes}")
    assert_same_bits(other, np.asarray(out["y"]), f"{dtype} chunk_bytes={chunk_bytes}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pinned", [True, None], ids=["pinned", "auto"])
def test_to_host_gives_a_part_of_a_buffer(dtype, pinned, x64):
    """The one read of a device buffer a synchronous save makes: the part it writes."""
    host, arr = _device_array(dtype, (8, 6))
    for part in [(), (slice(2, 6), slice(0, 6)), (slice(0, 8), slice(3, 5))]:
        got = staging.to_host(arr, part, pinned=pinned)
        assert_same_bits(host[part], got, f"{dtype} {part} pinned={pinned}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_parts_go_to_pinned_memory_in_one_batched_copy(dtype, x64, monkeypatch):
    """``to_host_all``: whole shards and parts of shards, bytes exact, in one
    ``device_put``; a NumPy leaf's part and any other callable are called as they are."""
    arrays = [_device_array(dtype, (8, 6), jax.devices()[i % 2]) for i in range(3)]
    shard = ((8, 16), (0, 6))
    regions = [shard, ((10, 14), (0, 6)), ((8, 16), (3, 5))]
    parts = [staging.Part("w", a, shard, r) for (_, a), r in zip(arrays, regions, strict=True)]
    numpy_leaf = random_bits((5,), dtype, np.random.default_rng(9))
    gets = [*parts, staging.Part("n", numpy_leaf, None, ((0, 5),)), lambda: numpy_leaf[:2]]
    puts = Calls(monkeypatch, jax, "device_put")
    got = staging.to_host_all(gets, pinned=True)
    assert puts.count == 1
    for (host, _), r, g in zip(arrays, regions, got[:3], strict=True):
        want = host[tuple(slice(a - s, b - s) for (a, b), (s, _) in zip(r, shard, strict=True))]
        assert_same_bits(want, g, f"{dtype} {r}")
    assert_same_bits(numpy_leaf, got[3], f"{dtype} numpy")
    assert_same_bits(numpy_leaf[:2], got[4], f"{dtype} callable")


def test_a_batch_pinned_memory_refuses_comes_part_by_part(monkeypatch):
    """Where the batched copy fails (pinned host memory exhausted, say), each part is read on
    its own, every bit as it is."""
    real = jax.device_put

    def refusing_lists(x, *args, **kwargs):
        if isinstance(x, list):
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")
        return real(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", refusing_lists)
    arrays = [_device_array(np.dtype("bfloat16"), (8, 6), jax.devices()[i]) for i in range(3)]
    shard = ((0, 8), (0, 6))
    parts = [staging.Part("w", a, shard, ((2, 6), (0, 6))) for _, a in arrays]
    got = staging.to_host_all(parts, pinned=True)
    for (host, _), g in zip(arrays, got, strict=True):
        assert_same_bits(host[2:6], g, "bfloat16")


def test_a_synchronous_save_fetches_small_shards_in_batches(monkeypatch, tmp_path):
    """A save of many small leaves through pinned memory (forced on CPU devices) copies them
    to the host a run at a time, not a call each, and writes every bit; a large leaf
    between them goes alone."""
    from jaxckpt._src.io import ocdbt_write

    monkeypatch.setattr(staging, "_via_pinned", lambda data: True)
    monkeypatch.setattr(ocdbt_write, "FETCH_BYTES", 64 << 10)
    rng = np.random.default_rng(4)
    host = {f"s{i:03d}": random_bits((32, 32), np.dtype("float32"), rng) for i in range(60)}
    host["big"] = random_bits((1024, 512), np.dtype("bfloat16"), rng)  # 1 MiB + a piece
    host["big"] = np.concatenate([host["big"], host["big"][:8]])
    tree = {k: jax.device_put(v, jax.devices()[0]) for k, v in host.items()}
    calls: list[list[int]] = []  # each device_put's arrays, by bytes
    real = jax.device_put

    def watching(x, *args, **kwargs):
        calls.append([a.nbytes for a in (x if isinstance(x, list) else [x])])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", watching)
    jaxckpt.save(tmp_path / "c", tree)
    # 60 leaves of 4 KiB (+ trailers) in runs of at most 64 KiB: 4 runs; the big one alone
    assert 2 <= len(calls) <= 6, calls
    assert [host["big"].nbytes] in calls
    assert all(sum(c) <= 64 << 10 for c in calls if host["big"].nbytes not in c), calls
    assert sum(map(len, calls)) == len(host)  # every leaf once
    out = jaxckpt.restore(tmp_path / "c", {k: np.zeros_like(v) for k, v in host.items()})
    for k, v in host.items():
        assert_same_bits(v, out[k], k)
