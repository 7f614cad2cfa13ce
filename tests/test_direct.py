"""The direct read path: chunks read with preadv straight into the restored buffers.

Proof that it ran comes from outside it: ``os.preadv`` wrapped to count calls, buffers and
bytes (TensorStore reads files with its own C++ code, never through Python's ``os``).
"""

import collections
import itertools
import os
import re
import shutil
import threading

import iostats
import jax
import multiproc
import numpy as np
import pytest
import tensorstore as ts
from conftest import flip_a_chunk_byte, flip_byte, sharded
from hostile import DTYPES, assert_same_bits, direct_dtype, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors
from jaxckpt._src.io import (
    arrays,
    batch,
    chunk_plan,
    crc,
    direct,
    layout,
    linux,
    mapped,
    ocdbt_write,
    residency,
    scatter,
    spans,
)
from jaxckpt._src.storage import Location, location

WORKER = os.path.join(os.path.dirname(__file__), "workers", "save_restore.py")


class Preadv:
    """Counts ``os.preadv`` calls, the buffers handed to them, the bytes read and the
    threads that read (not the 1-byte page-cache probes, ``RWF_NOWAIT``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = self.buffers = self.bytes = 0
        self.threads: set[int] = set()
        real = os.preadv

        def counting(fd, buffers, offset, *rest):
            if rest and rest[0] & getattr(os, "RWF_NOWAIT", 0):
                return real(fd, buffers, offset, *rest)
            self.threads.add(threading.get_ident())
            self.calls += 1
            self.buffers += len(buffers)
            n = real(fd, buffers, offset, *rest)
            self.bytes += n
            return n

        monkeypatch.setattr(os, "preadv", counting)


@pytest.fixture
def preadv(monkeypatch):
    monkeypatch.delenv(linux.DIRECT_READ, raising=False)
    return Preadv(monkeypatch)


def _chunk_values(path) -> list[arrays.ChunkBytes]:
    """Every chunk value of the checkpoint at ``path`` stored outside the B-tree."""
    db = arrays.database_dir(location(str(path)), None)
    kv = ts.KvStore.open(arrays.kvstore_spec(db), context=arrays.new_context()).result()
    keys = {k.decode() for k in kv.list().result() if b"/c" in k}
    return [v for v in arrays.chunk_bytes(kv.base, db, keys).values() if not v.inline]


@pytest.mark.parametrize("maps", ["mapped", "read"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hostile_values_restore_bit_exactly(
    dtype, maps, x64, preadv, mesh42, tmp_path, monkeypatch
):
    """Random bit patterns of every dtype: onto the saved mesh (whole shards, read directly
    where the dtype's bytes are stored as they are), and onto meshes that read two chunks
    into one slice or cut through chunks (each chunk read once, a piece at a time, each
    slice's half copied out of each piece: ``scatter``), with mappings allowed wherever
    this kernel maps, whatever the filesystem under the test, or not (``JAXCKPT_MAP=0``)."""
    if maps == "mapped":
        monkeypatch.setattr(mapped, "enabled", lambda path: mapped._kernel())
    else:
        monkeypatch.setenv(linux.MAP, "0")
    x = random_bits((256, 64), dtype, np.random.default_rng(7))
    tree = {"x": sharded(x, mesh42, ("data",)), "n": x[:64]}
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert_same_bits(x, np.asarray(out["x"]), f"{dtype} same mesh")
    assert_same_bits(x[:64], out["n"], f"{dtype} numpy")
    # 4 shards of 64 x 64 (the 'model' replicas read once each) and the NumPy leaf
    expected = (x.nbytes + x[:64].nbytes + 5 * 4) if direct_dtype(dtype) else 0
    assert preadv.bytes == expected, (preadv.calls, preadv.bytes)

    # onto (8, 1) each chunk cut in two is read once for both halves (``scatter``), mapped
    # or not
    for shape, direct_bytes in [((2, 4), x.nbytes + 4 * 4), ((8, 1), x.nbytes + 4 * 4)]:
        mesh = jax.make_mesh(shape, ("data", "model"))
        target = {"x": NamedSharding(mesh, P("data")), "n": x[:64]}
        before = preadv.bytes
        out = jaxckpt.restore(tmp_path / "c", target=target)
        assert_same_bits(x, np.asarray(out["x"]), f"{dtype} onto {shape}")
        for shard in out["x"].addressable_shards:
            assert_same_bits(x[shard.index], np.asarray(shard.data), f"{dtype} {shard.device}")
        # 2x4: two whole chunks a slice; 8x1: each chunk read once for the two halves
        if direct_dtype(dtype):
            assert preadv.bytes - before == direct_bytes + x[:64].nbytes + 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stacked_chunks_wider_than_a_piece_restore_bit_exactly(
    dtype, x64, preadv, tmp_path, monkeypatch
):
    """Stacked weights saved a layer a device (a chunk: one row of 16 x 24 values), restored
    onto a mesh that cuts every chunk's last axis in four, with a piece smaller than a row
    (``scatter.cut``: 4 slabs of its second axis, of 5 at most): random bits of every dtype come back
    exactly, and each chunk is read once for the four slices that need it."""
    monkeypatch.setenv(linux.MAP, "0")
    x = random_bits((8, 16, 24), dtype, np.random.default_rng(11))
    monkeypatch.setattr(scatter, "PIECE_BYTES", 5 * 24 * x.itemsize)
    cuts: list[scatter.Cut] = []
    real_cut = scatter.cut
    monkeypatch.setattr(scatter, "cut", lambda p: cuts.append(real_cut(p)) or cuts[-1])
    layers = NamedSharding(jax.make_mesh((8,), ("e",)), P("e"))
    jaxckpt.save(tmp_path / "c", {"x": jax.device_put(x, layers)})
    cut = NamedSharding(jax.make_mesh((2, 4), ("e", "m")), P("e", None, "m"))
    before = preadv.bytes
    out = jaxckpt.restore(tmp_path / "c", target={"x": cut})
    assert_same_bits(x, np.asarray(out["x"]), f"{dtype} onto (2, 4)")
    for shard in out["x"].addressable_shards:
        assert_same_bits(x[shard.index], np.asarray(shard.data), f"{dtype} {shard.device}")
    if direct_dtype(dtype):
        assert preadv.bytes - before == x.nbytes + 8 * 4  # each chunk and its CRC once
        assert {c[:2] for c in cuts} == {(1, 4)}, cuts  # 4 slabs of a row a piece (of 5 at most)


def test_chunks_of_a_shard_are_coalesced(preadv, mesh42, tmp_path, monkeypatch):
    """Tall shards cut into row chunks (each a contiguous run of the slice): the chunks of a
    shard that lie back to back in their data file come in one preadv of many buffers,
    their CRC trailers included (each shard read on its own: no batches of small ones)."""
    monkeypatch.setattr(direct, "SMALL_CHUNK_BYTES", 0)
    x = np.random.default_rng(0).standard_normal((4096, 32)).astype(np.float32)
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))}, chunk_bytes=16 << 10)
    db = arrays.database_dir(location(str(tmp_path / "c")), None)
    kv = ts.KvStore.open(arrays.kvstore_spec(db), context=arrays.new_context()).result()
    keys = {f"x/c/{i}/0" for i in range(32)}  # 4 shards of 256 KiB in 16 KiB chunks
    where = arrays.chunk_bytes(kv.base, db, keys)
    assert set(where) == keys and not any(v.inline for v in where.values())
    runs = 0  # stretches of a shard's chunks stored back to back (TensorStore's order)
    for shard in range(4):
        at = sorted((where[f"x/c/{i}/0"] for i in range(8 * shard, 8 * shard + 8)),
                    key=lambda v: (v.file, v.start))  # fmt: skip
        runs += 1 + sum(a.file != b.file or a.stop != b.start for a, b in itertools.pairwise(at))
    assert runs < len(keys)
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    assert preadv.bytes == x.nbytes + 4 * len(keys)
    assert preadv.calls == runs
    assert preadv.buffers == 2 * len(keys)


@pytest.mark.parametrize("rows,cold", [(4096, True), (4096, False), (262144, True)])
def test_each_read_asks_the_kernel_to_prefetch_its_chunks(
    rows, cold, mesh42, tmp_path, monkeypatch
):
    """As a slice's read is issued, the whole MiB blocks of the files that hold its chunks
    are advised WILLNEED (seen from outside: ``os.posix_fadvise`` wrapped), consecutive ones
    merged, each block once a restore, when the files are not in the page cache: every
    block of every chunk is looked at once, and each stretch of them is advised exactly
    when the page-cache probe of its last byte missed (the kernel's readahead, up to
    ``read_ahead_kb`` past an earlier read, 8 MiB here, may have brought a stretch in before
    its read is issued: how far it got depends on the machine's speed); of 16 KiB chunks
    (4096 rows, 32 chunks in one or two blocks a file), one call a stretch of blocks, not
    one a chunk. None when cached."""
    x = np.random.default_rng(0).standard_normal((rows, 32)).astype(np.float32)
    chunk_bytes = 16 << 10 if rows == 4096 else None
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))}, chunk_bytes=chunk_bytes)
    if cold:
        iostats.drop_page_cache(str(tmp_path / "c"))
        # the B-tree walk's read of a data file's head may bring a small file in (readahead)
        # before the restore asks whether it will wait for the disk: here it always will
        monkeypatch.setattr(residency, "from_disk", lambda plans: True)
    else:
        jaxckpt.restore(tmp_path / "c")  # every chunk read once: in the page cache
    advised: list[tuple[str, int, int]] = []
    real = os.posix_fadvise

    def recording(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            advised.append((os.readlink(f"/proc/self/fd/{fd}"), offset, offset + length))
        return real(fd, offset, length, advice)

    stretches: list[tuple[str, int, int]] = []  # (file, start, stop) looked at, in order
    probes: dict[tuple[str, int], bool] = {}  # (file, offset) -> found in the page cache
    real_blocks, real_cached = residency.new_blocks, residency.cached

    def looking(where, seen, *args):
        got = real_blocks(where, seen, *args)
        stretches.extend((os.path.realpath(f), a, b) for f, a, b in got)
        return got

    def probing(fd, offset):
        probes[(os.readlink(f"/proc/self/fd/{fd}"), offset)] = hit = real_cached(fd, offset)
        return hit

    monkeypatch.delenv(linux.DIRECT_READ, raising=False)
    monkeypatch.setattr(os, "posix_fadvise", recording)
    monkeypatch.setattr(residency, "new_blocks", looking)
    monkeypatch.setattr(residency, "cached", probing)
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    chunks = _chunk_values(tmp_path / "c")
    assert len(chunks) == (32 if rows == 4096 else 4) and len(advised) <= len(chunks)
    if not cold:
        assert advised == []
        return
    covered = {(os.path.realpath(c.file), c.start, c.stop) for c in chunks}
    mib = residency.ADVICE_BYTES
    blocks = {(f, k) for f, a, b in covered for k in range(a // mib, (b - 1) // mib + 1)}
    got = [(g, k) for g, s, e in advised for k in range(s // mib, e // mib)]
    for _, s, e in advised:  # whole blocks, each holding chunk bytes, each advised once
        assert s % mib == 0 and e % mib == 0 and e > s
    assert len(got) == len(set(got)) and set(got) <= blocks
    looked = [(f, k) for f, a, b in stretches for k in range(a // mib, b // mib)]
    assert len(looked) == len(set(looked)) and set(looked) == blocks  # each block once
    sizes = {f: os.path.getsize(f) for f, _, _ in stretches}
    missed = [(f, a, b) for f, a, b in stretches if not probes[(f, min(b, sizes[f]) - 1)]]
    assert sorted((os.path.realpath(f), a, b) for f, a, b in advised) == sorted(missed)
    assert advised  # a cold restore: the first slice's stretch is advised before any read
    if rows == 4096:
        assert len(advised) <= len({f for f, _ in blocks})  # a call a file


def test_direct_read_can_be_switched_off(preadv, mesh42, tmp_path, monkeypatch):
    x = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))})
    monkeypatch.setenv(linux.DIRECT_READ, "0")
    np.testing.assert_array_equal(np.asarray(jaxckpt.restore(tmp_path / "c")["x"]), x)
    assert preadv.calls == 0
    monkeypatch.setenv(linux.DIRECT_READ, "1")
    np.testing.assert_array_equal(np.asarray(jaxckpt.restore(tmp_path / "c")["x"]), x)
    assert preadv.bytes == x.nbytes + 4 * 4


def test_zstd_chunks_are_read_by_tensorstore(preadv, mesh42, tmp_path):
    x = np.random.default_rng(2).standard_normal((256, 64)).astype(np.float32)
    tree = {"x": sharded(x, mesh42, ("data",)), "n": x}
    jaxckpt.save(tmp_path / "c", tree, compression="zstd")
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert_same_bits(x, np.asarray(out["x"]))
    assert_same_bits(x, out["n"])
    assert preadv.calls == 0


def test_small_values_inline_in_the_btree_are_read_by_tensorstore(preadv, tmp_path, monkeypatch):
    """TensorStore stores values of up to 1 KiB inside the B-tree node (checkpoints it
    wrote); jaxckpt's own writer stores every chunk in a data file, small ones too."""
    tree = {"small": np.arange(16, dtype=np.int32), "big": np.arange(4096, dtype=np.int32)}
    monkeypatch.setenv(linux.DIRECT_WRITE, "0")
    jaxckpt.save(tmp_path / "ts", tree)
    monkeypatch.delenv(linux.DIRECT_WRITE)
    jaxckpt.save(tmp_path / "ours", tree)
    for name, direct_bytes in [("ts", 0), ("ours", tree["small"].nbytes + 4)]:
        preadv.bytes = 0
        out = jaxckpt.restore(tmp_path / name, target=tree)
        np.testing.assert_array_equal(out["small"], tree["small"])
        np.testing.assert_array_equal(out["big"], tree["big"])
        assert preadv.bytes == tree["big"].nbytes + 4 + direct_bytes, name


@pytest.mark.parametrize("switch", ["1", "0"])
def test_a_corrupt_chunk_raises_the_same_error_either_way(switch, mesh42, tmp_path, monkeypatch):
    x = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
    jaxckpt.save(tmp_path / "c", {"layer": {"w": sharded(x, mesh42, ("data",))}})
    flipped, offset = flip_a_chunk_byte(tmp_path / "c")
    monkeypatch.setenv(linux.DIRECT_READ, switch)
    counter = Preadv(monkeypatch)
    with pytest.raises(errors.ChecksumError, match=r"leaf 'layer/w': chunk 'layer/w/c/\d/0'") as e:
        jaxckpt.restore(tmp_path / "c")
    assert f"{flipped} (bytes " in str(e.value) and "process 0" in str(e.value)
    assert "restore another step or re-save" in str(e.value)
    assert (counter.calls > 0) == (switch == "1")


@pytest.mark.parametrize("maps", ["1", "0"], ids=["mapped", "read"])
def test_a_corrupt_chunk_read_in_part_is_named(maps, mesh42, tmp_path, preadv, monkeypatch):
    """A slice that needs half of the corrupt chunk: the same error as a whole read, the
    chunk read a piece at a time for both halves (``scatter``) whether or not the files may
    be mapped."""
    monkeypatch.setenv(linux.MAP, maps)
    x = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
    jaxckpt.save(tmp_path / "c", {"w": sharded(x, mesh42, ("data",))})
    flipped, _ = flip_a_chunk_byte(tmp_path / "c")
    target = {"w": NamedSharding(jax.make_mesh((8, 1), ("data", "model")), P("data"))}
    with pytest.raises(errors.ChecksumError, match=r"leaf 'w': chunk 'w/c/\d/0'") as e:
        jaxckpt.restore(tmp_path / "c", target=target)
    assert f"{flipped} (bytes " in str(e.value)
    assert preadv.calls > 0


def test_edge_chunks_read_in_part_match_tensorstore(tmp_path, preadv):
    """An array whose chunks do not divide it (an Orbax checkpoint's may not): zarr stores
    the edge chunks padded; slices that end in them read them directly, exactly as
    TensorStore reads them."""
    db = location(str(tmp_path / "db"))
    x = random_bits((40, 70), np.dtype(np.float32), np.random.default_rng(4))
    meta = arrays.zarr_metadata(x.shape, "float32", (16, 32), None)  # 2 KiB: not inline
    spec = {"driver": "zarr3", "kvstore": arrays.kvstore_spec(db), "path": "x/"}
    created = ts.open({**spec, "metadata": meta, "create": True}, context=arrays.new_context())
    created.result().write(x).result()
    store = ts.open(spec, context=arrays.new_context()).result()
    lay = chunk_plan.layout(store)
    assert lay is not None
    slices = {0: ((32, 40), (0, 70)), 1: ((10, 37), (20, 70)), 2: ((0, 40), (0, 70))}
    slices[3] = ((39, 40), (69, 70))
    plans = chunk_plan.plan(db, {k: chunk_plan.Wanted("x", lay, i) for k, i in slices.items()})
    assert set(plans) == set(slices) and all(p.parts and not p.chunks for p in plans.values())
    reader = direct.Reader()
    try:
        for k, index in slices.items():
            got = reader.start(plans[k]).result()
            want = store[tuple(slice(a, b) for a, b in index)].read().result()
            assert_same_bits(want, got, str(index))
            assert_same_bits(x[tuple(slice(a, b) for a, b in index)], got, str(index))
        # as a group, each chunk read once, however many of the slices need a part of it
        calls = preadv.calls
        for k, got in enumerate(
            reader.start_group([(plans[k], None, ()) for k in slices]).result()
        ):
            assert_same_bits(x[tuple(slice(a, b) for a, b in slices[k])], got, str(k))
    finally:
        reader.close()
    chunks = len({part.key for p in plans.values() for part in p.parts})
    assert chunks == 9 and preadv.calls - calls == chunks


def test_a_truncated_data_file_is_named(mesh42, tmp_path, preadv):
    """The B-tree gives bytes past the end of a data file: the error names the leaf, the
    chunk, the file and the range (TensorStore's names none but the database)."""
    x = np.random.default_rng(3).standard_normal((256, 256)).astype(np.float32)
    jaxckpt.save(tmp_path / "c", {"w": sharded(x, mesh42, ("data",))})
    db = arrays.database_dir(location(str(tmp_path / "c")), None)
    kv = ts.KvStore.open(arrays.kvstore_spec(db), context=arrays.new_context()).result()
    where = arrays.chunk_bytes(kv.base, db, {k.decode() for k in kv.list().result()})
    nodes = [v for v in where.values() if v.inline]  # the B-tree (zarr.json lives inline)
    value = next(  # a chunk with no B-tree node after it in its file (the node stays whole)
        v
        for v in where.values()
        if not v.inline and not any(n.file == v.file and n.start > v.start for n in nodes)
    )
    os.truncate(value.file, (value.start + value.stop) // 2)
    with pytest.raises(errors.StorageError, match=r"leaf 'w': chunk 'w/c/\d/0' .*truncated"):
        jaxckpt.restore(tmp_path / "c")


def test_a_file_cut_short_while_reading_is_named(tmp_path):
    """The file ends before the range the B-tree gave (it shrank after the plan)."""
    path = tmp_path / "data"
    path.write_bytes(b"\0" * 100)
    at = arrays.ChunkBytes(str(path), 0, 132)
    read = chunk_plan.SliceRead(
        (32,), np.dtype(np.float32), (chunk_plan.ChunkRead("x/c/0", at, 0, 128),)
    )
    reader = direct.Reader()
    try:
        with pytest.raises(errors.StorageError, match=r"ends at byte 100.*truncated"):
            reader.start(read).result()
    finally:
        reader.close()


def test_a_data_file_outside_the_checkpoint_is_refused(mesh42, tmp_path):
    """Data file names come from the B-tree: one that resolves outside the checkpoint's
    arrays directory (here a symlink) is never read."""
    x = np.arange(256 * 64, dtype=np.float32).reshape(256, 64)
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))})
    value = _chunk_values(tmp_path / "c")[0].file
    outside = tmp_path / "elsewhere"
    shutil.move(value, outside)
    os.symlink(outside, value)
    with pytest.raises(errors.StorageError, match="outside the checkpoint's arrays directory"):
        jaxckpt.restore(tmp_path / "c")


