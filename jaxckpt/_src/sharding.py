"""Shardings as JSON, shard ownership, and binding saved specs to the devices we have now.

A mesh is stored as axis names, axis sizes, the device-id grid and which process held each
device. Restores never look devices up by their saved ids: a saved mesh is rebuilt *by
position* over the current devices, so a restart whose devices carry new ids still works.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from ..errors import ShardingError
from .boxes import Index, chunks_in, from_slices

if TYPE_CHECKING:
    from .manifest import LeafRecord

# Devices are annotated ``jax.Device`` below: jax's own annotations name a ``Device`` that
# mypy cannot resolve (jaxlib's ``_jax`` extension module has no stubs).

# --- JSON forms -------------------------------------------------------------------------


def mesh_to_json(mesh: Mesh) -> dict:
    return copy.deepcopy(_mesh_json(mesh))


@functools.lru_cache(maxsize=64)
def _mesh_json(mesh: Mesh) -> dict:  # shared: never handed out unless copied
    ids = np.vectorize(lambda d: d.id, otypes=[int])(mesh.devices)
    procs = np.vectorize(lambda d: d.process_index, otypes=[int])(mesh.devices)
    return {
        "axis_names": [str(n) for n in mesh.axis_names],
        "shape": [int(s) for s in mesh.devices.shape],
        "device_ids": ids.tolist(),
        "process_indices": procs.tolist(),
        "axis_types": [str(t).rsplit(".", 1)[-1] for t in mesh.axis_types],
    }


def spec_to_json(spec: PartitionSpec) -> list:
    return [
        None if e is None else [str(a) for a in e] if isinstance(e, tuple) else str(e) for e in spec
    ]


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, an axis name or a tuple of them)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def spec_from_json(spec: list) -> PartitionSpec:
    return PartitionSpec(*(tuple(e) if isinstance(e, list) else e for e in spec))


def sharding_to_json(sharding: jax.sharding.Sharding, meshes: list[dict]) -> dict:
    """JSON form of a leaf's sharding; named meshes are deduplicated into ``meshes``."""
    if isinstance(sharding, NamedSharding):
        mesh_json = _mesh_json(sharding.mesh)
        if mesh_json not in meshes:
            meshes.append(copy.deepcopy(mesh_json))
        return {
            "type": "named",
            "mesh": meshes.index(mesh_json),
            "spec": spec_to_json(sharding.spec),
        }
    if isinstance(sharding, SingleDeviceSharding):
        device: jax.Device
        (device,) = sharding.device_set
        return {"type": "single_device", "device_id": device.id}
    return {"type": "other", "repr": repr(sharding)}


