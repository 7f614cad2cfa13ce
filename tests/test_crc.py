"""crc.combine: the CRC32C of a concatenation from its parts' CRC32Cs, checked against the
crc32c package over the whole."""

import crc32c
import numpy as np
import pytest

from jaxckpt._src.io import crc


@pytest.mark.parametrize("seed", range(6))
def test_combine_equals_the_crc_of_the_whole(seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(0, 3 << 20)), dtype=np.uint8).tobytes()
    cuts = sorted(int(c) for c in rng.integers(0, len(data) + 1, int(rng.integers(1, 9))))
    parts = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    got = 0
    for part in parts:  # empty parts included
        got = crc.combine(got, crc32c.crc32c(part), len(part))
    assert got == crc32c.crc32c(data)


def test_combine_sees_every_byte():
    a, b = b"\x00" * 1000, b"\x01" + b"\x00" * 999
    assert crc.combine(crc32c.crc32c(a), crc32c.crc32c(a), 1000) != crc32c.crc32c(a + b)
    assert crc.combine(crc32c.crc32c(a), crc32c.crc32c(b), 1000) == crc32c.crc32c(a + b)
    assert crc.combine(0x12345678, 0, 0) == 0x12345678
