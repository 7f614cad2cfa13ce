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

from ..boxes import from_text, to_text
from ..io import arrays
from ..io.layout import ADOPT_ALIGN
from .local import Slices, Writers
from .planner import SliceKey

Layout = dict[SliceKey, tuple[np.dtype, tuple[int, ...], int]]  # dtype, shape, writer


def pack(slices: Slices, writers: Writers, reuse: np.ndarray | None = None) -> np.ndarray:
    """One uint8 buffer: header length (8 bytes), JSON header, then each slice 64-aligned.

    ``reuse``: an earlier packed buffer to fill again when it is big enough (writing into
    fresh memory is far slower than into memory already touched).
    """
    buf, views = pack_layout({k: (d.dtype, d.shape, writers[k]) for k, d in slices.items()}, reuse)
    for key, data in slices.items():
        if data.nbytes:
            np.copyto(views[key], data, casting="no")
    return buf


def pack_layout(specs: Layout, reuse: np.ndarray | None = None) -> tuple[np.ndarray, Slices]:
    """A packed buffer for slices of the given (dtype, shape, original writer), and the
    views its slices go into (uninitialized: the caller fills them, e.g. reads into them).
    """
    entries: list[tuple[str, str, int, int, str, list[int]]] = []
    end = 0
    for key, (dtype, shape, writer) in specs.items():
        entries.append((key.leaf, to_text(key.box), writer, end, str(dtype), list(shape)))
        end += _aligned(math.prod(shape) * dtype.itemsize)
    header = json.dumps(entries).encode()
    start = _aligned(8 + len(header))
    # aligned, so the peer exchange hands it to the device without another copy; only the
    # header and the padding are zeroed (the slices overwrite the rest)
    if reuse is not None and reuse.size >= start + end:
        buf = reuse[: start + end]  # same start address: still aligned
    else:
        buf = arrays.aligned_empty((start + end,), np.dtype(np.uint8))
    buf[:start] = 0
    buf[: 8 + len(header)] = np.frombuffer(struct.pack("<Q", len(header)) + header, np.uint8)
    views: Slices = {}
    for (_, _, _, off, _, _), (key, (dtype, shape, _)) in zip(entries, specs.items(), strict=True):
        n = math.prod(shape) * dtype.itemsize
        views[key] = buf[start + off : start + off + n].view(dtype).reshape(shape)
        buf[start + off + n : start + off + _aligned(n)] = 0
    return buf, views


def unpack(buf: np.ndarray | None) -> tuple[Slices, Writers]:
    """The slices (views into ``buf``) and their original writers (none in no buffer)."""
    if buf is None or buf.size < 8:
        return {}, {}
    (hlen,) = struct.unpack("<Q", buf[:8].tobytes())
    if hlen == 0:
        return {}, {}
    start = _aligned(8 + hlen)
    slices: Slices = {}
    writers: Writers = {}
    for leaf, text, writer, off, dtype, shape in json.loads(buf[8 : 8 + hlen].tobytes()):
        dt = jnp.dtype(dtype)
        key = SliceKey(leaf, from_text(text))
        n = math.prod(shape) * dt.itemsize
        slices[key] = buf[start + off : start + off + n].view(dt).reshape(shape)
        writers[key] = writer
    return slices, writers


def _aligned(n: int) -> int:
    """``n`` rounded up to a multiple of 64."""
    return -(-n // ADOPT_ALIGN) * ADOPT_ALIGN