# --- ownership: who writes which shard ----------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a sharding splits an array of one shape, worked out once (see ``layout``).

    owners: each distinct shard index -> the device that writes it (one replica only; every
        process computes the same answer from global information, so together they write
        each shard exactly once whatever the replication).
    chunks: the largest shard extent per dimension, so chunks follow the saved shards.
    owned: this process's devices that own a shard -> that index.
    held_at: every distinct index this process holds, once, as (position of its first
        device here among this process's devices in the sharding's order, i.e.
        ``arr.addressable_data(position)``, index).
    indices: every distinct index, sorted.
    """

    owners: dict[Index, Any]
    chunks: tuple[int, ...]
    owned: dict[Any, Index]
    held_at: tuple[tuple[int, Index], ...]
    indices: tuple[Index, ...]


@functools.lru_cache(maxsize=4096)
def layout(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> Layout:
    """The ``Layout`` of ``shape`` under ``sharding``, cached: saves call this for every
    leaf, and a state has hundreds of leaves on a few shardings (the returned dicts are
    shared: read them, never change them)."""
    me = jax.process_index()
    owners: dict[Index, Any] = {}
    held: dict[Index, int] = {}  # index -> position of its first device here
    position = 0  # among this process's devices
    device: jax.Device
    for device, slices in sharding.devices_indices_map(shape).items():
        index = from_slices(slices, shape)
        owners.setdefault(index, device)
        if device.process_index == me:
            held.setdefault(index, position)
            position += 1
    extents = [[stop - start for start, stop in index] for index in owners]
    chunks = tuple(max(1, *dim) for dim in zip(*extents, strict=True))  # the largest extents
    owned = {d: i for i, d in owners.items() if d.process_index == me}
    held_at = tuple((p, i) for i, p in held.items())
    return Layout(owners, chunks, owned, held_at, tuple(sorted(owners)))


# --- replica-parallel writes: which process writes which part of a shard ------------------

SPLIT_MIN_BYTES = 1 << 20
"""Shards below this many bytes are written whole by one of their replicas (in turn over
the shards and leaves); larger ones are split among the processes that hold a replica."""


@dataclass(frozen=True)
class WriteSplit:
    """Who writes what of one (sharding, shape): every process computes the same answer.

    chunks: the zarr chunk shape; it divides every shard, so no chunk spans two shards.
    parts: each distinct shard index -> its parts, as (region, group): a region is a
        chunk-aligned box inside the shard; group ``g`` of the ``k``-th shard (in sorted
        order) is written by ``procs[(g + k + salt) % len(procs)]`` (``salt``: the leaf's
        position in the tree).
    procs: each distinct shard index -> the processes holding a replica of it (sorted).
    """

    chunks: tuple[int, ...]
    parts: dict[Index, tuple[tuple[Index, int], ...]]
    procs: dict[Index, tuple[int, ...]]

    def writer(self, index: Index, group: int, salt: int) -> int:
        procs = self.procs[index]
        return procs[(group + self.ordinal[index] + salt) % len(procs)]

    def chunk_writers(self, salt: int) -> Iterator[tuple[tuple[int, ...], int]]:
        """(grid position, writing process) of every chunk of the array."""
        for index, parts in self.parts.items():
            for region, group in parts:
                for coords in chunks_in(region, self.chunks):
                    yield coords, self.writer(index, group, salt)

    @functools.cached_property
    def ordinal(self) -> dict[Index, int]:
        """Each distinct shard's position in sorted order: whole small shards of one leaf
        go to their holders in turn, not all to one."""
        return {index: k for k, index in enumerate(sorted(self.procs))}

    @functools.cached_property
    def period(self) -> int:
        """Salts equal modulo this give the same writers."""
        return math.lcm(*(len(p) for p in self.procs.values()))


def _largest_divisor_at_most(n: int, k: int) -> int:
    return next(d for d in range(min(n, max(1, k)), 0, -1) if n % d == 0)


def chunk_shape(
    shard: tuple[int, ...], itemsize: int, chunk_bytes: int | None, replicas: int
) -> tuple[int, ...]:
    """Chunks for a shard: at most ``chunk_bytes`` (the largest dimension halved first, so
    chunks stay close to cubes) and, for a shard of at least ``SPLIT_MIN_BYTES`` held by
    ``replicas`` processes, at least that many chunks along its largest dimension. Every
    extent divides the shard's, so chunk boundaries fall on shard boundaries."""
    c = [max(1, d) for d in shard]
    if chunk_bytes:
        tried: set[int] = set()
        while math.prod(c) * itemsize > chunk_bytes and len(tried) < len(c):
            dim = max((d for d in range(len(c)) if d not in tried), key=lambda d: c[d])
            smaller = _largest_divisor_at_most(shard[dim], c[dim] // 2)
            if 2 * smaller < c[dim] // 2 or smaller == c[dim]:  # no divisor near a half
                tried.add(dim)
                continue
            c[dim] = smaller
    if replicas > 1 and shard and math.prod(shard) * itemsize >= SPLIT_MIN_BYTES:
        dim = max(range(len(shard)), key=lambda d: shard[d])
        want = -(-shard[dim] // replicas)
        if c[dim] > want:
            c[dim] = _largest_divisor_at_most(shard[dim], want)
    return tuple(c)


def _groups(index: Index, chunks: tuple[int, ...], count: int) -> tuple[tuple[Index, int], ...]:
    """``index`` cut into at most ``count`` chunk-aligned slabs along the dimension with the
    most chunks; slab ``g`` is group ``g``."""
    if count <= 1 or not index:
        return ((index, 0),)
    n = [-(-(b - a) // c) for (a, b), c in zip(index, chunks, strict=True)]
    dim = max(range(len(n)), key=lambda d: n[d])
    start, stop = index[dim]
    k = min(count, n[dim])
    cuts = [start + (n[dim] * g // k) * chunks[dim] for g in range(k)] + [stop]  # slab bounds
    return tuple((index[:dim] + ((cuts[g], cuts[g + 1]),) + index[dim + 1 :], g) for g in range(k))


@functools.lru_cache(maxsize=4096)
def write_split(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...], itemsize: int, chunk_bytes: int | None
) -> WriteSplit:
    """The ``WriteSplit`` of ``shape`` under ``sharding`` (cached, like ``layout``)."""
    procs = holders(sharding, shape)
    replicas = max((len(p) for p in procs.values()), default=1)
    chunks = chunk_shape(layout(sharding, shape).chunks, itemsize, chunk_bytes, replicas)
    return _split(procs, shape, chunks, itemsize)


def holders(
    sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> dict[Index, tuple[int, ...]]:
    """Each distinct shard index of ``shape`` under ``sharding`` -> the processes holding it."""
    devices: Mapping[jax.Device, tuple[slice, ...]] = sharding.devices_indices_map(shape)
    return _holders((from_slices(index, shape), d.process_index) for d, index in devices.items())


def _holders(held: Iterable[tuple[Index, int]]) -> dict[Index, tuple[int, ...]]:
    out: dict[Index, set[int]] = {}
    for index, process in held:
        out.setdefault(index, set()).add(process)
    return {i: tuple(sorted(p)) for i, p in out.items()}


def _split(
    procs: dict[Index, tuple[int, ...]],
    shape: tuple[int, ...],
    chunks: tuple[int, ...],
    itemsize: int,
) -> WriteSplit:
    sizes = [max((b - a for a, b in (i[d] for i in procs)), default=1) for d in range(len(shape))]
    split = bool(shape) and math.prod(sizes) * itemsize >= SPLIT_MIN_BYTES
    parts = {i: _groups(i, chunks, len(p) if split else 1) for i, p in procs.items()}
    return WriteSplit(tuple(chunks), parts, procs)


def named_indices(
    spec_json: list, mesh_json: dict, shape: tuple[int, ...]
) -> list[tuple[Index, int]]:
    """(index, process) of every device of a saved NamedSharding, from the manifest alone
    (the split of each dimension over its mesh axes, major to minor, as jax makes it)."""
    names, sizes = list(mesh_json["axis_names"]), list(mesh_json["shape"])
    procs = np.asarray(mesh_json["process_indices"]).reshape(sizes)
    spec = list(spec_from_json(spec_json)) + [None] * (len(shape) - len(spec_json))
    out = []
    for coords in itertools.product(*(range(s) for s in sizes)):
        index = []
        for dim, entry in zip(shape, spec, strict=True):
            block, count = 0, 1
            for axis in entry_axes(entry):
                k = sizes[names.index(axis)]
                block, count = block * k + coords[names.index(axis)], count * k
            extent = -(-dim // count)
            index.append((min(block * extent, dim), min((block + 1) * extent, dim)))
        out.append((tuple(index), int(procs[coords])))
    return out


def saved_writers(record: LeafRecord, meshes: list[dict]) -> dict[tuple[int, ...], int]:
    """Chunk grid position -> the process that wrote it, for a leaf saved without a
    ``chunk_writers`` list (format 1.3: named shardings, see ``write_split``)."""
    sharding = record.sharding or {}
    if record.chunk_writers is not None or sharding.get("type") != "named":
        return {tuple(c): p for c, p in record.chunk_writers or []}
    shape = tuple(record.shape)
    itemsize = record.nbytes // max(1, math.prod(shape))
    held = named_indices(sharding["spec"], meshes[sharding["mesh"]], shape)
    if record.chunk_shape is None:  # a checked manifest gives every array leaf one
        raise TypeError(f"leaf {record.name!r} has a named sharding but no chunk_shape")
    split = _split(_holders(held), shape, tuple(record.chunk_shape), itemsize)
    return dict(split.chunk_writers(record.writer_salt or 0))


# --- binding saved shardings to current devices -------------------------------------------


def mesh_by_position(mesh_json: dict) -> Mesh | None:
    """Rebuilds a saved mesh over the current devices, or None when the count differs."""
    shape = tuple(mesh_json["shape"])
    names = tuple(mesh_json["axis_names"])
    if math.prod(shape) != jax.device_count():
        return None
    types = mesh_json.get("axis_types")
    axis_types = tuple(getattr(AxisType, t) for t in types) if types else None
    return jax.make_mesh(shape, names, axis_types=axis_types, devices=jax.devices())


def bind_spec(spec_json: list, mesh: Mesh, *, leaf: str, shape: tuple[int, ...]) -> NamedSharding:
    """Binds a saved PartitionSpec to ``mesh`` (same axis names, sizes may differ)."""
    spec = spec_from_json(spec_json)
    missing = [n for e in spec for n in entry_axes(e) if n not in mesh.axis_names]
    if missing:
        raise ShardingError(
            f"leaf {leaf!r} was saved with PartitionSpec {spec} but the mesh has axes "
            f"{tuple(mesh.axis_names)} (missing {missing}); pass a mesh with those axis "
            "names, or a restore target with explicit shardings"
        )
    if len(spec) > len(shape):
        raise ShardingError(
            f"leaf {leaf!r}: PartitionSpec {spec} has more entries than shape {shape} has "
            "dimensions; give a restore target with a sharding that fits the shape"
        )
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        parts = math.prod(mesh.shape[n] for n in axes)
        if shape[dim] % parts:
            raise ShardingError(
                f"leaf {leaf!r}: dimension {dim} of shape {shape} does not split into {parts} "
                f"parts over mesh axes {axes} of mesh {dict(mesh.shape)}; give a restore "
                "target with a sharding that divides it"
            )
    return NamedSharding(mesh, spec)
