"""The peer wire format: held slices packed into one byte buffer (and back), for the rows
``peers.send_rows`` moves (peer copies on save, missing slices on restore).

A buffer is the header's length (8 bytes, little-endian), a JSON header with one entry per
slice ``[leaf, index key, original writer, offset, dtype, shape]``, then each slice's bytes,
every one 64-byte aligned (the slices are views into the buffer, no copy).
"""

from __future__ import annotations

import json
import math
import struct

import jax.numpy as jnp
import numpy as np

from .. import arrays
from ..boxes import Index, from_text, to_text
from .local import Slices

_ALIGN = 64


def pack(
    slices: Slices, origins: dict[tuple[str, Index], int], reuse: np.ndarray | None = None
) -> np.ndarray:
    """One uint8 buffer: header length (8 bytes), JSON header, then each slice 64-aligned.

    ``reuse``: an earlier packed buffer to fill again when it is big enough (writing into
    fresh memory is far slower than into memory already touched).
    """
    specs = {k: (d.dtype, d.shape, origins[k]) for k, d in slices.items()}
    buf, views = pack_layout(specs, reuse)
    for key, data in slices.items():
        if data.nbytes:
            np.copyto(views[key], data, casting="no")
    return buf


def pack_layout(
    specs: dict[tuple[str, Index], tuple[np.dtype, tuple[int, ...], int]],
    reuse: np.ndarray | None = None,
) -> tuple[np.ndarray, Slices]:
    """A packed buffer for slices of the given (dtype, shape, original writer), and the
    views its slices go into (uninitialized: the caller fills them, e.g. reads into them).
    """
    entries, offset = [], 0
    for (name, index), (dtype, shape, origin) in specs.items():
        entries.append([name, to_text(index), origin, offset, str(dtype), list(shape)])
        offset += -(-math.prod(shape) * dtype.itemsize // _ALIGN) * _ALIGN
    header = json.dumps(entries).encode()
    start = -(-(8 + len(header)) // _ALIGN) * _ALIGN
    # aligned, so the peer exchange hands it to the device without another copy; only the
    # header and the padding are zeroed (the slices overwrite the rest)
    if reuse is not None and reuse.size >= start + offset:
        buf = reuse[: start + offset]  # same start address: still aligned
    else:
        buf = arrays.aligned_empty((start + offset,), np.dtype(np.uint8))
    buf[:start] = 0
    buf[:8] = np.frombuffer(struct.pack("<Q", len(header)), np.uint8)
    buf[8 : 8 + len(header)] = np.frombuffer(header, np.uint8)
    views: Slices = {}
    for (_, _, _, off, _, _), (key, (dtype, shape, _)) in zip(entries, specs.items(), strict=True):
        n = math.prod(shape) * dtype.itemsize
        views[key] = buf[start + off : start + off + n].view(dtype).reshape(shape)
        buf[start + off + n : start + off + (-(-n // _ALIGN) * _ALIGN)] = 0
    return buf, views


def unpack(buf: np.ndarray) -> tuple[Slices, dict[tuple[str, Index], int]]:
    """The slices (views into ``buf``) and their original writers."""
    if buf.size < 8:
        return {}, {}
    (hlen,) = struct.unpack("<Q", buf[:8].tobytes())
    if hlen == 0:
        return {}, {}
    entries = json.loads(buf[8 : 8 + hlen].tobytes().decode())
    start = -(-(8 + hlen) // _ALIGN) * _ALIGN
    slices: Slices = {}
    origins: dict[tuple[str, Index], int] = {}
    for name, key, origin, off, dtype, shape in entries:
        dt = jnp.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        data = buf[start + off : start + off + n].view(dt).reshape(shape)
        slices[(name, from_text(key))] = data
        origins[(name, from_text(key))] = origin
    return slices, origins
