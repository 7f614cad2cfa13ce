"""The host ring an accelerator's restore reads into (``jaxckpt/_src/ring.py``): slots handed
out in turn and reused only once their copies are done; restores through it (CPU devices
restored as accelerators are, ``JAXCKPT_ADOPT=0``) bit-exact, holding nothing of the ring."""

from __future__ import annotations

import ctypes
import os
import pathlib
import threading
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src import placement, ring
from jaxckpt.errors import ChecksumError


def copy_under_way() -> jax.Array:
    """A real jax array still being computed (for tens of ms): a copy not yet finished."""
    x = jnp.full((1024, 1024), 2.0, jnp.float32)
    return _slow(x)


_slow = jax.jit(lambda x: (x @ x @ x).sum())


def span(r: ring.Ring, slot: np.ndarray) -> tuple[int, int]:
    at = slot.__array_interface__["data"][0] - r.address
    return at, at + slot.nbytes


def test_slots_are_page_aligned_within_the_ring_and_never_overlap():
    r = ring.Ring(64 << 10)
    slots = [r.take(n) for n in (1, 5000, 4096, 100)]
    assert all(s is not None for s in slots)
    spans = sorted(span(r, s) for s in slots if s is not None)
    assert all(a % ring.SLOT_ALIGN == 0 and b <= r.capacity for a, b in spans)
    assert all(b <= c for (_, b), (c, _) in zip(spans, spans[1:], strict=False))


def test_a_slot_is_reused_only_once_its_copies_are_done():
    r = ring.Ring(16 << 10)
    a, b = r.take(8 << 10), r.take(8 << 10)
    assert a is not None and b is not None
    _slow(jnp.ones((1024, 1024), jnp.float32)).block_until_ready()  # (compiled first)
    copy = copy_under_way()
    r.give_back(a, [copy])
    if not copy.is_ready():
        assert r.busy == 2  # given back, still being copied
    c = r.take(4 << 10)  # no room but ``a``'s: waits for its copy, then reuses it
    assert copy.is_ready() and c is not None and span(r, c)[0] == span(r, a)[0]


def test_settle_frees_no_slot_given_back_while_it_waits():
    """Two restores share the ring (``for_restore`` counts its users): one finishing calls
    ``settle`` while the other gives a slot back, its copy onto a device still under way.
    That slot stays live: the other restore's next ``take`` gets other memory, not the
    bytes a device may still be copying (on an accelerator the next slice's read would
    overwrite them). (From a review: ``settle`` once freed every slot given back.)"""
    x = jnp.full((1024, 1024), 0.5, jnp.float32)
    _slower(x).block_until_ready()  # (compiled first)
    r = ring.Ring(64 << 10)
    first, second = r.take(8 << 10), r.take(8 << 10)
    assert first is not None and second is not None
    copy_a = _slower(x)  # the first slot's copy, under way
    r.give_back(first, [copy_a])
    settling = threading.Thread(target=r.settle)
    settling.start()  # (the other restore finishing: waits for ``copy_a``)
    time.sleep(0.01)
    if copy_a.is_ready():
        pytest.skip("the copy finished before the race could be set up (a loaded machine)")
    copy_b = _slower(copy_a)  # the second slot's copy: finishes after ``copy_a``
    r.give_back(second, [copy_b])
    settling.join(30)
    busy = not copy_b.is_ready()
    slot = r.take(16 << 10)  # the other restore's next slice
    assert slot is not None
    a, b = span(r, slot)
    s0, s1 = span(r, second)
    assert not (busy and a < s1 and s0 < b), f"slot {a}-{b} over {s0}-{s1}, still being copied"
    copy_b.block_until_ready()
    r.give_back(slot, [])
    assert r.busy == 0  # every copy done, every slot given back: all free again


_slower = jax.jit(lambda x: x @ x @ x @ x @ x @ x)


def test_a_ring_full_of_unplaced_reads_gives_fresh_memory_instead_of_waiting():
    r = ring.Ring(16 << 10)
    assert r.take(8 << 10) is not None and r.take(8 << 10) is not None
    assert r.take(4096) is None  # both slots hold reads not yet placed: never wait on those
    assert r.take((8 << 10) + 1) is None  # more than half the ring: always fresh memory


def test_the_ring_wraps_around_oldest_first():
    r = ring.Ring(32 << 10)
    first = [r.take(8 << 10) for _ in range(3)]  # 24 KiB of 32
    r.give_back(first[0], [])  # type: ignore[arg-type]
    r.give_back(first[1], [])  # type: ignore[arg-type]
    wrapped = r.take(12 << 10)  # 8 KiB left at the end: starts over at 0, before first[2]
    assert wrapped is not None and span(r, wrapped) == (0, 12 << 10)
    assert r.take(8 << 10) is None  # 4 KiB free between the wrapped slot and first[2]
    r.give_back(np.zeros(4), [])  # memory outside the ring: nothing to give back
    assert r.busy == 2