@pytest.mark.slow
def test_two_process_checkpoints_read_directly(tmp_path, preadv):
    """Saved by two processes (two databases merged by reference): read here directly,
    and by two processes again, exactly (the worker checks every shard)."""
    path = str(tmp_path / "c")
    multiproc.run(WORKER, 2, devices_per_process=4, args=["save", path]).check()
    out = jaxckpt.restore(path)
    np.testing.assert_array_equal(
        np.asarray(out["w"]), np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    )
    assert preadv.calls > 0
    multiproc.run(WORKER, 2, devices_per_process=4, args=["restore", path]).check()


# --- small slices read in batches -----------------------------------------------------------


def test_small_slices_are_read_in_batches(preadv, mesh42, tmp_path):
    """Slices of at most ``layout.SMALL_CHUNK_BYTES`` go to the threads in batches, the chunks of
    slices back to back in a file in one preadv: 96 leaves of random bits on (4, 2), 600
    slices of 128 to 1024 bytes, come in a few calls, every byte once, bit-exact."""
    rng = np.random.default_rng(21)
    specs = [P("data"), P(None, "model"), P(), P("data", "model")]
    tree = {
        f"l{i}": sharded(random_bits((16, 16), np.dtype(np.float32), rng), mesh42, specs[i % 4])
        for i in range(96)
    }
    jaxckpt.save(tmp_path / "c", tree)
    target = {k: v.sharding for k, v in tree.items()}
    out = jaxckpt.restore(tmp_path / "c", target=target)
    for k, v in tree.items():
        assert_same_bits(np.asarray(v), np.asarray(out[k]), k)
    slices = sum(len({str(s.index) for s in v.addressable_shards}) for v in tree.values())
    assert slices == 24 * (4 + 2 + 1 + 8)
    chunks = len(_chunk_values(tmp_path / "c"))
    assert preadv.bytes == sum(v.nbytes for v in tree.values()) + 4 * chunks
    assert preadv.calls <= slices // 20 and preadv.buffers == 2 * chunks


