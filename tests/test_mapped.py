"""A restore onto CPU devices maps whole aligned chunks as the arrays' memory (``mapped``)."""

import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from conftest import flip_a_chunk_byte, sharded
from hostile import DTYPES, assert_same_bits, direct_dtype, random_bits
from iostats import mapped_from
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors
from jaxckpt._src.io import arrays, chunk_plan, direct, layout, linux, mapped

SPECS = [P("data"), P(), P(None, "model"), P("data", "model")]


def _rows(dtype: np.dtype, spec: P) -> tuple[int, int]:
    """A shape whose slices under ``spec`` on (4, 2) are 256 KiB: mapped, not read."""
    cols = 64
    per_slice = layout.SMALL_CHUNK_BYTES // dtype.itemsize // cols
    return (per_slice * 4, cols * (2 if spec == P("data", "model") else 1))


def _mappable(dtype: np.dtype) -> bool:
    return direct_dtype(dtype) and jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize


def test_every_dtype_random_bits_comes_back_in_mappings_of_the_files(x64, mesh42, tmp_path):
    """Random bits of every dtype, each leaf under one of four specs (replicated ones
    included): every device's bytes exact, every device its own memory, and every shard of a
    whole-byte dtype the direct path reads is a mapping of the step's data files."""
    rng = np.random.default_rng(7)
    tree = {}
    for i, d in enumerate(DTYPES):
        spec = SPECS[i % len(SPECS)]
        tree[d.name] = sharded(random_bits(_rows(d, spec), d, rng), mesh42, spec)
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    for name, x in tree.items():
        got = out[name]
        assert len({s.data.unsafe_buffer_pointer() for s in got.addressable_shards}) == 8
        for shard in got.addressable_shards:
            assert_same_bits(np.asarray(x)[shard.index], np.asarray(shard.data), name)
        where = mapped_from(got, tmp_path / "c")
        assert all(where) if _mappable(got.dtype) else not any(where), (name, where)


def test_a_donation_writes_private_pages_not_the_file_nor_the_other_copies(mesh42, tmp_path):
    """A restored leaf replicated over 'model' (two mappings of each chunk) donated to a
    ``jit`` (which may write its buffers in place): the result is right, and the step restores bit-exact
    again (its files untouched)."""
    x = random_bits((4096, 64), np.dtype(np.float32), np.random.default_rng(1))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))})
    target = {
        "x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh42, P("data")))
    }
    restored = jaxckpt.restore(tmp_path / "c", target=target)["x"]
    assert all(mapped_from(restored, tmp_path / "c"))
    y = jax.jit(lambda v: v.view(np.uint32) ^ np.uint32(0xFFFFFFFF), donate_argnums=0)(restored)
    assert_same_bits(x.view(np.uint32) ^ np.uint32(0xFFFFFFFF), np.asarray(y))
    again = jaxckpt.restore(tmp_path / "c", target=target)["x"]
    for shard in again.addressable_shards:
        assert_same_bits(x[shard.index], np.asarray(shard.data))


def test_the_arrays_outlive_their_step(mesh42, tmp_path):
    """A step deleted (retention, ``rm -r``) after a restore: its arrays keep their bytes
    (the mappings hold the files)."""
    x = random_bits((8192, 256), np.dtype(jax.numpy.bfloat16), np.random.default_rng(2))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data", "model"))})
    out = jaxckpt.restore(tmp_path / "c")["x"]
    assert all(mapped_from(out, tmp_path / "c"))
    shutil.rmtree(tmp_path / "c")
    assert_same_bits(x, np.asarray(out))


def test_a_corrupt_chunk_is_a_checksum_error_through_the_mapping(mesh42, tmp_path, monkeypatch):
    """One flipped byte in a mapped chunk: ``ChecksumError`` naming the leaf and the file."""
    x = random_bits((8192, 64), np.dtype(np.float32), np.random.default_rng(3))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))})
    maps = []
    real = direct.Reader.map
    monkeypatch.setattr(direct.Reader, "map", lambda self, *a: maps.append(1) or real(self, *a))
    path, _ = flip_a_chunk_byte(tmp_path / "c")
    with pytest.raises(errors.ChecksumError, match=r"'x'") as e:
        jaxckpt.restore(tmp_path / "c")
    assert os.path.basename(path) in str(e.value)
    assert maps


