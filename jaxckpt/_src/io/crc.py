"""A chunk's CRC32C check (``verify``: the one every read path makes), and the CRC32C of a
concatenation from the CRC32Cs of its parts (``combine``), so that threads can check the
pieces of one chunk in parallel and the chunk's CRC still be compared with its stored one. The arithmetic of zlib's ``crc32_combine``, for the Castagnoli polynomial:
appending ``n`` bytes multiplies the first CRC by x^(8n) modulo the polynomial.

>>> combine(crc32c(b"ab"), crc32c(b"cd"), 2) == crc32c(b"abcd")
True
"""

from __future__ import annotations

import functools
from typing import Any

POLY = 0x82F63B78  # CRC32C (Castagnoli), bit-reflected
_ONE = 1 << 31  # the polynomial 1, reflected


def _multiply(a: int, b: int) -> int:
    """a * b modulo the polynomial (both reflected)."""
    m, p = _ONE, 0
    while a:
        if a & m:
            p ^= b
            a ^= m
        m >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1
    return p


@functools.cache
def _x_to_2_to(k: int) -> int:
    """x^(2^k) modulo the polynomial."""
    return _ONE >> 1 if k == 0 else _multiply(_x_to_2_to(k - 1), _x_to_2_to(k - 1))


@functools.lru_cache(maxsize=256)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the polynomial: what appending ``nbytes`` bytes multiplies by."""
    p, k = _ONE, 3
    while nbytes:
        if nbytes & 1:
            p = _multiply(_x_to_2_to(k), p)
        nbytes >>= 1
        k += 1
    return p


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """The CRC32C of ``a + b`` from ``crc32c(a)``, ``crc32c(b)`` and ``len(b)``."""
    return _multiply(_shift(len_b), crc_a) ^ crc_b if len_b else crc_a


class Corrupt(Exception):
    """A chunk whose CRC32C does not match its bytes (the caller names the leaf)."""

    def __init__(self, key: str, at: Any) -> None:
        super().__init__(f"chunk {key!r} at {at}: CRC32C mismatch")
        self.key, self.at = key, at


def verify(key: str, at: Any, got: int | None, trailer: bytes | bytearray | memoryview) -> None:
    """The one check of a chunk, whichever way it was read: its bytes' CRC32C ``got`` (None:
    not all of them came) is the one stored after them (``trailer``, little-endian), else
    :class:`Corrupt` naming chunk ``key`` at ``at`` (its data file and byte range)."""
    if got is None or len(trailer) != 4 or got != int.from_bytes(trailer, "little"):
        raise Corrupt(key, at)