def _chunk_file(path, sizes, rng) -> tuple[list[chunk_plan.SliceRead], list[bytes]]:
    """Chunks of ``sizes`` random bytes back to back in one file, each with its CRC32C
    trailer; a one-chunk SliceRead of each, and each chunk's bytes."""
    import crc32c

    data, reads, blob = [], [], bytearray()
    for k, n in enumerate(sizes):
        b = rng.integers(0, 256, n, np.uint8).tobytes()
        at = arrays.ChunkBytes(str(path), len(blob), len(blob) + n + 4)
        blob += b + crc32c.crc32c(b).to_bytes(4, "little")
        chunk = chunk_plan.ChunkRead(f"x/c/{k}", at, 0, n)
        reads.append(chunk_plan.SliceRead((n,), np.dtype(np.uint8), (chunk,)))
        data.append(b)
    path.write_bytes(bytes(blob))
    return reads, data


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_bad_chunk_in_a_batch_fails_its_own_slice_and_no_other(damage, tmp_path, preadv):
    """One batch, 40 slices back to back in one file: a flipped byte fails only its slice,
    naming its chunk; a file cut short fails only the slices past the cut, each naming its
    own chunk (the run is read again slice by slice); every other slice's bytes are exact."""
    reads, data = _chunk_file(
        tmp_path / "d", [512 + 8 * k for k in range(40)], np.random.default_rng(5)
    )
    bad = 17
    at = reads[bad].chunks[0].at
    if damage == "flip":
        blob = bytearray((tmp_path / "d").read_bytes())
        blob[at.start + 100] ^= 0x10
        (tmp_path / "d").write_bytes(bytes(blob))
    else:
        os.truncate(tmp_path / "d", at.start + 100)
    reader = direct.Reader(threads=2)
    try:
        futs = [reader.start(r) for r in reads]
        for k, f in enumerate(futs):
            if k < bad or (damage == "flip" and k > bad):
                assert f.result().tobytes() == data[k], k
            elif damage == "flip":
                with pytest.raises(crc.Corrupt, match=f"'x/c/{k}'"):
                    f.result()
            else:
                with pytest.raises(errors.StorageError, match=f"'x/c/{k}'.*truncated"):
                    f.result()
    finally:
        reader.close()
    if damage == "flip":  # (the batch went when the first slice was waited for: one run)
        assert preadv.calls == 1 and preadv.buffers == 2 * len(reads)


