"""How a leaf relates to its safetensors tensor(s): names, layout transforms, and which box
of which tensor a box of the leaf is (used by ``jaxckpt.safetensors`` to load and save)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from ..errors import SafetensorsError
from .sharding import Index

# --- the declarative mapping -----------------------------------------------------------------


@dataclass(frozen=True)
class Transpose:
    """The leaf is the tensor with its axes permuted (``np.transpose(tensor, axes)``); HF
    ``nn.Linear`` weights ``(out, in)`` are Flax ``Dense`` kernels with ``axes=(1, 0)``."""

    axes: tuple[int, ...]


@dataclass(frozen=True)
class Reshape:
    """The tensor, of ``file_shape`` in the file, reshaped to ``shape`` (before any
    Transpose), e.g. fused heads ``(heads * head_dim, d)`` -> ``(heads, head_dim, d)``."""

    file_shape: tuple[int, ...]
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Cast:
    """Stored in the file as ``dtype`` (``save``); on ``load`` it permits a cast across
    kinds (int <-> float). Loads always cast to the target's dtype within a kind."""

    dtype: Any


@dataclass(frozen=True)
class Stack:
    """The leaf's leading axis runs over tensors whose name has ``{i}`` (scanned layers:
    ``model.layers.{i}.mlp.up_proj.weight``), ``i`` from 0."""


Transform = Transpose | Reshape | Cast | Stack
Names = Callable[[str], str] | Sequence[tuple[str, str]] | None
Transforms = Callable[[str], Sequence[Transform]] | Sequence[tuple[str, Any]] | None


@dataclass(frozen=True)
class LeafMap:
    """How one leaf relates to its tensor(s)."""

    leaf: str  # the leaf's path, keys joined by "."
    tensor: str  # the tensor name; with ``stacked``, a pattern with "{i}"
    stacked: bool
    reshape: Reshape | None
    axes: tuple[int, ...] | None
    cast: np.dtype | None

    def names(self, count: int) -> list[str]:
        return [self.tensor.format(i=i) for i in range(count)] if self.stacked else [self.tensor]

    def tensor_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one tensor in the file, for a leaf of ``leaf_shape``."""
        shape = leaf_shape[1:] if self.stacked else leaf_shape
        if self.axes is not None:
            shape = tuple(shape[self.axes.index(d)] for d in range(len(shape)))
        return self.reshape.file_shape if self.reshape else tuple(shape)

    def leaf_shape(self, tensor_shape: tuple[int, ...], count: int) -> tuple[int, ...]:
        shape = self.reshape.shape if self.reshape else tensor_shape
        if self.axes is not None:
            shape = tuple(shape[a] for a in self.axes)
        return (count, *shape) if self.stacked else tuple(shape)


def leaf_map(path: str, names: Names, transforms: Transforms) -> LeafMap:
    if callable(names):
        tensor = names(path)
    else:
        tensor = path
        for pattern, repl in names or ():
            tensor = re.sub(pattern, repl, tensor)
    if callable(transforms):
        chain = list(transforms(path) or ())
    else:
        chain = next(
            (
                list(t) if isinstance(t, (list, tuple)) else [t]
                for p, t in transforms or ()
                if re.search(p, path)
            ),
            [],
        )
    reshape = next((t for t in chain if isinstance(t, Reshape)), None)
    body = [t for t in chain if not isinstance(t, (Stack, Cast))]
    if reshape is not None and body.index(reshape) != 0:
        raise SafetensorsError(f"leaf {path!r}: Reshape must come before Transpose in {chain}")
    axes = next((tuple(t.axes) for t in chain if isinstance(t, Transpose)), None)
    cast = next((np.dtype(jax.numpy.dtype(t.dtype)) for t in chain if isinstance(t, Cast)), None)
    stacked = any(isinstance(t, Stack) for t in chain)
    if stacked and "{i}" not in tensor:
        raise SafetensorsError(
            f"leaf {path!r} is stacked (Stack) but its tensor name {tensor!r} has no '{{i}}'"
        )
    return LeafMap(path, tensor, stacked, reshape, axes, cast)


def dotted(path: list) -> str:
    return ".".join(str(k) for _, k in path)


# --- slices of a leaf <-> byte runs of its tensors ---------------------------------------------


def tensor_boxes(m: LeafMap, box: Index) -> list[tuple[int, Index]]:
    """``(tensor number, box in the tensor's reshaped layout)`` for a box of the leaf."""
    (lo, hi), inner = (box[0], box[1:]) if m.stacked else ((0, 1), box)
    if m.axes is not None:
        inner = tuple(inner[m.axes.index(d)] for d in range(len(inner)))
    return [(i, inner) for i in range(lo, hi)]


def from_reshaped(m: LeafMap, block: np.ndarray) -> np.ndarray:
    return block if m.axes is None else np.transpose(block, m.axes)


def to_reshaped(m: LeafMap, block: np.ndarray) -> np.ndarray:
    return block if m.axes is None else np.transpose(block, np.argsort(m.axes))


def volume(box: Index) -> int:
    return math.prod(b - a for a, b in box)


def bounding(boxes: list[Index]) -> Index | None:
    """The box around ``boxes`` when they tile it with at most 1.5x its volume needed
    elsewhere (replicas counted once), else None."""
    if not boxes or not boxes[0]:
        return None
    box = tuple(
        (min(b[d][0] for b in boxes), max(b[d][1] for b in boxes)) for d in range(len(boxes[0]))
    )
    return box if volume(box) <= 1.5 * sum(volume(b) for b in set(boxes)) else None
