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

from ...errors import SafetensorsError
from ..boxes import Index, whole
from .format import TensorInfo, runs

# --- the declarative mapping -----------------------------------------------------------------


@dataclass(frozen=True)
class Transpose:
    """The axes permuted: ``np.transpose(x, axes)``; HF ``nn.Linear`` weights ``(out, in)``
    are Flax ``Dense`` kernels with ``axes=(1, 0)``."""

    axes: tuple[int, ...]


@dataclass(frozen=True)
class Reshape:
    """``x`` of shape ``file_shape`` (the shape this step receives: the tensor's in the file
    when it comes first) reshaped to ``shape``, e.g. fused heads ``(heads * head_dim, d)``
    -> ``(heads, head_dim, d)``."""

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
Step = Transpose | Reshape
Names = Callable[[str], str] | Sequence[tuple[str, str]] | None
Transforms = Callable[[str], Sequence[Transform]] | Sequence[tuple[str, Any]] | None
PLACEHOLDER = "{i}"


@dataclass(frozen=True)
class LeafMap:
    """How one leaf relates to its tensor(s): ``steps`` (Reshape, Transpose) turn one tensor,
    as in the file, into the leaf (one layer of it with ``stacked``), in order."""

    leaf: str  # the leaf's path, keys joined by "."
    tensor: str  # the tensor name; with ``stacked``, a pattern with "{i}"
    stacked: bool
    steps: tuple[Step, ...]
    cast: np.dtype | None

    def name(self, i: int) -> str:
        """The name of tensor ``i`` (layer ``i`` with ``stacked``; else the one tensor)."""
        return self.tensor.replace(PLACEHOLDER, str(i)) if self.stacked else self.tensor

    def names(self, leaf_shape: tuple[int, ...]) -> list[str]:
        """The names of the tensors of a leaf of ``leaf_shape``: one per layer (its leading
        dimension) with ``stacked``, else one."""
        return [self.name(i) for i in range(leaf_shape[0] if self.stacked and leaf_shape else 1)]

    @property
    def simple(self) -> bool:
        """A Reshape then a Transpose at most (after merging neighbours): a box of the leaf
        is a box of the reshaped tensor, read as byte runs. Other chains read whole tensors."""
        return _simple(self.steps) is not None

    @property
    def reshape(self) -> Reshape | None:
        return (_simple(self.steps) or (None, None))[0]

    @property
    def axes(self) -> tuple[int, ...] | None:
        return (_simple(self.steps) or (None, None))[1]

    def tensor_shape(self, leaf_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one tensor in the file, for a leaf of ``leaf_shape``."""
        shape = tuple(leaf_shape[1:] if self.stacked else leaf_shape)
        for step in reversed(self.steps):
            if isinstance(step, Transpose):
                if len(step.axes) != len(shape):
                    raise self._bad(step, shape, "gets (saving)")
                shape = tuple(shape[list(step.axes).index(d)] for d in range(len(shape)))
            else:
                if shape != tuple(step.shape):
                    raise self._bad(step, shape, "gets (saving)")
                shape = tuple(step.file_shape)
        return shape

    def leaf_shape(self, tensor_shape: tuple[int, ...], count: int) -> tuple[int, ...]:
        """The leaf's shape for tensors of ``tensor_shape``; raises if a step does not fit."""
        shape = tuple(tensor_shape)
        for step in self.steps:
            if isinstance(step, Transpose):
                if len(step.axes) != len(shape):
                    raise self._bad(step, shape, "receives")
                shape = tuple(shape[a] for a in step.axes)
            else:
                if shape != tuple(step.file_shape):
                    raise self._bad(step, shape, "receives")
                shape = tuple(step.shape)
        return (count, *shape) if self.stacked else shape

    def _bad(self, step: Step, shape: tuple[int, ...], verb: str) -> SafetensorsError:
        return SafetensorsError(
            f"leaf {self.leaf!r}: transform {step} {verb} shape {list(shape)}; fix the "
            "transforms (each step's input is the previous step's output, from the file "
            "towards the leaf)"
        )


def apply(steps: Sequence[Step], x: np.ndarray) -> np.ndarray:
    """One tensor, as in the file, through ``steps``: the leaf (one layer of it)."""
    for step in steps:
        x = np.transpose(x, step.axes) if isinstance(step, Transpose) else x.reshape(step.shape)
    return x


def invert(steps: Sequence[Step], x: np.ndarray) -> np.ndarray:
    """The leaf (one layer of it) back through ``steps``: the tensor as in the file."""
    for step in reversed(steps):
        if isinstance(step, Transpose):
            x = np.transpose(x, np.argsort(step.axes))
        else:
            x = x.reshape(step.file_shape)
    return x


def _simple(steps: tuple[Step, ...]) -> tuple[Reshape | None, tuple[int, ...] | None] | None:
    merged: list[Step] = []
    for step in steps:
        last = merged[-1] if merged else None
        if isinstance(step, Transpose) and isinstance(last, Transpose):
            merged[-1] = Transpose(tuple(last.axes[a] for a in step.axes))
        elif isinstance(step, Reshape) and isinstance(last, Reshape):
            merged[-1] = Reshape(last.file_shape, step.shape)
        else:
            merged.append(step)
    merged = [
        s
        for s in merged
        if not (isinstance(s, Transpose) and tuple(s.axes) == tuple(range(len(s.axes))))
        and not (isinstance(s, Reshape) and tuple(s.file_shape) == tuple(s.shape))
    ]
    first, last = (merged[0], merged[-1]) if merged else (None, None)
    reshape = first if isinstance(first, Reshape) else None
    transpose = last if isinstance(last, Transpose) else None
    if len(merged) != (reshape is not None) + (transpose is not None):
        return None  # not one of [], [Reshape], [Transpose], [Reshape, Transpose]
    return reshape, None if transpose is None else tuple(transpose.axes)


def tensor_name(path: str, names: Names) -> str:
    """The tensor name of the leaf at ``path``: ``names(path)``, or the first ``(regex,
    replacement)`` rule whose regex matches, applied with ``re.sub`` (``\\1`` and
    ``\\g<name>`` are its groups; ``{i}`` is left for Stack); no match: ``path`` itself."""
    if callable(names):
        return names(path)
    for pattern, replacement in names or ():
        if re.search(pattern, path):
            return re.sub(pattern, replacement, path)
    return path


def leaf_map(path: str, names: Names, transforms: Transforms) -> LeafMap:
    """How the leaf at ``path`` maps to its tensor(s): the names rule and the transforms rule
    that apply (the first of each whose regex matches the path)."""
    tensor = tensor_name(path, names)
    if not isinstance(tensor, str):
        raise SafetensorsError(f"leaf {path!r}: names gave {tensor!r}, not a string")
    if callable(transforms):
        chain = list(transforms(path) or ())
    else:
        found: Any = next((t for pattern, t in transforms or () if re.search(pattern, path)), [])
        chain = list(found) if isinstance(found, (list, tuple)) else [found]
    bad = [t for t in chain if not isinstance(t, (Transpose, Reshape, Cast, Stack))]
    if bad:
        raise SafetensorsError(
            f"leaf {path!r}: {bad[0]!r} is not a transform (Transpose, Reshape, Cast, Stack)"
        )
    steps = tuple(t for t in chain if isinstance(t, (Transpose, Reshape)))
    for t in steps:
        _check_step(path, t)
    casts = [t for t in chain if isinstance(t, Cast)]
    if len(casts) > 1 or sum(isinstance(t, Stack) for t in chain) > 1:
        raise SafetensorsError(f"leaf {path!r}: Cast and Stack may appear once each in {chain}")
    try:
        cast = np.dtype(jax.numpy.dtype(casts[0].dtype)) if casts else None
    except TypeError as e:
        raise SafetensorsError(f"leaf {path!r}: {casts[0]} names no dtype ({e})") from None
    stacked = any(isinstance(t, Stack) for t in chain)
    braces = tensor.replace(PLACEHOLDER, "")
    if stacked and (PLACEHOLDER not in tensor or "{" in braces or "}" in braces):
        raise SafetensorsError(
            f"leaf {path!r} is stacked (Stack) but its tensor name {tensor!r} does not have "
            "'{i}' as its only braces ('{i}' is replaced by the layer number, other braces "
            "are not placeholders); fix names="
        )
    if not stacked and PLACEHOLDER in tensor:
        raise SafetensorsError(
            f"leaf {path!r}: tensor name {tensor!r} has '{{i}}' (the layer number of scanned "
            "layers) but the leaf has no Stack() transform; add Stack() or fix names="
        )
    return LeafMap(path, tensor, stacked, steps, cast)


def _check_step(path: str, t: Step) -> None:
    if isinstance(t, Transpose):
        if sorted(t.axes) != list(range(len(t.axes))):
            raise SafetensorsError(f"leaf {path!r}: {t} is not a permutation of the axes")
    elif math.prod(t.file_shape) != math.prod(t.shape) or min((*t.file_shape, *t.shape, 0)) < 0:
        raise SafetensorsError(f"leaf {path!r}: {t} changes the number of elements; fix the shapes")


def dotted(path: Sequence[Sequence[Any]]) -> str:
    """A leaf's path as its default tensor name: the keys joined by "."."""
    return ".".join(str(k) for _, k in path)


# --- slices of a leaf <-> byte runs of its tensors ---------------------------------------------


def tensor_runs(
    m: LeafMap, box: Index, tensors: Sequence[TensorInfo]
) -> tuple[Index, list[tuple[TensorInfo, list[tuple[int, int]]]]]:
    """Where a box of the leaf lies in its ``tensors`` (one per layer with ``stacked``, all
    of one shape and dtype): the box in their layout after the simple Reshape (a chain that
    is not ``simple``: the whole tensor), and for each tensor the box touches, in order, its
    byte runs ``(offset in the file, length)``."""
    (lo, hi), inner = (box[0], box[1:]) if m.stacked else ((0, 1), box)
    shape = tensors[0].shape
    if not m.simple:
        inner = whole(shape)
    elif m.axes is not None:
        inner = tuple(inner[m.axes.index(d)] for d in range(len(inner)))
    layout = tuple(m.reshape.shape) if m.reshape else shape
    at = runs(layout, tensors[0].dtype.itemsize, inner)
    return inner, [(t, [(t.begin + off, n) for off, n in at]) for t in tensors[lo:hi]]


def from_reshaped(m: LeafMap, block: np.ndarray) -> np.ndarray:
    """A block read in the ``tensor_runs`` layout as part of the leaf (one layer)."""
    if not m.simple:
        return apply(m.steps, block)
    return block if m.axes is None else np.transpose(block, m.axes)


def to_reshaped(m: LeafMap, block: np.ndarray) -> np.ndarray:
    if not m.simple:
        return invert(m.steps, block)
    return block if m.axes is None else np.transpose(block, np.argsort(m.axes))