def test_closing_a_reader_cancels_the_slices_still_in_its_batch(tmp_path):
    """A batch not yet sent when the reader closes (an error elsewhere stopped the restore):
    its slices are cancelled, and waiting for one raises at once rather than hang."""
    import concurrent.futures

    reads, _ = _chunk_file(tmp_path / "d", [64, 64], np.random.default_rng(6))
    reader = direct.Reader(threads=1)
    futs = [reader.start(r) for r in reads]
    reader.close()
    for f in futs:
        with pytest.raises(concurrent.futures.CancelledError):
            f.result(timeout=5)


def test_a_sent_batch_the_closing_reader_never_ran_is_cancelled(tmp_path):
    """A batch handed to the threads but not started when the reader closes (its thread
    busy): its slices are cancelled too, not left for a waiter to hang on."""
    import concurrent.futures

    reads, _ = _chunk_file(tmp_path / "d", [64, 64], np.random.default_rng(7))
    reader = direct.Reader(threads=1)
    busy, release = threading.Event(), threading.Event()
    reader.pool.submit(lambda: busy.set() or release.wait(10))
    busy.wait(10)
    futs = [reader.start(r) for r in reads]
    reader.send()  # queued behind the busy task
    closing = threading.Thread(target=reader.close)
    closing.start()
    threading.Timer(0.2, release.set).start()
    closing.join(10)
    assert not closing.is_alive()
    for f in futs:
        with pytest.raises(concurrent.futures.CancelledError):
            f.result(timeout=5)