def test_a_slot_is_given_back_by_any_view_of_it():
    r = ring.Ring(64 << 10)
    slots = [r.take(12 << 10) for _ in range(3)]
    assert all(s is not None for s in slots)
    r.give_back(slots[0][5000:].view(np.uint16), [])  # type: ignore[index]
    assert r.busy == 2
    r.give_back(slots[0], [])  # type: ignore[arg-type]  # given back already: nothing
    r.give_back(slots[2], [])  # type: ignore[arg-type]  # out of order: freed after [1]
    assert r.busy == 2
    r.give_back(slots[1][:1], [])  # type: ignore[index]
    assert r.busy == 0


def test_random_takes_and_give_backs_never_hand_out_live_memory():
    rng = np.random.default_rng(0)
    r = ring.Ring(256 << 10)
    live: list[np.ndarray] = []
    for _ in range(2000):
        if live and rng.random() < 0.45:
            slot = live.pop(int(rng.integers(0, min(3, len(live)))))  # (about in order)
            r.give_back(slot[int(rng.integers(0, len(slot))) :] if rng.random() < 0.2 else slot, [])
            continue
        slot = r.take(int(rng.integers(1, 100 << 10)))
        if slot is None:
            continue
        a, b = span(r, slot)
        assert all(b <= span(r, s)[0] or span(r, s)[1] <= a for s in live), "overlap"
        live.append(slot)
    for slot in live:
        r.give_back(slot, [])
    assert r.busy == 0  # every slot found and freed


def saved_over_8(tmp_path, x: np.ndarray) -> dict:
    """``x`` saved as leaf "x" under ``tmp_path/c``; a target of it split by rows over 8
    devices."""
    jaxckpt.save(str(tmp_path / "c"), {"x": x})
    mesh = jax.make_mesh((8,), ("a",))
    return {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("a")))}


@pytest.fixture
def as_accelerator(monkeypatch):
    """CPU devices restored the way an accelerator is: no mappings, no adopted buffers,
    every slice read into the ring and copied onto its device (small leaves too: none put
    whole, ``placement.WHOLE_LEAF_BYTES``)."""
    monkeypatch.setenv("JAXCKPT_ADOPT", "0")
    monkeypatch.setenv("JAXCKPT_MAP", "0")
    monkeypatch.setattr(ring, "_ring", None)
    monkeypatch.setattr(placement, "WHOLE_LEAF_BYTES", 0)


def test_every_dtype_restores_bit_exactly_through_the_ring(tmp_path, as_accelerator, x64):
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    rng = np.random.default_rng(5)
    values = {d.name: random_bits((64, 48), d, rng) for d in DTYPES}
    state = {
        k: jax.device_put(v, NamedSharding(mesh, P("a", "b") if i % 2 else P(None, "a")))
        for i, (k, v) in enumerate(values.items())
    }
    jaxckpt.save(str(tmp_path / "c"), state)
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("b"))),
        state,
    )
    for _ in range(2):  # the second restore reuses the first's ring
        out = jaxckpt.restore(str(tmp_path / "c"), target)
        first = ring._ring
        assert first is not None and first.busy == 0  # every copy done, every slot free
        first.region[:] = 0x5A  # nothing restored shares the ring's memory
        for k, v in values.items():
            assert_same_bits(v, np.asarray(out[k]), k)
    assert ring._ring is first


def test_a_corrupt_chunk_is_named_through_the_ring_and_the_next_restore_is_exact(
    tmp_path, as_accelerator
):
    mesh = jax.make_mesh((8,), ("a",))
    x = np.arange(8 * 4096, dtype=np.float32).reshape(8, 4096)
    path = str(tmp_path / "c")
    jaxckpt.save(path, {"x": jax.device_put(x, NamedSharding(mesh, P("a")))})
    data = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if "/d/" in d + "/"]
    victim = max(data, key=os.path.getsize)
    good = pathlib.Path(victim).read_bytes()
    with open(victim, "r+b") as f:
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 1]))
    retired = len(ring._retired)
    with pytest.raises(ChecksumError, match=r"leaf 'x'.*chunk"):
        jaxckpt.restore(path)
    # a failed restore lets its ring go (only a stalled read's is kept for good: a reader
    # thread left behind may still write it)
    assert ring._ring is None and len(ring._retired) == retired
    with open(victim, "wb") as f:
        f.write(good)
    np.testing.assert_array_equal(np.asarray(jaxckpt.restore(path)["x"]), x)


def test_without_the_ring_slices_are_read_into_fresh_memory(tmp_path, as_accelerator, monkeypatch):
    monkeypatch.setenv("JAXCKPT_RING", "0")
    x = np.arange(1024, dtype=np.int32)
    target = saved_over_8(tmp_path, x)
    np.testing.assert_array_equal(np.asarray(jaxckpt.restore(str(tmp_path / "c"), target)["x"]), x)
    assert ring._ring is None


