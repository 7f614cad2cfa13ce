"""What of a data file the page cache holds (``residency``), told without reading it for
the restore: the blocks a restore advises, each once, and whether its reads will wait for
the disk, checked against the kernel's own answer after dropping and reading the file."""

import os

import iostats
import numpy as np

from jaxckpt._src.io import arrays, chunk_plan, residency

MIB = residency.ADVICE_BYTES


def _at(file: str, start: int, stop: int) -> arrays.ChunkBytes:
    return arrays.ChunkBytes(file, start, stop)


def test_new_blocks_merges_runs_and_gives_each_block_once():
    seen: dict[str, set[int]] = {}
    got = residency.new_blocks([_at("b", 10, 20), _at("a", MIB - 1, MIB + 1), _at("a", 5, 6)], seen)
    assert got == [("a", 0, 2 * MIB), ("b", 0, MIB)]  # sorted by file; blocks 0-1 of "a" merged
    again = residency.new_blocks([_at("a", 0, 3 * MIB), _at("b", MIB, MIB + 1)], seen)
    assert again == [("a", 2 * MIB, 3 * MIB), ("b", MIB, 2 * MIB)]  # only blocks not seen yet
    assert residency.new_blocks([_at("a", 7, 8)], seen) == []
    gap = residency.new_blocks([_at("c", 0, 1), _at("c", 2 * MIB, 2 * MIB + 1)], {})
    assert gap == [("c", 0, MIB), ("c", 2 * MIB, 3 * MIB)]  # not merged across a gap


def test_residency_follows_the_page_cache(tmp_path):
    """Dropped from the page cache: ``from_disk`` True, ``cached`` False; read once: both
    flip. (``from_disk`` probes with mincore, starting no readahead.)"""
    path = str(tmp_path / "d")
    data = np.random.default_rng(0).integers(0, 256, 4 * MIB, np.uint8)
    with open(path, "wb") as f:
        f.write(data.tobytes())
        f.flush()
        os.fsync(f.fileno())
    chunk = chunk_plan.ChunkRead("x/c/0", _at(path, MIB, 3 * MIB + 4), 0, 2 * MIB)
    plans = [chunk_plan.SliceRead((2 * MIB,), np.dtype(np.uint8), (chunk,))]
    iostats.drop_page_cache(str(tmp_path))
    fd = os.open(path, os.O_RDONLY)
    try:
        assert residency.from_disk(plans)
        assert residency.from_disk([]) is False
        assert not residency.cached(fd, 3 * MIB)
        os.pread(fd, 4 * MIB, 0)
        assert not residency.from_disk(plans)
        assert residency.cached(fd, 3 * MIB)
    finally:
        os.close(fd)


def test_a_chunk_that_ends_a_file_in_a_part_page_is_told_too(tmp_path):
    """The last page of a file of 1 MiB + 100 bytes, cached or not: ``from_disk`` tells it
    (it once mapped a whole page past the file's end, could not, and answered "can't
    tell", None)."""
    path = str(tmp_path / "d")
    with open(path, "wb") as f:
        f.write(bytes(MIB + 100))
        f.flush()
        os.fsync(f.fileno())
    chunk = chunk_plan.ChunkRead("x/c/0", _at(path, MIB - 4000, MIB + 100), 0, 4096)
    plans = [chunk_plan.SliceRead((4096,), np.dtype(np.uint8), (chunk,))]
    iostats.drop_page_cache(str(tmp_path))
    assert residency.from_disk(plans)
    with open(path, "rb") as f:
        f.read()
    assert residency.from_disk(plans) is False
