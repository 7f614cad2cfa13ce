"""The contract between the writer (``ocdbt_write``) and the readers (``chunk_plan``,
``direct``, ``mapped``) of a database's data files, each constant once.

A chunk's stored value is its bytes then their CRC32C (the ``crc32c`` codec, ``TRAILER``).
Small chunks lie back to back in a data file, so one ``preadv`` reads a run of them; a chunk
of ``SMALL_CHUNK_BYTES`` or more starts on an ``ALIGN`` boundary, so a restore onto CPU
devices can map it as an array's memory. Host buffers that CPU devices adopt start on an
``ADOPT_ALIGN`` boundary.
"""

TRAILER = 4
"""Bytes after each chunk's: their CRC32C, little-endian (zarr's ``crc32c`` codec)."""

ALIGN = 4096
"""A page: where the writer starts each chunk of ``SMALL_CHUNK_BYTES`` or more (zero bytes
before it), and so the most zero bytes a reader finds between two chunks it reads in one
go."""

SMALL_CHUNK_BYTES = 256 << 10
"""Below it a chunk (and a slice) is small: packed back to back by the writer, read in
batches by the direct reader; never mapped (each mapping is one more of the process's
``vm.max_map_count``, and a small read costs less)."""

ADOPT_ALIGN = 64
"""XLA's CPU client adopts a host buffer as a device buffer, without a copy, only from an
address aligned so."""