def test_a_batch_whose_task_fails_passes_its_error_to_every_slice(tmp_path, monkeypatch):
    """Should reading a batch raise outside a slice's own read (a bug), every slice of it
    gets that error rather than waiting forever."""
    reads, _ = _chunk_file(tmp_path / "d", [64, 64, 64], np.random.default_rng(8))

    def broken(self, batch):
        batch[0].fut.set_running_or_notify_cancel()
        raise RuntimeError("broken batch")

    monkeypatch.setattr(batch.Batcher, "_read_batch", broken)
    reader = direct.Reader(threads=1)
    try:
        futs = [reader.start(r) for r in reads]
        for f in futs:
            with pytest.raises(RuntimeError, match="broken batch"):
                f.result(timeout=5)
    finally:
        reader.close()


# --- a slice read in spans on several threads ---------------------------------------------


def _one_big_chunk(tmp_path, mib: int = 20) -> tuple[np.ndarray, arrays.ChunkBytes]:
    """A leaf of ``mib`` MiB of random bits in one chunk (one device): its values and where
    its chunk is."""
    bits = np.random.default_rng(mib).integers(0, 2**32, (mib << 18,), dtype=np.uint32)
    jaxckpt.save(tmp_path / "c", {"x": bits.view(np.float32)})
    (at,) = [v for v in _chunk_values(tmp_path / "c") if v.stop - v.start == bits.nbytes + 4]
    return bits, at


def test_a_large_chunk_is_read_in_spans_by_several_threads(tmp_path, preadv, monkeypatch):
    """A 20 MiB chunk: its spans are read by more than one thread, every byte lands where
    it belongs, and the CRC32C put together from the spans' matches the stored one."""
    monkeypatch.setattr(direct, "reader_threads", lambda: 4)
    bits, _ = _one_big_chunk(tmp_path)
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(out["x"]).view(np.uint32), bits)
    assert preadv.bytes == bits.nbytes + 4
    assert len(preadv.threads) > 1


