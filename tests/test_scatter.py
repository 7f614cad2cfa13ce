"""A chunk read once a piece of rows at a time for every slice that needs a part of it
(jaxckpt/_src/io/scatter.py): bytes exact whatever the pieces, a corrupt or cut-short
chunk named."""

import os

import crc32c
import numpy as np
import pytest
from hostile import DTYPES, assert_same_bits, random_bits

from jaxckpt._src.io import arrays, crc, scatter
from jaxckpt._src.io.chunk_plan import ChunkPart
from jaxckpt.errors import StorageError


def _chunk_file(path, values: np.ndarray, at: int = 4096) -> arrays.ChunkBytes:
    """``values`` stored as a chunk at byte ``at`` of a file, its CRC32C trailer after it."""
    data = values.tobytes()
    with open(path, "wb") as f:
        f.write(b"\0" * at + data + crc32c.crc32c(data).to_bytes(4, "little") + b"tail")
    return arrays.ChunkBytes(str(path), at, at + len(data) + 4)


def _part(at, values, src, dst) -> ChunkPart:
    return ChunkPart("x/c/0/0", at, values.nbytes, values.shape, src, dst)


@pytest.mark.parametrize("piece", [1, 3 * 64, 1 << 20])  # a row a piece, 3, the whole chunk
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_part_gets_its_rows_and_columns(piece, dtype, tmp_path, monkeypatch):
    """Two slices each need half the columns of rows 3-13 of a 16-row chunk, one with a
    replica: every buffer gets exactly its box, bit for bit, however many rows a piece
    holds (the last piece short)."""
    monkeypatch.setattr(scatter, "PIECE_BYTES", piece)
    values = random_bits((16, 64), dtype, np.random.default_rng(3))
    at = _chunk_file(tmp_path / "d", values)
    left = np.zeros((10, 32), values.dtype)
    right = [np.zeros((12, 32), values.dtype) for _ in range(2)]  # the part at rows 2-12
    parts = [
        (_part(at, values, (slice(3, 13), slice(0, 32)), (slice(0, 10), slice(0, 32))), [left]),
        (_part(at, values, (slice(3, 13), slice(32, 64)), (slice(2, 12), slice(0, 32))), right),
    ]
    fd = os.open(at.file, os.O_RDONLY)
    try:
        scatter.read(fd, parts[0][0], parts, np.empty(values.nbytes, np.uint8))
    finally:
        os.close(fd)
    assert_same_bits(values[3:13, :32], left, "left")
    for r in right:
        assert_same_bits(values[3:13, 32:], r[2:12], "right")
        assert not r[:2].view(np.uint8).any() and not r[12:].view(np.uint8).any()


def test_a_corrupt_chunk_and_a_short_file_are_named(tmp_path, monkeypatch):
    monkeypatch.setattr(scatter, "PIECE_BYTES", 256)
    values = np.arange(1024, dtype=np.float32).reshape(16, 64)
    at = _chunk_file(tmp_path / "d", values)
    part = _part(at, values, (slice(0, 16), slice(0, 8)), (slice(0, 16), slice(0, 8)))
    with open(at.file, "r+b") as f:  # one bit of the last row
        f.seek(at.stop - 10)
        byte = f.read(1)
        f.seek(at.stop - 10)
        f.write(bytes([byte[0] ^ 1]))
    fd = os.open(at.file, os.O_RDONLY)
    try:
        with pytest.raises(crc.Corrupt, match="x/c/0/0"):
            scatter.read(
                fd, part, [(part, [np.zeros((16, 8), np.float32)])], np.empty(4096, np.uint8)
            )
        os.truncate(at.file, at.start + 1000)
        with pytest.raises(StorageError, match=f"the data file {at.file} ends at byte"):
            scatter.read(
                fd, part, [(part, [np.zeros((16, 8), np.float32)])], np.empty(4096, np.uint8)
            )
    finally:
        os.close(fd)