def test_switched_off_or_out_of_room_the_slices_are_read(mesh42, tmp_path, monkeypatch):
    """``JAXCKPT_MAP=0``: every slice read into fresh memory. With room for 3 mappings
    only: three slices mapped (a slice and its replica take two), the rest read; bit-exact
    either way."""
    x = random_bits((4096, 64), np.dtype(np.int32), np.random.default_rng(4))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))})
    monkeypatch.setenv("JAXCKPT_MAP", "0")
    out = jaxckpt.restore(tmp_path / "c")["x"]
    assert not any(mapped_from(out, tmp_path / "c"))
    assert_same_bits(x, np.asarray(out))
    monkeypatch.delenv("JAXCKPT_MAP")
    monkeypatch.setattr(mapped, "room", lambda: 3)
    out = jaxckpt.restore(tmp_path / "c")["x"]
    assert sum(mapped_from(out, tmp_path / "c")) == 2  # one slice on its two devices
    assert_same_bits(x, np.asarray(out))


def test_a_cold_restore_maps_too(mesh42, tmp_path):
    """The step's pages dropped from the page cache: the mappings read them (populated,
    ``MADV_POPULATE_READ``), bit-exact."""
    x = random_bits((8192, 64), np.dtype(np.float16), np.random.default_rng(5))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, P(None, "model"))})
    for root, _, files in os.walk(tmp_path / "c"):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    out = jaxckpt.restore(tmp_path / "c")["x"]
    assert all(mapped_from(out, tmp_path / "c"))
    assert_same_bits(x, np.asarray(out))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e5m2", "int16"])
def test_a_slice_of_several_chunks_is_one_stretch_of_mappings(dtype, mesh42, tmp_path):
    """Shards saved in chunks of 256 KiB (``chunk_bytes``, row blocks), restored onto the
    saved mesh (16 chunks a slice) and onto 4 devices (two shards' chunks a slice): each
    slice one stretch of memory, each chunk mapped at its place from the files, random bits
    exact; a flipped byte in one of them is a ``ChecksumError``."""
    d = np.dtype(getattr(ml_dtypes, dtype, dtype))
    rows = 4 * 16 * (256 << 10) // (64 * d.itemsize)
    x = random_bits((rows, 64), d, np.random.default_rng(9))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))}, chunk_bytes=256 << 10)
    mesh4 = jax.make_mesh((2, 2), ("data", "model"), devices=jax.devices()[:4])
    for mesh in (mesh42, mesh4):
        target = {"x": NamedSharding(mesh, P("data"))}
        out = jaxckpt.restore(tmp_path / "c", target=target)["x"]
        assert all(mapped_from(out, tmp_path / "c")), mesh
        assert len({s.data.unsafe_buffer_pointer() for s in out.addressable_shards}) == mesh.size
        for shard in out.addressable_shards:
            assert_same_bits(x[shard.index], np.asarray(shard.data), f"{dtype} {mesh.shape}")
        del out
    flip_a_chunk_byte(tmp_path / "c")
    with pytest.raises(errors.ChecksumError, match=r"'x'"):
        jaxckpt.restore(tmp_path / "c")


def test_room_is_counted_a_mapping_per_chunk_and_copy(mesh42, tmp_path, monkeypatch):
    """A slice of 16 chunks on 2 devices takes 32 mappings: with room for 31 it is read,
    with room for 32 mapped (``vm.max_map_count`` is counted in mappings, not slices)."""
    x = random_bits((4 * 16 * 1024, 64), np.dtype(np.float32), np.random.default_rng(6))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))}, chunk_bytes=256 << 10)
    target = {"x": NamedSharding(mesh42, P("data"))}
    for room, want in ((31, 0), (32, 2)):
        monkeypatch.setattr(mapped, "room", lambda room=room: room)
        out = jaxckpt.restore(tmp_path / "c", target=target)["x"]
        assert sum(mapped_from(out, tmp_path / "c")) == want, room
        assert_same_bits(x, np.asarray(out))
        del out


# --- the rules, without jax -----------------------------------------------------------------


def _sr(nbytes: int, start: int = 4096, offset: int = 0, inline: bool = False, chunks: int = 1):
    at = arrays.ChunkBytes("/f", start, start + nbytes + 4, inline)
    reads = tuple(chunk_plan.ChunkRead(f"k{i}", at, offset, nbytes) for i in range(chunks))
    return chunk_plan.SliceRead((nbytes * chunks,), np.dtype(np.uint8), reads)