@pytest.mark.parametrize("where", ["first", "split", "last", "trailer"])
def test_a_flipped_byte_anywhere_in_a_split_chunk_is_caught(where, tmp_path, preadv):
    """The first byte, the first of the second span, the last data byte, the stored CRC."""
    bits, at = _one_big_chunk(tmp_path)
    offset = {
        "first": at.start,
        "split": at.start + spans.SPLIT_BYTES,
        "last": at.stop - 5,
        "trailer": at.stop - 1,
    }[where]
    with open(at.file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(errors.ChecksumError, match=r"leaf 'x': chunk 'x/c/0'") as e:
        jaxckpt.restore(tmp_path / "c")
    assert f"{at.file} (bytes {at.start}-{at.stop - 1})" in str(e.value)
    assert preadv.calls > 0


@pytest.mark.parametrize("seed", range(4))
def test_spans_cover_every_byte_once_in_file_order(seed):
    """_spans: chunks (runs back to back, and gaps) cut into spans of about SPLIT_BYTES
    whose pieces, in order, are each chunk's bytes then its trailer, at consecutive file
    positions; no piece larger than PIECE_BYTES."""
    rng = np.random.default_rng(seed)
    sizes = [int(n) for n in rng.integers(1, 3 * spans.SPLIT_BYTES // 2, 7)]
    chunks, pos, offset = [], 0, 0
    for i, n in enumerate(sizes):
        pos += int(rng.integers(0, 2)) * 4096  # now and then a gap: a new run
        file = "a" if i < 4 else "b"
        if i == 4:
            pos = 0
        chunks.append(
            chunk_plan.ChunkRead(f"k{i}", arrays.ChunkBytes(file, pos, pos + n + 4), offset, n)
        )
        pos, offset = pos + n + 4, offset + n
    flats = [np.zeros(offset, np.uint8), np.zeros(offset, np.uint8)]  # a buffer, a copy
    trailers = memoryview(bytearray(4 * len(chunks)))
    runs = spans.spans(chunks, flats, trailers)
    seen = {i: 0 for i in range(len(chunks))}
    for span in runs:
        at = span.start
        assert sum(len(p.view) for p in span.pieces) <= spans.SPLIT_BYTES + spans.PIECE_BYTES
        for p in span.pieces:
            assert len(p.view) <= spans.PIECE_BYTES
            if p.chunk >= 0:
                r = chunks[p.chunk]
                assert at == r.at.start + seen[p.chunk] and span.chunks[0].at.file == r.at.file
                # the copy's piece is the same bytes of the other buffer
                (copy,) = p.copies
                start = r.offset + seen[p.chunk]
                assert copy.ctypes.data == flats[1].ctypes.data + start
                assert len(copy) == len(p.view)
                seen[p.chunk] += len(p.view)
            else:
                assert p.copies == ()
            at += len(p.view)
    assert seen == {i: n for i, n in enumerate(sizes)}
    assert sum(len(p.view) for s in runs for p in s.pieces) == offset + 4 * len(chunks)


@pytest.mark.parametrize(
    "n", [1, spans.PIECE_BYTES, spans.PIECE_BYTES + 1, spans.SPLIT_BYTES, 2 * spans.SPLIT_BYTES + 5]
)
def test_one_chunk_spans_cover_it_then_its_trailer(n):
    """A slice of one chunk (most slices): pieces of at most PIECE_BYTES at consecutive file
    positions, in spans of about SPLIT_BYTES, its trailer last, with the last piece."""
    at = arrays.ChunkBytes("a", 8192, 8192 + n + 4)
    flats = [np.zeros(n + 64, np.uint8), np.zeros(n + 64, np.uint8)]
    trailers = memoryview(bytearray(4))
    runs = spans.spans([chunk_plan.ChunkRead("k", at, 64, n)], flats, trailers)
    assert len(runs) == max(1, -(-n // spans.SPLIT_BYTES))
    pos, got = at.start, 0
    for span in runs:
        assert span.start == pos and span.chunks[0].key == "k"
        assert sum(len(p.view) for p in span.pieces) <= spans.SPLIT_BYTES + 4
        for p in span.pieces:
            assert 0 < len(p.view) <= spans.PIECE_BYTES
            pos += len(p.view)
            if p.chunk == 0:
                (copy,) = p.copies
                assert copy.ctypes.data == flats[1].ctypes.data + 64 + got
                got += len(p.view)
    assert runs[-1].pieces[-1].chunk == -1 and runs[-1].pieces[-1].view.nbytes == 4
    assert got == n and pos == at.stop


@pytest.mark.parametrize("rows", [4096, 262144])
def test_cached_stretches_get_no_prefetch_advice(rows, mesh42, tmp_path, monkeypatch):
    """Shards of 8 MiB, or of 16 KiB chunks, read once (in the page cache): a restore that
    finds its files cached (``residency.from_disk``) neither probes nor advises; one that
    took them for uncached probes each stretch, a 1-byte RWF_NOWAIT read, and advises none
    (the advice would only walk the cache)."""
    x = np.random.default_rng(0).standard_normal((rows, 32)).astype(np.float32)
    chunk_bytes = 16 << 10 if rows == 4096 else None
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))}, chunk_bytes=chunk_bytes)
    jaxckpt.restore(tmp_path / "c")
    advice, probes = [], []
    real_advise, real_preadv = os.posix_fadvise, os.preadv

    def advise(fd, offset, length, what):
        advice.append(what)
        return real_advise(fd, offset, length, what)

    def preadv(fd, buffers, offset, *flags):
        if flags and flags[0] & os.RWF_NOWAIT:
            probes.append(sum(len(b) for b in buffers))
        return real_preadv(fd, buffers, offset, *flags)

    monkeypatch.delenv(linux.DIRECT_READ, raising=False)
    monkeypatch.setattr(os, "posix_fadvise", advise)
    monkeypatch.setattr(os, "preadv", preadv)
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    assert os.POSIX_FADV_WILLNEED not in advice and probes == []
    monkeypatch.setattr(residency, "from_disk", lambda plans: True)
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    assert os.POSIX_FADV_WILLNEED not in advice
    assert probes and set(probes) == {1}


@pytest.mark.parametrize("small", [False, True], ids=["256 KiB chunks", "small slices"])
def test_chunks_a_few_zero_bytes_apart_are_read_in_one_preadv(
    small, preadv, mesh42, tmp_path, monkeypatch
):
    """``ocdbt_write`` starts chunks of 256 KiB or more on page boundaries: the reader
    still reads such neighbours (a shard of 16 such chunks, read, not mapped; or runs of
    small slices, each a chunk) in one ``preadv`` of about 1 MiB, the gaps into scratch,
    bit-exact; the bytes read are the chunks', their trailers' and the gaps' (< 4 KiB each)."""
    monkeypatch.setenv("JAXCKPT_MAP", "0")
    if small:  # every chunk padded: small slices' batches read across the gaps
        monkeypatch.setattr(ocdbt_write, "SMALL_CHUNK_BYTES", 1)
        x = random_bits((4 * 64, 8), np.dtype(np.float32), np.random.default_rng(8))
        tree = {f"x{i}": sharded(np.roll(x, i), mesh42, ("data",)) for i in range(16)}
    else:
        x = random_bits((65536, 64), np.dtype(np.float32), np.random.default_rng(8))
        tree = {"x": sharded(x, mesh42, ("data",))}
    jaxckpt.save(tmp_path / "c", tree, chunk_bytes=None if small else 256 << 10)
    chunks = _chunk_values(tmp_path / "c")
    assert len(chunks) == 64
    gaps = 0
    for a, b in itertools.pairwise(sorted(chunks, key=lambda c: (c.file, c.start))):
        if a.file == b.file:
            assert 0 <= b.start - a.stop < layout.ALIGN
            gaps += b.start - a.stop
    assert gaps > 0
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    for name, want in tree.items():
        assert_same_bits(np.asarray(want), np.asarray(out[name]), name)
    stored = sum(c.stop - c.start for c in chunks)
    assert stored <= preadv.bytes <= stored + gaps
    assert preadv.calls <= (4 if small else 4 * 6), preadv.calls  # ~1 MiB a call


def test_a_buffer_to_read_into_must_fit_exactly():
    """``into`` of another shape, dtype or layout is refused before any read (the reader
    and TensorStore's fallback share the check); None gets a fresh aligned buffer."""
    shape, dtype = (4, 8), np.dtype(np.float32)
    good = np.empty(shape, dtype)
    assert arrays.buffer_for(good, shape, dtype) is good
    fresh = arrays.buffer_for(None, shape, dtype)
    assert fresh.shape == shape and fresh.dtype == dtype and fresh.ctypes.data % 64 == 0
    for bad in (np.empty((8, 4), dtype), np.empty(shape, np.int32), np.empty((8, 4), dtype).T):
        with pytest.raises(ValueError, match="C-contiguous, is needed"):
            arrays.buffer_for(bad, shape, dtype)
    reader = direct.Reader(1)
    try:
        with pytest.raises(ValueError, match="C-contiguous, is needed"):
            reader.start(chunk_plan.SliceRead(shape, dtype, ()), np.empty(shape, np.int32))
    finally:
        reader.close()


class _CountingCopies:
    """NumPy as ``placement`` sees it, with ``copyto`` counted: the replicas it copies."""

    def __init__(self) -> None:
        self.copies = 0

    def __getattr__(self, name):
        return getattr(np, name)

    def copyto(self, dst, src, *a, **kw):
        self.copies += 1
        return np.copyto(dst, src, *a, **kw)


@pytest.mark.parametrize(
    "dtype, shape",
    [(d, (64, 32)) for d in DTYPES]
    + [(np.dtype(n), (2048, 1024)) for n in ("bfloat16", "float8_e4m3fn", "float32")],
    ids=[f"{d}-small" for d in DTYPES] + [f"{n}-large" for n in ("bf16", "f8e4m3fn", "f32")],
)
@pytest.mark.parametrize("onto", ["saved mesh", "chunks cut"])
def test_replicas_are_filled_as_the_reader_reads(dtype, shape, onto, x64, preadv, mesh42,
                                                 tmp_path, monkeypatch):  # fmt: skip
    """On CPU devices the direct reader copies each checked piece into the slice's replica
    places while it is in the CPU's cache (on the reader threads, not after all reads on
    one): random bits of a leaf replicated over one mesh axis, restored onto the saved mesh
    (whole chunks, each slice read in several spans) and onto one whose slices cut through
    the chunks; small leaves of every dtype (they have a buffer of their own too) and large
    ones. Every device's bytes exact and its own memory; where the direct path reads the
    dtype, every chunk read once and no replica copied by ``Placement`` (bool and sub-byte
    types are read by TensorStore, and their replicas copied). (Large whole chunks are
    mapped, not read, unless ``JAXCKPT_MAP=0``: tests/test_mapped.py.)"""
    from jaxckpt._src import placement

    monkeypatch.setenv("JAXCKPT_MAP", "0")
    x = random_bits(shape, dtype, np.random.default_rng(11))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))})
    if onto == "saved mesh":
        mesh, spec = mesh42, P("data")
        monkeypatch.setattr(spans, "SPLIT_BYTES", 128 << 10)
    else:  # columns over 4 devices, replicated over 2: each slice a part of every chunk
        mesh, spec = jax.make_mesh((2, 4), ("data", "model")), P(None, "model")
    counting = _CountingCopies()
    monkeypatch.setattr(placement, "np", counting)
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))}
    out = jaxckpt.restore(tmp_path / "c", target=target)["x"]
    assert len({s.data.unsafe_buffer_pointer() for s in out.addressable_shards}) == 8
    for shard in out.addressable_shards:
        assert_same_bits(x[shard.index], np.asarray(shard.data), f"{dtype} {shard.device}")
    if direct_dtype(dtype):
        assert counting.copies == 0
        # four chunks with their CRCs, each read once (cut: once for the 4 column slices)
        assert preadv.bytes == x.nbytes + 4 * 4