def test_a_piece_holds_about_piece_bytes_of_whole_rows_or_of_slabs_of_a_row():
    at = arrays.ChunkBytes("f", 0, 68)
    box = ChunkPart("k", at, 64, (4, 4), (slice(0, 2), slice(1, 3)), (slice(0, 2), slice(0, 2)))
    assert scatter.cut(box) == scatter.Cut(0, 4, 16)  # (all 4 rows: a piece of 64 bytes)
    wide = ChunkPart(
        "k", at, 1 << 30, (2, 1 << 27), (slice(0, 2), slice(0, 8)), (slice(0, 2), slice(0, 8))
    )  # a row of 512 MiB: a piece of values along it, not the row
    assert scatter.cut(wide) == scatter.Cut(1, scatter.PIECE_BYTES // 4, 4)
    layer = ChunkPart(
        "k", at, 64 << 20, (1, 4096, 4096), (slice(0, 1),) * 3, (slice(0, 1),) * 3
    )  # one layer of stacked weights: rows of its second axis
    assert scatter.cut(layer) == scatter.Cut(1, scatter.PIECE_BYTES // (16 << 10), 16 << 10)
    n = scatter.PIECE_BYTES // 4 + 1  # a row just wider than a piece: two even halves
    just = ChunkPart(
        "k", at, 3 * n * 4, (3, n), (slice(0, 3), slice(0, 1)), (slice(0, 3), slice(0, 1))
    )
    assert scatter.cut(just) == scatter.Cut(1, (n + 1) // 2, 4)
    for p in (box, wide, layer, just):
        assert scatter.cut(p).piece_bytes <= scatter.PIECE_BYTES


@pytest.mark.parametrize(
    ("piece", "axis"), [(1, 2), (24, 1), (80, 0), (1 << 20, 0)]
)  # in values: one value, 3 slabs of the second axis, 2 rows, the whole chunk
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_chunk_of_wide_rows_is_read_in_pieces_of_a_row(piece, axis, dtype, tmp_path, monkeypatch):
    """A 3-D chunk whose pieces are cut along each of its axes in turn: two parts that cut
    through every axis (one with two replicas) get exactly their boxes, bit for bit."""
    values = random_bits((3, 5, 8), dtype, np.random.default_rng(5))
    monkeypatch.setattr(scatter, "PIECE_BYTES", piece * values.itemsize)
    at = _chunk_file(tmp_path / "d", values)
    a = (slice(0, 2), slice(1, 4), slice(2, 7))
    b = (slice(1, 3), slice(0, 5), slice(0, 3))
    first = np.zeros((2, 3, 5), values.dtype)
    second = [np.zeros((4, 6, 4), values.dtype) for _ in range(3)]  # the part at (2:4, 1:6, 1:4)
    at_b = (slice(2, 4), slice(1, 6), slice(1, 4))
    parts = [
        (_part(at, values, a, (slice(0, 2), slice(0, 3), slice(0, 5))), [first]),
        (_part(at, values, b, at_b), second),
    ]
    assert scatter.cut(parts[0][0]).axis == axis
    fd = os.open(at.file, os.O_RDONLY)
    try:
        scatter.read(
            fd, parts[1][0], parts, np.empty(scatter.cut(parts[0][0]).piece_bytes, np.uint8)
        )
    finally:
        os.close(fd)
    assert_same_bits(values[a], first, "first")
    expected = np.zeros_like(second[0])  # (zero bytes) with the part in its box
    expected[at_b] = values[b]
    for r in second:
        assert_same_bits(expected, r, "second")  # its box, and nothing outside it


@pytest.mark.parametrize("shape", [(3, 0), (0, 3)])
def test_a_chunk_with_no_values_checks_its_trailer_once(shape, tmp_path, monkeypatch):
    """A chunk of no values (a 0-size axis): its trailer alone is read, once, and checked
    (the CRC32C of no bytes); a wrong one is named."""
    monkeypatch.setattr(scatter, "PIECE_BYTES", 1)
    values = np.zeros(shape, np.uint8)
    at = _chunk_file(tmp_path / "d", values)
    box = tuple(slice(0, n) for n in shape)
    part = _part(at, values, box, box)
    fd = os.open(at.file, os.O_RDONLY)
    try:
        scatter.read(fd, part, [(part, [np.zeros(shape, np.uint8)])], np.empty(1, np.uint8))
        with open(at.file, "r+b") as f:
            f.seek(at.start)
            f.write(b"BAD!")
        with pytest.raises(crc.Corrupt, match="x/c/0/0"):
            scatter.read(fd, part, [(part, [np.zeros(shape, np.uint8)])], np.empty(1, np.uint8))
    finally:
        os.close(fd)
