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


def test_a_piece_holds_about_piece_bytes_of_whole_rows():
    at = arrays.ChunkBytes("f", 0, 68)
    box = ChunkPart("k", at, 64, (4, 4), (slice(0, 2), slice(1, 3)), (slice(0, 2), slice(0, 2)))
    assert scatter.rows_per_piece(box) == scatter.PIECE_BYTES // 16
    wide = ChunkPart(
        "k", at, 1 << 30, (2, 1 << 27), (slice(0, 2), slice(0, 8)), (slice(0, 2), slice(0, 8))
    )
    assert scatter.rows_per_piece(wide) == 1  # a row wider than a piece: a row at a time