def test_several_chunks_are_suitable_back_to_back_on_page_boundaries():
    page, n = 4096, layout.SMALL_CHUNK_BYTES

    def sr(*chunks):  # (file start, nbytes) each, back to back in the slice
        reads, at = [], 0
        for start, nbytes in chunks:
            where = arrays.ChunkBytes("/f", start, start + nbytes + 4)
            reads.append(chunk_plan.ChunkRead(f"k{at}", where, at, nbytes))
            at += nbytes
        return chunk_plan.SliceRead((at,), np.dtype(np.uint8), tuple(reversed(reads)))

    assert mapped.suitable(sr((0, n), (5 * n, n), (2 * n, 100)))  # any order in the file
    assert not mapped.suitable(sr((0, n), (5 * n + 64, n)))  # 64-byte aligned: one chunk only
    assert not mapped.suitable(sr((0, n + 100), (5 * n, n)))  # the first ends inside a page
    assert not mapped.suitable(sr((0, page), (5 * n, page)))  # small
    gap = chunk_plan.SliceRead(
        (2 * n,),
        np.dtype(np.uint8),
        (
            chunk_plan.ChunkRead("a", arrays.ChunkBytes("/f", 0, n + 4), 0, n),
            chunk_plan.ChunkRead(
                "b", arrays.ChunkBytes("/f", 2 * n, 3 * n + 4), n + page, n - page
            ),
        ),
    )
    assert not mapped.suitable(gap)  # not back to back in the slice


def test_only_whole_aligned_out_of_line_chunks_of_the_minimum_size_are_suitable():
    n = layout.SMALL_CHUNK_BYTES
    assert mapped.suitable(_sr(n))
    assert not mapped.suitable(_sr(n - 1))  # small: read with its neighbours
    assert not mapped.suitable(_sr(n, start=4096 + 4))  # not 64-byte aligned
    assert not mapped.suitable(_sr(n, inline=True))
    assert not mapped.suitable(_sr(n, chunks=2))  # two chunks: their trailers between
    part = chunk_plan.ChunkPart("k", arrays.ChunkBytes("/f", 0, n + 4), n, (n,), (), ())
    assert not mapped.suitable(chunk_plan.SliceRead((n,), np.dtype(np.uint8), (), (part,)))


def test_a_region_past_the_end_of_its_file_is_an_os_error(tmp_path):
    """No SIGBUS: the mapping is populated, and the kernel's refusal is an ``OSError``."""
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        region = mapped.region(fd, 64, 1000)
        assert region.tobytes() == (bytes(range(256)) * 64)[64:1064]
        region[:] = 0  # private: the file keeps its bytes
        assert path.read_bytes() == bytes(range(256)) * 64
        with pytest.raises(OSError):
            mapped.region(fd, 8192, 1 << 20)
    finally:
        os.close(fd)


def test_room_leaves_half_of_the_map_count():
    with open("/proc/sys/vm/max_map_count") as f:
        limit = int(f.read())
    assert 0 < mapped.room() < limit // 2


def test_choose_takes_suitable_slices_in_turn_while_there_is_room(tmp_path, monkeypatch):
    """``mapped.choose``: nothing where mapping is off; else each suitable slice the caller
    finds usable, in turn, counting one mapping per chunk and copy, while ``room`` lasts."""
    n = layout.SMALL_CHUNK_BYTES
    wanted = [("a", _sr(n), 1), ("small", _sr(n - 1), 0), ("b", _sr(n), 0), ("c", _sr(n), 2)]
    monkeypatch.delenv(linux.MAP, raising=False)
    monkeypatch.setattr(mapped, "room", lambda: 2)
    assert mapped.choose(str(tmp_path), wanted) == {"a"}  # a slice and its replica
    monkeypatch.setattr(mapped, "room", lambda: 5)
    assert mapped.choose(str(tmp_path), wanted) == {"a", "b"}  # 2 + 1; "c" needs 3 more
    monkeypatch.setattr(mapped, "room", lambda: 6)
    assert mapped.choose(str(tmp_path), wanted) == {"a", "b", "c"}
    asked = []  # the caller's own test, asked only of suitable slices; "b" fails it

    def usable(key, sr):
        asked.append(key)
        return key != "b"

    assert mapped.choose(str(tmp_path), wanted, usable) == {"a", "c"}
    assert asked == ["a", "b", "c"]
    monkeypatch.setenv(linux.MAP, "0")
    assert mapped.choose(str(tmp_path), wanted) == set()
