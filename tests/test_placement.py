"""Host slices onto devices (jaxckpt/_src/placement.py): every device gets the right slice,
replicas are copies (no two devices share memory), bytes exact."""

import contextlib
import itertools
import mmap

import iostats
import jax
import numpy as np
import pytest
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxckpt._src import placement
from jaxckpt._src.boxes import extent, from_slices
from jaxckpt._src.io import arrays
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


def _mapping(address: int) -> tuple[int, int, bool]:
    """The mapping holding ``address`` (smaps): its start, its end, and whether it may use
    transparent huge pages."""
    with open("/proc/self/smaps") as f:
        inside = None
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = (lo, hi) if lo <= address < hi else None
            elif inside and head == "THPeligible:":
                return inside[0], inside[1], line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding ``address`` may use transparent huge pages (smaps)."""
    return _mapping(address)[2]


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


@pytest.mark.parametrize(
    "nbytes", [arrays.HUGE_PAGE_MIN_BYTES, 3 * arrays.HUGE_PAGE_MIN_BYTES + 12345]
)
def test_huge_page_bytes_start_on_a_huge_page_and_the_mapping_ends_with_them(nbytes):
    """The kernel gives huge pages only to whole aligned 2 MiB ranges of a mapping: the
    bytes start on one, and no range past them is in the mapping (it would be a huge page
    no array uses)."""
    buf = arrays.huge_page_bytes(nbytes)
    buf[:] = 3
    start = buf.ctypes.data
    assert buf.size == nbytes and start % arrays.HUGE_PAGE_MIN_BYTES == 0 and (buf == 3).all()
    lo, hi, eligible = _mapping(start)
    assert hi == start + -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE  # (whole pages)
    assert start - lo < arrays.HUGE_PAGE_MIN_BYTES
    if _thp_offered():
        assert eligible


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_shards_of_a_leaf_share_one_huge_page_mapping_but_no_bytes(dtype, x64, mesh42):
    """Slices far below 2 MiB whose copies come to more: each copy (replicas too) gets its
    own place in one huge-page mapping of the leaf, read there by the caller
    (``host_buffer``) and adopted by its device; bytes exact, no two devices' overlapping.
    Sub-byte types, which XLA repacks, get no such buffers."""
    rows = -(-2 * arrays.HUGE_PAGE_MIN_BYTES // (64 * np.dtype(dtype).itemsize))
    full = random_bits((rows, 64), dtype, np.random.default_rng(2))
    sharding = NamedSharding(mesh42, P("data"))  # 4 slices, each on 2 devices
    out = Placement(sharding, full.shape, full.dtype)
    whole_bytes = jax.dtypes.itemsize_bits(dtype) == 8 * np.dtype(dtype).itemsize
    for index in out.indices:
        part = full[tuple(slice(a, b) for a, b in index)]
        buf = out.host_buffer(index)
        if not whole_bytes:
            assert buf is None
            buf = np.empty_like(part)
        assert buf is not None and buf.shape == part.shape and buf.dtype == full.dtype
        buf[...] = part
        out.put(index, buf)
    arr = out.array()
    assert_same_bits(full, np.asarray(arr), str(dtype))
    spans = []
    for shard in arr.addressable_shards:
        assert_same_bits(full[shard.index], np.asarray(shard.data), f"{dtype} {shard.device}")
        start = shard.data.unsafe_buffer_pointer()
        spans.append((start, start + shard.data.nbytes))
    assert len({a for a, _ in spans}) == len(spans) == len(jax.devices())
    if whole_bytes:  # (XLA packs sub-byte types: their shards' nbytes are not their buffers')
        spans.sort()
        assert all(a_end <= b for (_, a_end), (b, _) in itertools.pairwise(spans))  # no overlap
        mappings = {_mapping(a)[:2] for a, _ in spans}
        assert len(mappings) == 1  # the leaf's one mapping, adopted without a copy
        if _thp_offered():
            assert _thp_eligible(spans[0][0])


def test_buffers_of_the_callers_own_leave_the_first_copies_untouched(mesh42):
    """A caller that puts buffers of its own (the emergency tier, safetensors) instead of
    reading into ``host_buffer``: the first copies' places lie together at the start of
    the leaf's mapping and stay untouched (``mincore``), whatever the page size, so the
    mapping holds about the replicas' bytes, not twice that."""
    rows = 4 * (arrays.HUGE_PAGE_MIN_BYTES // (64 * 4))  # 4 slices of 1 MiB, 2 devices each
    full = np.random.default_rng(3).standard_normal((rows, 64)).astype(np.float32)
    out = Placement(NamedSharding(mesh42, P("data")), full.shape, full.dtype)
    firsts = [out.host_buffer(i) for i in out.indices]
    assert all(b is not None for b in firsts)
    start = min(b.ctypes.data for b in firsts)
    assert start % arrays.HUGE_PAGE_MIN_BYTES == 0
    for index in out.indices:
        own = arrays.aligned_empty(extent(index), full.dtype)
        own[...] = full[tuple(slice(a, b) for a, b in index)]
        out.put(index, own)
    arr = out.array()
    np.testing.assert_array_equal(np.asarray(arr), full)
    assert iostats.resident_bytes(start, sum(b.nbytes for b in firsts)) == 0


def _placed(full: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """``full`` on ``sharding`` through a Placement, each slice put as a copy of its own."""
    out = Placement(sharding, full.shape, full.dtype)
    for index in out.indices:
        out.put(index, np.ascontiguousarray(full[tuple(slice(a, b) for a, b in index)]))
    return out.array()


def _distinct_buffers(arr: jax.Array) -> int:
    return len({s.data.unsafe_buffer_pointer() for s in arr.addressable_shards})


ADOPTED = [d for d in DTYPES if jax.dtypes.itemsize_bits(d) == 8 * d.itemsize]
"""The dtypes CPU devices take as NumPy holds them (sub-byte ones are packed, copied)."""


SPECS = [P("data"), P(None, "model"), P(), P("data", "model"), P("model", "data")]


@pytest.mark.parametrize("own", [True, False], ids=["jax-put", "device_put"])
@pytest.mark.parametrize("dtype", ADOPTED, ids=str)
def test_cpu_slices_wait_for_array_then_each_device_adopts_its_own(
    dtype, own, x64, mesh42, monkeypatch
):
    """On CPU devices a leaf's slices wait for ``array``, which puts them with jax's own put
    (``placement._put``; a public device_put per shard cost most of a restore of small
    shards): a leaf in one call, replicas and all, unless it is replicated on every device:
    that one a device at a time (jax would give all its devices the first buffer); where
    this jax has none, a ``device_put`` of the list. Each device holds a buffer of its own,
    on the sharding asked for, each shard on its device with its slice's bits."""
    calls = []
    real = placement._put
    if own:
        monkeypatch.setattr(placement, "_put", lambda *a: calls.append(a) or real(*a))
    else:
        monkeypatch.setattr(placement, "_put", None)
    full = random_bits((8, 8), dtype, np.random.default_rng(1))
    for spec in SPECS:
        sharding = NamedSharding(mesh42, spec)
        out = Placement(sharding, full.shape, full.dtype)
        for index in out.indices:
            out.put(index, np.ascontiguousarray(full[tuple(slice(a, b) for a, b in index)]))
        assert not calls  # nothing on a device yet
        arr = out.array()
        everywhere = len(out.indices) == 1
        assert len(calls) == own * (8 if everywhere else 1) and _distinct_buffers(arr) == 8
        calls.clear()
        assert arr.sharding == sharding and arr.dtype == full.dtype
        want = sharding.addressable_devices_indices_map(full.shape)
        for shard in arr.addressable_shards:
            assert shard.index == want[shard.device]
            assert_same_bits(full[shard.index], np.asarray(shard.data), f"{dtype} {spec}")


def test_jaxs_put_gives_every_device_of_a_replicated_leaf_the_first_buffer(mesh42):
    """Why a leaf replicated on every device is put one device at a time: jax's put of the
    leaf gives all its devices the first buffer (should a jax stop doing so, it can go)."""
    sharding = NamedSharding(mesh42, P())
    devices = list(sharding.addressable_devices_indices_map((8, 8)))
    bufs = [arrays.aligned_empty((8, 8), np.dtype(np.float32)) for _ in devices]
    for k, b in enumerate(bufs):
        b[...] = k
    arr = placement._put((8, 8), sharding, devices, bufs)
    assert {float(np.asarray(s.data)[0, 0]) for s in arr.addressable_shards} == {0.0}


def test_a_jax_whose_put_refuses_gets_the_list_put(mesh42, monkeypatch):
    """A jax whose private function changed (a TypeError): each device still gets its own
    memory and its slice's bits, through ``device_put``."""

    def refusing(*args):
        raise TypeError("batched_device_put() takes 4 positional arguments")

    monkeypatch.setattr(placement, "_put", refusing)
    full = random_bits((8, 8), np.dtype(np.float32), np.random.default_rng(2))
    for spec in SPECS:
        arr = _placed(full, NamedSharding(mesh42, spec))
        assert _distinct_buffers(arr) == 8, spec
        assert_same_bits(full, np.asarray(arr), str(spec))


def test_jaxs_put_keeps_every_buffer_of_a_leaf_replicated_on_some_devices(mesh42):
    """Why a leaf replicated on some devices (not all) goes in one call: jax's put adopts
    each buffer on its own device, replicas too (should a jax give them one buffer, a
    donation on one would write the others)."""
    for spec in [P("data"), P(None, "model"), P("model")]:
        sharding = NamedSharding(mesh42, spec)
        index = sharding.addressable_devices_indices_map((8, 8))
        devices = list(index)
        bufs = [arrays.aligned_empty(extent(from_slices(index[d], (8, 8))), np.dtype(np.float32))
                for d in devices]  # fmt: skip
        for k, b in enumerate(bufs):
            b[...] = k
        arr = placement._put((8, 8), sharding, devices, bufs)
        for shard in arr.addressable_shards:
            k = devices.index(shard.device)
            assert shard.data.unsafe_buffer_pointer() == bufs[k].ctypes.data, spec
            assert float(np.asarray(shard.data)[0, 0]) == k, spec


def test_only_a_leaf_replicated_everywhere_is_put_a_device_at_a_time(mesh42, monkeypatch):
    """jax's put of a whole leaf is never handed one that every device holds whole (it
    would give them one buffer): such a leaf goes a device at a time, every other leaf in
    one call, every buffer its own."""
    seen: list[tuple[int, int, int]] = []
    real = placement._put

    def watching(shape, sharding, devices, bufs):
        index = sharding.addressable_devices_indices_map(shape)
        seen.append(
            (len(devices), len({str(index[d]) for d in devices}), len({id(b) for b in bufs}))
        )
        return real(shape, sharding, devices, bufs)

    monkeypatch.setattr(placement, "_put", watching)
    full = random_bits((8, 8), np.dtype(np.float32), np.random.default_rng(4))
    for spec in SPECS:
        arr = _placed(full, NamedSharding(mesh42, spec))
        assert_same_bits(full, np.asarray(arr), str(spec))
        assert _distinct_buffers(arr) == 8, spec
    # P("data") and P(None, "model"): 8 devices, 4 and 2 slices; P(): 8 calls of one
    assert sorted(set(seen)) == [(1, 1, 1), (8, 2, 8), (8, 4, 8), (8, 8, 8)]


@pytest.mark.parametrize("dtype", [np.float64, np.int64, np.uint64, np.complex128], ids=str)
def test_without_x64_a_64_bit_leaf_is_narrowed_as_jax_narrows_it(dtype, mesh42):
    """Without ``jax_enable_x64`` jax keeps no 64-bit arrays: the leaf comes out as
    ``device_put`` makes it (jax's narrowing), not as a float64 array jax can't hold."""
    assert not jax.config.jax_enable_x64
    full = np.random.default_rng(3).standard_normal((8, 8)).astype(dtype)
    sharding = NamedSharding(mesh42, P("data"))
    out = Placement(sharding, full.shape, full.dtype)
    for index in out.indices:
        out.put(index, np.ascontiguousarray(full[tuple(slice(a, b) for a, b in index)]))
    want = jax.device_put(full, sharding)
    with pytest.warns(UserWarning, match="truncated"):  # jax's own word on it
        arr = out.array()
    assert arr.dtype == want.dtype and want.dtype.itemsize < full.dtype.itemsize
    assert_same_bits(np.asarray(want), np.asarray(arr))


@pytest.mark.parametrize("filled", [True, False])
def test_replicas_a_reader_filled_are_taken_as_they_are(filled, mesh42):
    """``put(..., replicas=...)``: the slice was read into ``host_buffer`` and its
    ``replica_buffers`` already hold its bytes (the direct reader copies each piece as it
    checks it), so the devices adopt them with no copy: here the replicas' places hold a
    mark of their own, which the devices then show; without them each replica is a copy
    of the slice."""
    full = random_bits((1024, 512), np.dtype(np.float32), np.random.default_rng(5))  # 2 MiB
    out = Placement(NamedSharding(mesh42, P("data")), full.shape, full.dtype)
    marks = {}
    for index in out.indices:
        buf, replicas = out.host_buffer(index), out.replica_buffers(index)
        assert buf is not None and len(replicas) == 1  # 'model' holds each slice twice
        buf[...] = full[tuple(slice(a, b) for a, b in index)]
        marks[index] = np.full_like(buf, index[0][0])
        replicas[0][...] = marks[index]
        out.put(index, buf, replicas if filled else None)
    arr = out.array()
    assert _distinct_buffers(arr) == 8
    seen: dict = {index: [] for index in out.indices}
    for shard in arr.addressable_shards:
        seen[from_slices(shard.index, full.shape)].append(np.asarray(shard.data).tobytes())
    for index, got in seen.items():
        data = full[tuple(slice(a, b) for a, b in index)].tobytes()
        want = [data, marks[index].tobytes()] if filled else [data, data]
        assert sorted(got) == sorted(want), f"slice {index}, filled={filled}"


def test_populate_faults_the_pages_in_and_changes_no_byte():
    """``arrays.populate``: every page of a fresh buffer resident after it (``mincore``),
    none when stopped before the first step; a buffer already filled keeps its bytes."""
    nbytes = 3 * arrays.POPULATE_STEP // 2 + 4096 * 3 + 100  # several steps, a part page
    buf = arrays.aligned_empty((nbytes,), np.dtype(np.uint8))
    at = buf.ctypes.data
    assert iostats.resident_bytes(at, nbytes) == 0
    if not arrays.populate(buf, stop=lambda: True):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert iostats.resident_bytes(at, nbytes) == 0  # stopped before the first step
    assert arrays.populate(buf)
    assert iostats.resident_bytes(at, nbytes) >= nbytes
    filled = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
    again = filled.copy()
    assert arrays.populate(again[7:])  # (a start inside a page)
    np.testing.assert_array_equal(again, filled)


@pytest.mark.parametrize("adopt", ["1", "0"])
def test_borrowed_host_bytes_are_copied_before_a_cpu_device_gets_them(adopt, mesh42, monkeypatch):
    """A slice put from memory that is reused after (a ``ring`` slot) is copied first: CPU
    devices keep the buffers they adopt, and keep a NumPy array's memory even through
    ``device_put(..., may_alias=False)``, whether they adopt at ``array`` or as it is put
    (``JAXCKPT_ADOPT=0``)."""
    monkeypatch.setenv("JAXCKPT_ADOPT", adopt)
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    out = Placement(NamedSharding(mesh42, P("data", "model")), full.shape, full.dtype)
    reused = np.empty((16, 16), np.float32)  # one buffer, every slice in turn
    for index in out.indices:
        np.copyto(reused, full[tuple(slice(a, b) for a, b in index)])
        out.put(index, reused, borrowed=True)
        reused[:] = np.nan  # the next user of the memory
    np.testing.assert_array_equal(np.asarray(out.array()), full)


@pytest.mark.parametrize("spec", [P("data", "model"), P("data"), P()], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_small_leaf_on_devices_that_copy_is_put_whole_as_its_last_slice_arrives(
    dtype, spec, x64, mesh42, monkeypatch
):
    """Devices that copy host buffers (CPU devices with ``JAXCKPT_ADOPT=0``, as an
    accelerator does): a small leaf's slices are read into its own buffer (``stage``: none
    held by the request), and the leaf goes onto its devices in jax's put as the last slice
    is put, one call (a device at a time where it is replicated everywhere), each replica
    copied into its place; every device holds its own bytes, exact, and the leaf's buffer
    is let go."""
    monkeypatch.setenv("JAXCKPT_ADOPT", "0")
    calls: list[int] = []
    real = placement._put
    monkeypatch.setattr(placement, "_put", lambda *a: calls.append(1) or real(*a))
    full = random_bits((8, 6), dtype, np.random.default_rng(1))
    out = Placement(NamedSharding(mesh42, spec), full.shape, full.dtype)
    if jax.dtypes.itemsize_bits(full.dtype) != 8 * full.dtype.itemsize:
        assert out.stage(out.indices[0]) is None  # packed types: a put a slice
        return
    for k, index in enumerate(out.indices):
        box = tuple(slice(a, b) for a, b in index)
        assert out.host_buffer(index) is None and not out.replica_buffers(index)
        stage = out.stage(index)
        assert stage is not None and stage(full[box].nbytes + 1) is None  # another size
        slot = stage(full[box].nbytes)
        into = slot.view(full.dtype).reshape(full[box].shape)  # (a reader filling it)
        np.copyto(into, full[box])
        out.put(index, into)
        assert (out._array is not None) == (k == len(out.indices) - 1)
    assert stage(full[box].nbytes) is None  # its buffer left to jax (to its copies)
    arr = out.array()
    assert len(calls) == (8 if spec == P() else 1), calls
    assert_same_bits(full, np.asarray(arr), str(dtype))
    pointers = {s.data.unsafe_buffer_pointer() for s in arr.addressable_shards}
    assert len(pointers) == 8  # every device its own bytes
    for shard in arr.addressable_shards:
        assert_same_bits(full[shard.index], np.asarray(shard.data), f"{dtype} {shard.device}")


def test_a_leaf_over_the_bound_or_on_adopting_devices_is_not_put_whole(mesh42, monkeypatch):
    sharding = NamedSharding(mesh42, P("data"))
    monkeypatch.setenv("JAXCKPT_ADOPT", "0")
    assert Placement(sharding, (64, 64), np.float32).stage(((0, 16), (0, 64))) is not None
    monkeypatch.setattr(placement, "WHOLE_LEAF_BYTES", 64 * 64 * 4)  # its 2 copies: 32 KiB
    assert Placement(sharding, (64, 64), np.float32).stage(((0, 16), (0, 64))) is None
    monkeypatch.setenv("JAXCKPT_ADOPT", "1")  # adopted: read into its own memory, put at array
    adopted = Placement(sharding, (64, 64), np.float32)
    assert adopted.host_buffer(((0, 16), (0, 64))) is not None
    assert adopted.stage(((0, 16), (0, 64))) is None


def test_two_placing_threads_put_a_small_leaf_whole_once(mesh42, monkeypatch):
    """Placing threads put the slices of one small leaf side by side: the leaf goes onto its
    devices once, by the thread that put its last slice, with every slice in it. (Each
    thread's last slice waits, once set aside, for the other's, and each look at a complete
    leaf for the other's, so that without the lock both threads see the leaf complete.)"""
    import threading

    monkeypatch.setenv("JAXCKPT_ADOPT", "0")
    calls: list[int] = []
    real = placement._put
    monkeypatch.setattr(placement, "_put", lambda *a: calls.append(1) or real(*a))
    full = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    out = Placement(NamedSharding(mesh42, P("data", "model")), full.shape, full.dtype)
    work = [(i, full[tuple(slice(a, b) for a, b in i)].copy()) for i in out.indices]
    lasts = {work[-1][0], work[-2][0]}
    meet = [threading.Barrier(2, timeout=0.25) for _ in range(2)]

    class Meeting(dict):  # (the other thread held by the lock: it comes after, the wait ends)
        def __setitem__(self, key, value) -> None:
            super().__setitem__(key, value)
            if key in lasts:  # both threads' last slices set aside before either looks
                with contextlib.suppress(threading.BrokenBarrierError):
                    meet[0].wait()

        def __len__(self) -> int:
            n = super().__len__()
            if n == len(work):  # and both look before either puts the leaf
                with contextlib.suppress(threading.BrokenBarrierError):
                    meet[1].wait()
            return n

    out._waiting = Meeting()
    errors: list[Exception] = []

    def put(half: list) -> None:
        try:
            for index, data in half:
                out.put(index, data)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=put, args=(work[k::2],)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(calls) == 1, (errors, calls)
    np.testing.assert_array_equal(np.asarray(out.array()), full)