# --- a chunk several slices need a part of -------------------------------------------------


def _shared_chunks(tmp_path) -> tuple[np.ndarray, Location, dict, chunk_plan.Layout]:
    """A 64 x 64 float32 array in chunks of 32 x 32 (4 KiB: not inline), and four slices of
    16 columns each: every chunk is needed in part by two of them."""
    db = location(str(tmp_path / "db"))
    x = random_bits((64, 64), np.dtype(np.float32), np.random.default_rng(9))
    meta = arrays.zarr_metadata(x.shape, "float32", (32, 32), None)
    spec = {"driver": "zarr3", "kvstore": arrays.kvstore_spec(db), "path": "x/"}
    ts.open(
        {**spec, "metadata": meta, "create": True}, context=arrays.new_context()
    ).result().write(x).result()
    store = ts.open(spec, context=arrays.new_context()).result()
    lay = chunk_plan.layout(store)
    assert lay is not None
    slices = {k: ((0, 64), (16 * k, 16 * (k + 1))) for k in range(4)}
    return x, db, slices, lay


def _group(reader, plans, slices):
    """The slices of ``_shared_chunks`` read as one group: each one's buffer or error."""
    return reader.start_group([(plans[k], None, ()) for k in slices]).result(timeout=30)


@pytest.mark.parametrize("rows", [1, 5, 32])  # rows a piece: one, some, the whole chunk
def test_a_chunk_several_slices_need_is_read_once(rows, tmp_path, preadv, monkeypatch):
    """Read as a group, each chunk is read and checked once for the slices that need a part
    of it, a piece of rows at a time (``scatter``), bytes exact; each slice read by
    itself (``start``) reads its chunks itself."""
    monkeypatch.setattr(scatter, "PIECE_BYTES", rows * 32 * 4)
    chunk = 32 * 32 * 4 + 4
    x, db, slices, lay = _shared_chunks(tmp_path)
    plans = chunk_plan.plan(db, {k: chunk_plan.Wanted("x", lay, i) for k, i in slices.items()})
    needed = collections.Counter(part.key for p in plans.values() for part in p.parts)
    assert len(needed) == 4 and set(needed.values()) == {2}  # each chunk by two slices
    reader = direct.Reader()
    try:
        got = _group(reader, plans, slices)
        for k, index in slices.items():
            assert_same_bits(x[tuple(slice(a, b) for a, b in index)], got[k], str(k))
        assert preadv.bytes == 4 * chunk
        for k, index in slices.items():
            one = reader.start(plans[k]).result(timeout=30)
            assert_same_bits(x[tuple(slice(a, b) for a, b in index)], one, str(k))
        assert preadv.bytes == 4 * chunk + 8 * chunk
    finally:
        reader.close()


def test_a_corrupt_chunk_several_slices_need_fails_each_of_them(tmp_path, preadv):
    """The slices of a group that share a corrupt chunk each get Corrupt naming it; the
    others read exactly (a slice read by itself raises it)."""
    x, db, slices, lay = _shared_chunks(tmp_path)
    plans = chunk_plan.plan(db, {k: chunk_plan.Wanted("x", lay, i) for k, i in slices.items()})
    bad = next(part for part in plans[0].parts if part.key == "x/c/0/0")
    flip_byte(bad.at.file, bad.at.start + 100, 0x01)
    reader = direct.Reader()
    try:
        got = _group(reader, plans, slices)
        for k in (0, 1):  # columns 0-31: chunk (0, 0)
            assert isinstance(got[k], crc.Corrupt) and "x/c/0/0" in str(got[k])
        for k in (2, 3):
            assert_same_bits(x[tuple(slice(a, b) for a, b in slices[k])], got[k], str(k))
        with pytest.raises(crc.Corrupt, match="x/c/0/0"):
            reader.start(plans[1]).result(timeout=30)
    finally:
        reader.close()


