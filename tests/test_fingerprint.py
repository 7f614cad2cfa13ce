"""Leaf fingerprints (io/fingerprint.py): the documented formula, computed limb by limb in
plain Python here, equals the vectorized one; any partition of a leaf into pieces sums to the
whole leaf's; a changed bit always changes it."""

import itertools

import numpy as np
import pytest
from hostile import DTYPES, random_bits

from jaxckpt._src.io import fingerprint as fp

M64 = (1 << 64) - 1
P = (1 << 31) - 1
SEEDS = {
    "row": (0x6A09E667F3BCC908, 0xBB67AE8584CAA73B, 0x3C6EF372FE94F82B),
    "block": (0xA54FF53A5F1D36F1, 0x510E527FADE682D1, 0x9B05688C2B3E6C1F),
    "column": (0x1F83D9ABFB41BD6B, 0x5BE0CD19137E2179, 0xCBBB9D5DC1059ED8),
}


def splitmix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def weight(i: int, seed: int, below: int) -> int:
    return 1 + splitmix64(i ^ seed) % (below - 1)


def reference(a: np.ndarray) -> str:
    """docs/FORMAT.md's "Fingerprints", one limb at a time, in Python integers."""
    limb = 1 if a.dtype.itemsize == 1 else 2
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    columns = (a.shape[-1] if a.ndim else 1) * a.dtype.itemsize // limb
    lanes = [0, 0, 0]
    for k in range(len(flat) // limb):
        x = int.from_bytes(flat[k * limb : (k + 1) * limb].tobytes(), "little")
        row, column = divmod(k, columns)
        for lane in range(3):
            w = weight(row, SEEDS["row"][lane], P) * weight(column // 2048, SEEDS["block"][lane], P)
            w *= weight(column % 2048, SEEDS["column"][lane], 1 << 26)
            lanes[lane] = (lanes[lane] + w * x) % P
    return "".join(f"{v:08x}" for v in lanes)


@pytest.fixture(params=["small", "tiled"], autouse=True)
def path(request, monkeypatch):
    """Every test twice: small pieces' one-shot path, and the tiled path of large ones."""
    if request.param == "tiled":
        monkeypatch.setattr(fp, "SMALL_PIECE_LIMBS", 0)
    return request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_documented_formula(dtype):
    rng = np.random.default_rng(0)
    for shape in [(), (5,), (3, 4), (2, 3, 2)]:
        a = random_bits(shape, dtype, rng)
        assert fp.of_array(a) == reference(a), (dtype, shape)


def test_the_formula_across_column_blocks(monkeypatch):
    """Rows longer than a block (2048 limbs), pieces that start inside one, small tiles."""
    rng = np.random.default_rng(5)
    a = random_bits((3, 2100), np.dtype("float32"), rng)  # 4200 limbs a row: 3 blocks
    want = reference(a)
    assert fp.of_array(a) == want
    parts = [fp.of_piece(a[:, lo:hi], [(0, 3), (lo, hi)], a.shape) for lo, hi in
             [(0, 700), (700, 1500), (1500, 2100)]]  # fmt: skip
    assert fp.to_text(fp.combine(parts)) == want
    monkeypatch.setattr(fp, "TILE_LIMBS", 1)  # one row and one block a tile
    assert fp.of_array(a) == want
    assert fp.to_text(fp.combine(parts)) == want


def _cuts(n: int, rng: np.random.Generator) -> list[int]:
    inner = sorted(set(rng.integers(1, n, size=rng.integers(0, 3)).tolist())) if n > 1 else []
    return [0, *inner, n]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_any_partition_sums_to_the_whole(dtype):
    rng = np.random.default_rng(1)
    for shape in [(7,), (5, 9), (4, 3, 6)]:
        a = random_bits(shape, dtype, rng)
        cuts = [_cuts(n, rng) for n in shape]
        parts = []
        for box in itertools.product(*[list(itertools.pairwise(c)) for c in cuts]):
            piece = a[tuple(slice(lo, hi) for lo, hi in box)]
            parts.append(fp.of_piece(piece, box, shape))
        assert fp.to_text(fp.combine(parts)) == fp.of_array(a), (dtype, shape, cuts)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_changed_bit_changes_it(dtype):
    rng = np.random.default_rng(3)
    a = random_bits((6, 10), dtype, rng)
    raw = a.view(np.uint8).reshape(-1)
    for _ in range(20):
        b = raw.copy()
        b[rng.integers(0, b.size)] ^= np.uint8(1 << int(rng.integers(0, 8)))
        assert fp.of_array(b.view(a.dtype).reshape(a.shape)) != fp.of_array(a)


def test_structured_changes_are_seen():
    """What a sum modulo a power of two misses: float ones have 23 trailing zero bits, and
    flipping the signs of an even number of float64s moves only the top bit of two limbs."""
    ones = np.ones((64, 64), np.float32)
    x = np.random.default_rng(4).standard_normal(1000)
    y = x.copy()
    y[[3, 700]] *= -1
    assert fp.of_array(x) != fp.of_array(y)
    assert fp.of_array(ones) != fp.of_array(2 * ones)


def test_empty_leaves():
    assert fp.of_array(np.zeros((0, 4), np.float32)) == "0" * 24
    assert fp.of_piece(np.zeros((3, 0)), [(0, 3), (5, 5)], (3, 9)) == (0, 0, 0)
    assert fp.from_text(fp.of_array(np.ones(3))) == fp.of_piece(np.ones(3), [(0, 3)], (3,))


def test_sums_of_a_writer():
    a = np.arange(24, dtype=np.int32).reshape(4, 6)
    sums = fp.Sums()
    sums.add("x", a[:2], [(0, 2), (0, 6)], a.shape)
    sums.add("x", a[2:], [(2, 4), (0, 6)], a.shape)
    assert sums.texts() == {"x": fp.of_array(a)}
