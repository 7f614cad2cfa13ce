"""A save's ``compression``: the names and levels accepted (``"zstd"``, ``"blosc"``, either
with ``":<level>"``), the zarr v3 codec each writes, and the chunk bound blosc needs. Both
codecs are TensorStore's: any zarr v3 reader opens them (docs/FORMAT.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import OptionsError

LEVELS = {"zstd": (3, 1, 22), "blosc": (1, 1, 9)}  # name: (default level, lowest, highest)
BLOSC_BLOCK_BYTES = 1 << 20
"""Blosc's block: blosc shuffles each block (every element's first byte, then every
second byte, ...) and gives it to zstd, whose own blocks of 128 KiB each get entropy tables
of their own. At 1 MiB each byte plane of a bf16 or f32 block fills whole zstd blocks and
gets its own tables (the exponent bytes are what compresses); blosc's automatic choice at
level 1, a few dozen KiB, put the planes into one zstd block and gave plain zstd's ratio
(docs/MEASURED.md). So chunks of less than a few hundred KiB gain little over zstd."""
BLOSC_MAX_CHUNK_BYTES = 1 << 30
"""Blosc compresses at most 2 GiB - 16 bytes at once (TensorStore refuses a larger chunk
when it writes it): a blosc save keeps its chunks to at most this (``chunk_bytes``)."""


@dataclass(frozen=True)
class Compression:
    """A save's ``compression`` read: ``"zstd"`` or ``"blosc"``, and its level."""

    name: str
    level: int


def parse(value: str | None) -> Compression | None:
    """``value`` (None, ``"zstd"``, ``"blosc"``, or either with ``":<level>"``) read and
    checked; an unknown name or a level out of range is an ``OptionsError`` naming the fix."""
    if value is None:
        return None
    name, colon, level = value.partition(":") if isinstance(value, str) else ("", "", "")
    if name in LEVELS:
        default, low, high = LEVELS[name]
        if not colon:
            return Compression(name, default)
        if level.isascii() and level.isdigit() and low <= int(level) <= high:
            return Compression(name, int(level))
    raise OptionsError(
        f"compression={value!r} is not supported; pass None, 'zstd' or 'blosc', or one with a "
        "level after a colon ('zstd:1' to 'zstd:22', 'blosc:1' to 'blosc:9')"
    )


def codec(value: str | None, typesize: int) -> dict | None:
    """The zarr v3 bytes-to-bytes codec of ``value`` for elements of ``typesize`` bytes
    (None: no compression). ``"blosc"``: blosc's byte shuffle with the element's size, then
    zstd, what groups the exponent bytes of float weights together (docs/FORMAT.md)."""
    c = parse(value)
    if c is None:
        return None
    if c.name == "zstd":
        return {"name": "zstd", "configuration": {"level": c.level}}
    config = {
        "cname": "zstd",
        "clevel": c.level,
        "shuffle": "shuffle",
        "typesize": typesize,
        "blocksize": BLOSC_BLOCK_BYTES,
    }
    return {"name": "blosc", "configuration": config}


def chunk_bytes_for(value: str | None, chunk_bytes: int | None) -> int | None:
    """The chunk size bound a save with ``compression=value`` uses: ``chunk_bytes``, at most
    ``BLOSC_MAX_CHUNK_BYTES`` with blosc."""
    c = parse(value)
    if c is None or c.name != "blosc":
        return chunk_bytes
    return min(chunk_bytes or BLOSC_MAX_CHUNK_BYTES, BLOSC_MAX_CHUNK_BYTES)