def test_a_data_file_cut_short_is_named_by_the_slices_that_need_it(tmp_path):
    """A chunk read in part from a file that ends before it (cut after the plan): a
    StorageError naming the file and the chunk for each slice that needs it, the others
    exact."""
    x, db, slices, lay = _shared_chunks(tmp_path)
    plans = chunk_plan.plan(db, {k: chunk_plan.Wanted("x", lay, i) for k, i in slices.items()})
    last = max((part for p in plans.values() for part in p.parts), key=lambda q: q.at.start)
    os.truncate(last.at.file, last.at.start + 10)
    reader = direct.Reader()
    try:
        got = _group(reader, plans, slices)
        failed = [k for k in slices if isinstance(got[k], errors.StorageError)]
        assert failed and all(last.key in {q.key for q in plans[k].parts} for k in failed)
        assert re.search(rf"{last.at.file} ends at byte .*truncated", str(got[failed[0]]))
        for k in set(slices) - set(failed):
            assert_same_bits(x[tuple(slice(a, b) for a, b in slices[k])], got[k], str(k))
    finally:
        reader.close()


def test_chunks_read_in_part_leave_no_file_pages_in_the_processs_rss(tmp_path):
    """Chunks read in part pass through a scratch buffer of each thread: an 8 MiB restore
    onto another mesh holds none of the files' pages (``RssFile`` of ``/proc/self/status``,
    measured from outside) and one piece of scratch at most."""
    db = location(str(tmp_path / "db"))
    x = random_bits((1024, 2048), np.dtype(np.float32), np.random.default_rng(5))  # 8 MiB
    meta = arrays.zarr_metadata(x.shape, "float32", (256, 2048), None)  # 2 MiB chunks
    spec = {"driver": "zarr3", "kvstore": arrays.kvstore_spec(db), "path": "x/"}
    ts.open(
        {**spec, "metadata": meta, "create": True}, context=arrays.new_context()
    ).result().write(x).result()
    lay = chunk_plan.layout(ts.open(spec, context=arrays.new_context()).result())
    assert lay is not None
    slices = {k: ((0, 1024), (512 * k, 512 * (k + 1))) for k in range(4)}  # every chunk cut
    plans = chunk_plan.plan(db, {k: chunk_plan.Wanted("x", lay, i) for k, i in slices.items()})
    assert all(p.parts and not p.chunks for p in plans.values())
    out = {k: np.empty(plans[k].shape, plans[k].dtype) for k in slices}  # faulted in before
    for buf in out.values():
        buf.fill(0)
    reader = direct.Reader(threads=1)
    try:
        before = _rss_file()
        group = reader.start_group([(plans[k], out[k], ()) for k in slices])
        assert all(got is out[k] for k, got in zip(slices, group.result(timeout=30), strict=True))
        held = _rss_file() - before
    finally:
        reader.close()
    for k, index in slices.items():
        assert_same_bits(x[tuple(slice(a, b) for a, b in index)], out[k], str(k))
    assert held < 1 << 20, f"{held} bytes of the file's pages mapped (of {x.nbytes})"


def _rss_file() -> int:
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("RssFile:"))
    return int(line.split()[1]) * 1024


# --- each leaf's layout from the B-tree walk, no TensorStore open ------------------------------


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """The leaves a restore opens with TensorStore (``arrays.open_leaf`` watched)."""
    names: list[str] = []
    real = arrays.open_leaf

    def watching(db, name, ctx):
        names.append(name)
        return real(db, name, ctx)

    monkeypatch.setattr(arrays, "open_leaf", watching)
    monkeypatch.delenv(linux.DIRECT_READ, raising=False)
    return names


def test_a_restore_opens_with_tensorstore_only_the_leaves_it_reads_with_it(
    x64, mesh42, tmp_path, opened
):
    """Leaves the direct path reads whole are never opened with TensorStore (their layout
    comes from the ``zarr.json`` found in the B-tree walk): every dtype, random bits, onto
    the saved mesh and onto one that cuts through chunks; bool and int4 (TensorStore reads
    them), a zstd save and ``JAXCKPT_DIRECT_READ=0`` open every leaf."""
    rng = np.random.default_rng(11)
    tree = {
        d.name: sharded(random_bits((16, 8), d, rng), mesh42, P("data", "model")) for d in DTYPES
    }
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()
    }
    jaxckpt.save(tmp_path / "raw", tree)
    other = NamedSharding(jax.make_mesh((2, 4), ("data", "model")), P("data", "model"))
    for shardings in ({}, {k: other for k in tree}):  # (2, 4) cuts every (4, 2) chunk
        opened.clear()
        want = {k: t.update(sharding=shardings.get(k, t.sharding)) for k, t in target.items()}
        out = jaxckpt.restore(tmp_path / "raw", target=want)
        for k, v in tree.items():
            assert_same_bits(np.asarray(v), np.asarray(out[k]), k)
        assert sorted(opened) == sorted(d.name for d in DTYPES if not direct_dtype(d))
    jaxckpt.save(tmp_path / "zstd", tree, compression="zstd")
    opened.clear()
    out = jaxckpt.restore(tmp_path / "zstd", target=target)
    assert sorted(opened) == sorted(tree)
    for k, v in tree.items():
        assert_same_bits(np.asarray(v), np.asarray(out[k]), k)


def test_switched_off_the_direct_path_opens_every_leaf(mesh42, tmp_path, opened, monkeypatch):
    x = random_bits((32, 16), np.dtype(np.float32), np.random.default_rng(12))
    tree = {"a": sharded(x, mesh42, P("data")), "b": x[:4], "empty": np.zeros((0, 3))}
    jaxckpt.save(tmp_path / "c", tree)
    monkeypatch.setenv(linux.DIRECT_READ, "0")
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert sorted(opened) == ["a", "b"]  # (nothing to read of "empty")
    assert_same_bits(x, np.asarray(out["a"]))
    assert_same_bits(x[:4], out["b"])


def test_a_zarr_json_not_stored_inline_is_read_by_the_leafs_open(
    preadv, mesh42, tmp_path, opened, monkeypatch
):
    """Where the B-tree walk finds no inline ``zarr.json`` (a database another writer made),
    each leaf is opened with TensorStore for its layout, and still read directly."""
    x = random_bits((64, 32), np.dtype(np.float32), np.random.default_rng(14))
    tree = {"a": sharded(x, mesh42, P("data", "model")), "b": sharded(x.T.copy(), mesh42, P())}
    jaxckpt.save(tmp_path / "c", tree)
    real = chunk_plan.index
    monkeypatch.setattr(chunk_plan, "index", lambda db: (real(db)[0], {}))
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert sorted(opened) == ["a", "b"]
    assert preadv.bytes >= 2 * x.nbytes  # (each chunk with its 4-byte CRC)
    for k, v in tree.items():
        assert_same_bits(np.asarray(v), np.asarray(out[k]), k)