def test_safetensors_load_through_the_ring_is_bit_exact(tmp_path, as_accelerator):
    snp = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(9)
    tensors = {
        "w": random_bits((32, 64), np.dtype(ml_dtypes.bfloat16), rng),
        "b": random_bits((64,), np.dtype(np.float32), rng),
        "t": random_bits((16, 24), np.dtype(np.int8), rng),
    }
    snp.save_file(tensors, str(tmp_path / "m.safetensors"))  # the reference writer
    mesh = jax.make_mesh((4, 2), ("a", "b"))

    def on(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    target = {
        "w": on((32, 64), tensors["w"].dtype, P("a", "b")),  # runs of rows: put together
        "b": on((64,), np.float32, P("b")),
        "t": on((24, 16), np.int8, P("b", "a")),  # transposed: read whole, cut into slices
        "c": on((32, 64), np.float32, P("a")),  # "w" cast: a copy out of its slot
        "n": np.zeros((64,), np.float32),  # a NumPy result: never in the ring
    }
    out = jaxckpt.safetensors.load(
        tmp_path / "m.safetensors",
        target,
        names=lambda path: {"c": "w", "n": "b"}.get(path, path),
        transforms=[("^t$", [jaxckpt.safetensors.Transpose((1, 0))])],
        read_budget_bytes=64 << 10,  # a small ring, reused many times over
    )
    assert ring._ring is not None and ring._ring.busy == 0  # no slot left behind
    ring._ring.region[:] = 0x33
    assert_same_bits(tensors["w"], np.asarray(out["w"]), "w")
    assert_same_bits(tensors["b"], np.asarray(out["b"]), "b")
    assert_same_bits(tensors["t"].T, np.asarray(out["t"]), "t")
    assert_same_bits(tensors["w"].astype(np.float32), np.asarray(out["c"]), "c")
    assert_same_bits(tensors["b"], out["n"], "n")


def test_arrays_restored_through_the_ring_may_be_donated_before_the_next_restore(
    tmp_path, as_accelerator
):
    x = np.arange(8 * 512, dtype=np.float32).reshape(8, 512)
    target = saved_over_8(tmp_path, x)
    bump = jax.jit(lambda a: a + 1, donate_argnums=0)
    for _ in range(2):  # the ring keeps no array: a donated one does not stop its reuse
        out = jaxckpt.restore(str(tmp_path / "c"), target)
        np.testing.assert_array_equal(np.asarray(bump(out["x"])), x + 1)
        assert out["x"].is_deleted()


def test_a_larger_read_budget_gets_a_larger_ring_and_a_smaller_one_keeps_it(
    tmp_path, as_accelerator
):
    x = np.arange(64 * 1024, dtype=np.float32).reshape(64, 1024)
    target = saved_over_8(tmp_path, x)
    sizes = []
    for budget in (1 << 20, 4 << 20, 2 << 20):
        out = jaxckpt.restore(str(tmp_path / "c"), target, read_budget_bytes=budget)
        np.testing.assert_array_equal(np.asarray(out["x"]), x)
        assert ring._ring is not None
        sizes.append(ring._ring.capacity)
    assert sizes == [1 << 20, 4 << 20, 4 << 20]


def test_a_new_ring_is_faulted_in_on_a_thread_of_its_own_and_taken_from_once_ready(
    as_accelerator,
):
    """A restore's new ring is prepared (faulted in, registered) while the restore plans its
    reads; the first slot taken waits for it. Seen from outside: every page of the region
    resident (``mincore``) once ``ready``, before any slot was written."""
    from jaxckpt._src.io import linux

    with ring.for_restore(8 << 20, jax.devices()) as r:
        assert r is not None and r.ready.wait(30)
        slot = r.take(1 << 20)
        assert slot is not None and slot.ctypes.data == r.address
        pages = -(-r.capacity // 4096)
        vec = (ctypes.c_char * pages)()
        assert linux.mincore is not None and linux.mincore(r.address, r.capacity, vec) == 0
        assert sum(b[0] & 1 for b in vec) == pages


def test_an_emergency_restore_onto_another_mesh_puts_its_slices_together_in_the_ring(
    tmp_path, as_accelerator, x64
):
    """Local copies saved from a (4, 2) mesh, restored onto (2, 4): each slice is cut out of
    several saved ones, in ring slots, copied onto its devices from there."""
    mesh42, mesh24 = jax.make_mesh((4, 2), ("a", "b")), jax.make_mesh((2, 4), ("a", "b"))
    rng = np.random.default_rng(3)
    values = {d.name: random_bits((16, 24), d, rng) for d in DTYPES}
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1, async_save=False, remote=jaxckpt.Options(save_interval_steps=100)
    )
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", opts) as mgr:
        spec = NamedSharding(mesh42, P("a", "b"))
        mgr.save(1, {k: jax.device_put(v, spec) for k, v in values.items()})
        mgr.wait_until_finished()
        to = NamedSharding(mesh24, P("a", "b"))
        out = mgr.restore(target={k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=to)
                                  for k, v in values.items()})  # fmt: skip
    assert ring._ring is not None and ring._ring.busy == 0
    ring._ring.region[:] = 0x77
    for k, v in values.items():
        assert out[k].sharding == to
        assert_same_bits(v, np.asarray(out[k]), k)
