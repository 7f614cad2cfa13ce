"""``metadata`` and ``load`` of :mod:`jaxckpt.safetensors` (its docstring says how names and
transforms work); ``save`` is in ``safetensors_save``."""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from ...errors import SafetensorsError
from .. import gc_pause, ring
from .. import tree as tree_lib
from ..boxes import Index, bounding, extent, volume, whole, within
from ..io.inflight import READ_BUDGET_BYTES, InFlight
from ..placement import Placement
from ..storage import Location, location
from .format import INDEX_FILE, TensorInfo, coalesce, index_files, read, read_header
from .mapping import LeafMap, Names, Transforms, dotted, from_reshaped, leaf_map, tensor_runs

# --- metadata and load -------------------------------------------------------------------------


def _files(path: str | os.PathLike | Location | Sequence) -> tuple[Location, list[str], str]:
    """The directory and the ``.safetensors`` files of ``path``, and what errors call it."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise SafetensorsError("an empty list of safetensors files; pass at least one")
        locs = [location(p) for p in path]
        parent = locs[0].parent()
        if any(p.parent() != parent for p in locs):
            raise SafetensorsError(f"{[p.url for p in locs]}: the files must share one directory")
        return parent, [p.name for p in locs], parent.url
    if not isinstance(path, (str, os.PathLike, Location)):
        raise SafetensorsError(f"{path!r}: pass a path, or a list or tuple of paths")
    loc = location(path)
    if loc.name == INDEX_FILE:  # the index itself: its directory
        loc = loc.parent()
    elif loc.name.endswith(".safetensors") or (loc.is_local and os.path.isfile(loc.url)):
        return loc.parent(), [loc.name], loc.url
    try:
        index = loc.read_bytes(INDEX_FILE)
    except OSError as e:
        raise SafetensorsError(f"{loc.url}/{INDEX_FILE} cannot be read ({e})") from None
    if index is not None:
        where = f"{loc.url}/{INDEX_FILE}"
        return loc, index_files(index, where), where
    found = [n for n in loc.list_children() if n.endswith(".safetensors")]
    if not found:
        raise SafetensorsError(
            f"{loc.url} holds no .safetensors file and no {INDEX_FILE}; pass a file, a "
            "directory in the Hugging Face layout or a list of files"
        )
    return loc, found, loc.url


@dataclass(frozen=True)
class Files(Mapping):
    """What ``metadata`` returns: ``tensors`` by name (this mapping's items) and each file's
    ``__metadata__`` (``metadata``, file name -> ``{str: str}``; ``{}`` where it has none)."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, dict[str, str]]

    def __getitem__(self, name: str) -> TensorInfo:
        if name == "__metadata__" and name not in self.tensors:
            raise KeyError("'__metadata__' is not a tensor; each file's is in .metadata")
        return self.tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def _headers(
    path: str | os.PathLike | Location | Sequence,
) -> tuple[Location, ts.KvStore, Files, str]:
    """The directory of ``path``, its kvstore, the tensors and ``__metadata__`` of all its
    files, and what errors call ``path``."""
    loc, files, where = _files(path)
    kv = ts.KvStore.open(loc.kvstore()).result()
    tensors: dict[str, TensorInfo] = {}
    meta: dict[str, dict[str, str]] = {}
    for f in files:
        file_tensors, meta[f] = read_header(kv, f, loc.url)
        for name, info in file_tensors.items():
            if name in tensors:
                raise SafetensorsError(
                    f"{loc.url}/{f}: tensor {name!r} is also in {loc.url}/{tensors[name].file}"
                    "; the files are not one model (pass the files of one model)"
                )
            tensors[name] = info
    return loc, kv, Files(tensors, meta), where


def metadata(path: str | os.PathLike | Sequence) -> Files:
    """Every tensor's dtype, shape, file and bytes, from the headers alone (no data read):
    a mapping of tensor name to :class:`TensorInfo`; ``.metadata`` holds each file's
    ``__metadata__`` (file name -> dict), apart from the tensors."""
    return _headers(path)[2]


@dataclass(frozen=True)
class _Want:
    m: LeafMap
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: jax.sharding.Sharding | None
    tensors: list[TensorInfo]


def load(
    path: str | os.PathLike | Sequence,
    target: Any,
    *,
    names: Names = None,
    transforms: Transforms = None,
    read_budget_bytes: int | None = None,
) -> Any:
    """Reads safetensors tensors into a pytree shaped like ``target``.

    ``path``: one file, a directory (with ``model.safetensors.index.json``, or its
    ``.safetensors`` files), or a list of files; local, ``s3://`` or ``gs://``. ``target``
    leaves: ``jax.ShapeDtypeStruct`` with a sharding, ``jax.Array``, or NumPy arrays (NumPy
    results); other leaves are returned as they are. ``names``: a callable of the leaf's
    path, or ``(regex, replacement)`` rules of which the first whose regex matches applies
    (``re.sub``: ``\\1`` is a group, ``{i}`` the layer of a ``Stack`` leaf). ``transforms``:
    ``(regex, [steps])`` rules, first match; every Reshape/Transpose step applies in order
    from the file towards the leaf. Each process reads only the byte ranges its devices
    need, at most ``read_budget_bytes`` (default 128 MiB) in flight. Any failure raises a
    ``jaxckpt.errors`` class naming the file (or index) and the leaf.
    """
    loc, kv, tensors, where = _headers(path)
    flat = tree_lib.flatten(target)
    wants: list[_Want | None] = [
        _want(p, t, tensors, names, transforms, loc, where) if _is_array(t) else None
        for p, t in flat
    ]
    budget = read_budget_bytes or READ_BUDGET_BYTES
    reads = InFlight[list](budget)
    devices = {d for w in wants if w and w.sharding is not None for d in w.sharding.device_set}
    with gc_pause.paused(), ring.for_restore(budget, devices) as host:  # (as a restore)
        reader = _Reader(kv, loc.url, reads, host)
        finish = [None if w is None else reader.leaf(w) for w in wants]
        reads.drain()
    leaves = [t if f is None else f() for f, (_, t) in zip(finish, flat, strict=True)]
    return tree_lib.unflatten_like(target, leaves)


def _is_array(t: Any) -> bool:
    return isinstance(t, (jax.ShapeDtypeStruct, jax.Array, np.ndarray))


def _want(
    path: list,
    t: Any,
    tensors: Mapping[str, TensorInfo],
    names: Names,
    transforms: Transforms,
    loc: Location,
    where: str,
) -> _Want:
    try:
        m = leaf_map(dotted(path), names, transforms)
    except SafetensorsError as e:
        raise type(e)(f"{where}: {e}") from None
    shape, dtype = tuple(t.shape), np.dtype(t.dtype)
    found = []
    for name in m.names(shape):
        info = tensors.get(name)
        if info is None:
            close = difflib.get_close_matches(name, list(tensors), n=3, cutoff=0.5)
            raise SafetensorsError(
                f"{where}: leaf {m.leaf!r} needs tensor {name!r}, which the files do not "
                f"hold (closest: {close or sorted(tensors)[:3]}); fix names= or the target"
            )
        found.append(info)
    first = found[0]
    file = f"{loc.url}/{first.file}"
    if any(f.shape != first.shape or f.dtype != first.dtype for f in found):
        raise SafetensorsError(
            f"{where}: the tensors stacked into leaf {m.leaf!r} differ in shape or dtype"
        )
    try:
        got = m.leaf_shape(first.shape, len(found))
    except SafetensorsError as e:
        raise SafetensorsError(
            f"{file}: tensor {first.name!r} of shape {list(first.shape)}: {e}"
        ) from None
    if got != shape:
        raise SafetensorsError(
            f"{file}: tensor {first.name!r} of shape {list(first.shape)} gives "
            f"leaf {m.leaf!r} shape {list(got)} after the transforms, but the target has "
            f"{list(shape)}; fix the target or the transforms"
        )
    if _kind(first.dtype) != _kind(dtype) and m.cast is None:
        raise SafetensorsError(
            f"{file}: tensor {first.name!r} is {first.dtype}, leaf {m.leaf!r} "
            f"is {dtype}; add a Cast transform to convert across kinds"
        )
    sharding = None if isinstance(t, np.ndarray) else getattr(t, "sharding", None)
    return _Want(m, shape, dtype, sharding, found)


def _kind(dtype: np.dtype) -> str:
    if dtype == np.bool_:
        return "bool"
    return "int" if np.issubdtype(dtype, np.integer) else "float"


class _Reader:
    """Reads boxes of leaves as coalesced byte ranges, at most ``budget`` bytes in flight."""

    def __init__(self, kv: ts.KvStore, url: str, reads: InFlight[list], host: ring.Ring | None):
        """``host``: where boxes read in several runs are put together and slices are cut
        out to (``ring``: devices that copy them), else fresh memory."""
        self.kv, self.url, self.reads, self.host = kv, url, reads, host

    def _buffer(self, nbytes: int, slots: list[np.ndarray] | None) -> np.ndarray:
        """``nbytes`` (uint8) to put a box or a slice together in: a ring slot, noted in
        ``slots`` (None: fresh memory only, for values the caller keeps), or fresh memory."""
        slot = self.host.take(nbytes) if self.host is not None and slots is not None else None
        if slot is None:
            return np.empty(nbytes, np.uint8)
        assert slots is not None
        slots.append(slot)
        return slot

    def _put(self, out: Placement, index: Index, data: np.ndarray) -> None:
        """``data`` onto the devices of slice ``index``; a ring slot it lies in reused
        once it is copied."""
        if self.host is None:
            out.put(index, data)
        else:
            self.host.give_back(data, out.put(index, data, borrowed=self.host.holds(data)))

    def leaf(self, w: _Want) -> Callable[[], Any]:
        if w.sharding is None:
            holder: dict = {}
            keep = functools.partial(holder.__setitem__, "v")  # (NumPy: never in the ring)
            self._submit(w, whole(w.shape), keep, staged=False)
            return lambda: holder["v"]
        # slices go onto the devices one by one (Placement): never a whole-array device_put,
        # whose cross-process equality check fails on NaN (NaN != NaN) in a multi-process job
        out = Placement(w.sharding, w.shape, w.dtype)
        by_index = out.indices
        if not by_index:
            return out.array
        block = bounding(by_index)
        if not w.m.simple:  # whole tensors are read: read those of all the slices at once
            block = tuple(
                (min(i[d][0] for i in by_index), max(i[d][1] for i in by_index))
                for d in range(len(w.shape))
            )
        itemsize = w.tensors[0].dtype.itemsize
        if block is not None and (
            not w.m.simple or volume(block) * itemsize <= self.reads.budget // 2
        ):
            # the slices this process needs, read together (a few long runs, not one short
            # run per row of every slice) and cut on the host
            def cut(data: np.ndarray, block: Index = block) -> None:
                for i in by_index:
                    part = data[within(i, block)]
                    into = self._buffer(part.nbytes, [])[: part.nbytes].view(part.dtype)
                    into = into.reshape(part.shape)
                    np.copyto(into, part)
                    self._put(out, i, into)

            self._submit(w, block, cut)
        else:
            for index in by_index:
                self._submit(w, index, functools.partial(self._put, out, index))
        return out.array

    def _submit(
        self,
        w: _Want,
        box: Index,
        consume: Callable[[np.ndarray], object],
        staged: bool = True,
    ) -> None:
        """Reads ``box`` of the leaf (its tensors' byte runs, coalesced) under the budget;
        put together in ring slots where ``staged``, each given back once ``consume`` is
        done (a slot whose data it put onto devices is given back by ``_put`` already)."""
        rbox, pieces = tensor_runs(w.m, box, w.tensors)

        def start() -> list:
            return [
                (
                    info,
                    [
                        (read(self.kv, info.file, o, o + n, self.url, exact=True), o, members)
                        for o, n, members in coalesce(at)
                    ],
                )
                for info, at in pieces
            ]

        def use(parts: list) -> None:
            slots: list[np.ndarray] | None = [] if staged else None
            consume(self._assemble(w, box, rbox, parts, slots))
            for slot in slots or ():
                assert self.host is not None
                self.host.give_back(slot, [])

        self.reads.add(sum(n for _, at in pieces for _, n in at), start, use)

    def _assemble(
        self, w: _Want, box: Index, rbox: Index, parts: list, slots: list[np.ndarray] | None
    ) -> np.ndarray:
        """The box of the leaf from its tensors' reads of ``rbox``, in the leaf's dtype."""
        blocks = []
        for info, reads in parts:
            if len(reads) == 1 and len(reads[0][2]) == 1:  # one run: the read is the block
                buf = reads[0][0]()
            else:
                buf = self._buffer(volume(rbox) * info.dtype.itemsize, slots)
                pos = 0
                for get, off, members in reads:
                    data = get()
                    for moff, mn in members:
                        buf[pos : pos + mn] = data[moff - off : moff - off + mn]
                        pos += mn
            block = np.frombuffer(buf, dtype=info.dtype).reshape(extent(rbox))
            blocks.append(from_reshaped(w.m, block))
        data = np.stack(blocks) if w.m.stacked else blocks[0]
        if not w.m.simple:  # whole tensors were read: the box of the leaf
            inner = box[1:] if w.m.stacked else box
            data = data[(slice(None),) * w.m.stacked + tuple(slice(a, b) for a, b in inner)]
        return data.astype(w.dtype, copy=data.dtype != w.dtype)
