"""Properties (issue 19, exact bytes on every path): random pytrees of every dtype, filled
with hostile bit patterns, saved on one layout and restored onto another, come back with the
same bytes.

Single process, 8 virtual CPU devices. Hypothesis draws the tree (dicts, lists, tuples, a
namedtuple, a dataclass; odd keys), each leaf's kind (sharded ``jax.Array``, single-device
array, typed PRNG key, NumPy array in odd memory layouts, NumPy scalar, Python scalar), its
dtype and shape, the save mesh (1-d to 3-d, permuted devices, 4- and 2-device submeshes) and
PartitionSpecs that fit each shape, and the restore: a target with other shardings, another
``mesh=``, or nothing (saved mesh rebuilt, or NumPy). ``chunk_bytes``, ``read_budget_bytes``
and zstd are drawn too; ``jaxckpt.metadata`` must describe what was saved, and ``jaxckpt
verify`` find nothing wrong. The same trees go
through a ``CheckpointManager`` (sync, async, ``stage`` handles; NumPy leaves overwritten and
device arrays deleted or donated once ``save`` returned; per-process values) and the
emergency manager's local tier. Examples per property (``@pytest.mark.property``) come from
the hypothesis profile (conftest: "ci" here, "fuzz" under bench/fuzz.py). The plain tests at
the end pin bugs the properties found (fixed since).

64-bit dtypes: the suite never enables ``jax_enable_x64`` (a device array of int64 would be
int32), so they are drawn for NumPy leaves only: NumPy arrays, NumPy scalars and NumPy
targets, and per-process values.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import struct
from collections import namedtuple
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hostile import DTYPES, assert_same_bits, random_bits
from hypothesis import event, given
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src import staging
from jaxckpt._src import tree as tree_lib
from jaxckpt._src.cli.verify import verify
from jaxckpt._src.io import layout

DEVICE_DTYPES = [d for d in DTYPES if d.itemsize < 8 or d == np.dtype("complex64")]
"""Dtypes a jax.Array holds without x64 (complex64 is two float32s)."""

AXES = ("a", "b", "c")
MESH_SHAPES = [(8,), (4, 2), (2, 4), (2, 2, 2), (8, 1), (1, 2, 4), (4,), (2, 2), (2,), (1,)]
"""Mesh shapes over the 8 devices or a submesh of them (axes named a, b, c by position)."""
DIMS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16]
MAX_ELEMENTS = 512  # a leaf is at most a few KB
ODD_KEYS = [".", "..", "c", "zarr.json", "manifest.json", "_root", "a b", "ü", "%", "", "0", "a/b"]
ODD_KEYS += ["a\x00b", "\n", "c/0/0", "%2F", "../x"]


NT = namedtuple("NT", ["p", "q"])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pair:
    """A dataclass node (its fields are attributes in the saved paths)."""

    x: Any
    y: Any


# --- strategies ----------------------------------------------------------------------------


@st.composite
def meshes(draw: st.DrawFn, shapes: list[tuple[int, ...]] = MESH_SHAPES) -> Mesh:
    """A mesh of one of ``shapes`` over a random subset and order of the 8 devices, its axes
    Auto or Explicit."""
    shape = draw(st.sampled_from(shapes))
    order = draw(st.permutations(range(8)))
    devices = np.array([jax.devices()[i] for i in order[: math.prod(shape)]]).reshape(shape)
    types = draw(st.sampled_from([AxisType.Auto, AxisType.Auto, AxisType.Explicit]))
    return Mesh(devices, AXES[: len(shape)], axis_types=(types,) * len(shape))


def named(draw: st.DrawFn, mesh: Mesh, spec: P) -> NamedSharding:
    """``NamedSharding(mesh, spec)``, sometimes in pinned host memory."""
    kind = draw(st.sampled_from([None, None, None, "pinned_host"]))
    return NamedSharding(mesh, spec, memory_kind=kind)


@st.composite
def shapes(draw: st.DrawFn, max_ndim: int = 3, max_elements: int = MAX_ELEMENTS) -> tuple:
    """0-d to ``max_ndim``-d, with size-0, size-1, odd and mesh-divisible dimensions."""
    ndim = draw(st.integers(0, max_ndim))
    dims: list[int] = []
    for _ in range(ndim):
        room = max_elements // max(1, math.prod(d for d in dims if d))
        dims.append(draw(st.sampled_from([d for d in DIMS if d <= room])))
    return tuple(dims)


@st.composite
def specs(draw: st.DrawFn, shape: tuple, mesh: Mesh) -> P:
    """A PartitionSpec that fits ``shape`` on ``mesh``: each mesh axis used at most once,
    each dimension divisible by the product of its axes; names or tuples of names."""
    free = list(mesh.axis_names)
    entries: list = []
    for dim in shape:
        picked = draw(st.permutations(free))[: draw(st.integers(0, len(free)))]
        axes: list[str] = []
        for a in picked:
            if dim % (math.prod(mesh.shape[x] for x in axes) * mesh.shape[a]) == 0:
                axes.append(a)
        for a in axes:
            free.remove(a)
        if not axes:
            entries.append(None)
        elif len(axes) == 1 and draw(st.booleans()):
            entries.append(axes[0])
        else:
            entries.append(tuple(axes))
    while entries and entries[-1] is None and draw(st.booleans()):
        entries.pop()
    return P(*entries)


def seeds() -> st.SearchStrategy[int]:
    return st.integers(0, 2**32 - 1)


@st.composite
def python_scalars(draw: st.DrawFn) -> Any:
    """int (also beyond 64 bits), float (any 64 bits: NaNs with a sign and payloads too),
    bool, str, None."""
    return draw(
        st.one_of(
            st.integers(-(2**80), 2**80),
            st.floats(),
            st.integers(0, 2**64 - 1).map(lambda b: struct.unpack("<d", struct.pack("<Q", b))[0]),
            st.sampled_from([float("nan"), 0.0, -0.0, float("inf"), -float("inf"), 5e-324]),
            st.booleans(),
            st.text(max_size=8),
            st.none(),
        )
    )


@st.composite
def device_leaves(draw: st.DrawFn, mesh: Mesh) -> jax.Array:
    """A jax.Array of hostile bits: sharded on ``mesh`` (random spec) or on one device."""
    dtype = draw(st.sampled_from(DEVICE_DTYPES))
    shape = draw(shapes())
    data = random_bits(shape, dtype, np.random.default_rng(draw(seeds())))
    if draw(st.integers(0, 5)) == 0:
        sharding: Any = SingleDeviceSharding(jax.devices()[draw(st.integers(0, 7))])
    else:
        sharding = named(draw, mesh, draw(specs(shape, mesh)))
    out = jax.device_put(data, sharding)
    assert_same_bits(data, np.asarray(out), "jax.device_put itself")  # not jaxckpt's doing
    return out


@st.composite
def key_leaves(draw: st.DrawFn, mesh: Mesh) -> jax.Array:
    """A typed PRNG key array (threefry, rbg, unsafe_rbg) with random key data, sharded on
    ``mesh``."""
    shape = draw(shapes(max_ndim=2, max_elements=32))
    impl, width = draw(st.sampled_from([("threefry2x32", 2), ("rbg", 4), ("unsafe_rbg", 4)]))
    data = random_bits((*shape, width), np.uint32, np.random.default_rng(draw(seeds())))
    keys = jax.random.wrap_key_data(data, impl=impl)
    return jax.device_put(keys, NamedSharding(mesh, draw(specs(shape, mesh))))


@st.composite
def numpy_leaves(draw: st.DrawFn) -> np.ndarray | np.generic:
    """A NumPy array of any dtype (64-bit ones too) in C, Fortran, strided or big-endian
    layout, or a NumPy scalar."""
    dtype = draw(st.sampled_from(DTYPES))
    rng = np.random.default_rng(draw(seeds()))
    if draw(st.integers(0, 4)) == 0:
        return random_bits((), dtype, rng)[()]
    shape = draw(shapes())
    data = random_bits(shape, dtype, rng)
    layout = draw(st.sampled_from(["C", "F", "strided", "big-endian"]))
    if layout == "F":
        return np.asfortranarray(data)
    if layout == "strided" and data.ndim:
        wide = random_bits((*shape[:-1], 2 * shape[-1]), dtype, rng)
        wide[..., ::2] = data
        return wide[..., ::2]
    if layout == "big-endian" and dtype.kind in "iufc" and dtype.itemsize > 1:
        return data.astype(dtype.newbyteorder(">"))
    return data


@st.composite
def leaves(draw: st.DrawFn, mesh: Mesh) -> Any:
    kind = draw(st.sampled_from(["device", "device", "device", "numpy", "numpy", "python", "key"]))
    if kind == "device":
        return draw(device_leaves(mesh))
    if kind == "key":
        return draw(key_leaves(mesh))
    if kind == "numpy":
        return draw(numpy_leaves())
    return draw(python_scalars())


def keys() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ODD_KEYS), st.text(min_size=1, max_size=6))


def trees(mesh: Mesh, max_leaves: int = 10) -> st.SearchStrategy:
    """Nested dicts, lists, tuples, namedtuples and dataclasses of ``leaves(mesh)``, empty
    ones, and one leaf or subtree at two paths."""
    return st.recursive(
        leaves(mesh),
        lambda inner: st.one_of(
            st.dictionaries(keys(), inner, min_size=1, max_size=4),
            st.dictionaries(st.integers(-2, 300), inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3).map(tuple),
            st.builds(NT, inner, inner),
            st.builds(Pair, inner, inner),
            inner.map(lambda x: [x, x]),  # one object at two paths
            st.sampled_from([{}, [], ()]),
        ),
        max_leaves=max_leaves,
    )


# --- what must come back -------------------------------------------------------------------


def flat(tree: Any) -> dict[str, Any]:
    """``{leaf name: leaf}``: saved trees and restored dicts/lists compare by name."""
    return {tree_lib.path_name(p): leaf for p, leaf in tree_lib.flatten(tree)}


def in_order(saved: dict[str, Any], restored: Any) -> dict[str, Any]:
    """The leaves of a tree restored without a target under the saved names, matched in
    flatten order: dicts and lists come back for every node, and a list that held an empty
    container comes back without it (``[{}, x]`` as ``[x]``), so names may shift."""
    got = tree_lib.leaves(restored)
    assert len(got) == len(saved), f"{len(got)} leaves restored, {len(saved)} saved"
    return dict(zip(saved, got, strict=True))


def nested(items: list[tuple[list, Any]]) -> dict:
    """Nested dicts holding each leaf at its path's keys (as strings): the same leaf names
    as the tree the paths come from."""
    root: dict = {}
    for path, leaf in items:
        node = root
        for _, key in path[:-1]:
            node = node.setdefault(str(key), {})
        node[str(path[-1][1])] = leaf
    return root


def unflatten(tree: Any, leaves: dict[str, Any]) -> Any:
    """``tree``'s structure with ``leaves`` (in flatten order) in it."""
    return tree_lib.unflatten_like(tree, list(leaves.values()))


def kind_of(leaf: Any) -> str:
    """What a leaf is, for hypothesis' statistics."""
    if is_key(leaf):
        return "PRNG key"
    if isinstance(leaf, jax.Array):
        return "jax.Array on one device" if len(leaf.sharding.device_set) == 1 else "jax.Array"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "NumPy scalar" if isinstance(leaf, np.generic) else "NumPy array"
    return "Python"


def is_python(x: Any) -> bool:
    return type(x) in (int, float, bool, str, type(None))


def is_key(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def host_bits(leaf: Any) -> np.ndarray:
    """A leaf's data as a native-order NumPy array (key data for PRNG keys)."""
    if is_key(leaf):
        leaf = jax.random.key_data(leaf)
    arr = np.asarray(leaf)
    return arr.astype(arr.dtype.newbyteorder("=")) if not arr.dtype.isnative else arr


def float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def check_leaf(name: str, saved: Any, got: Any, *, sharding: Any = None) -> None:
    """``got`` holds exactly ``saved``'s bits; a jax.Array is checked shard by shard (every
    replica), and against ``sharding`` when one was asked for."""
    if is_python(saved):
        assert type(got) is type(saved), f"{name}: {type(got)} for {type(saved)}"
        if isinstance(saved, float):
            assert float_bits(got) == float_bits(saved), f"{name}: {got!r} for {saved!r}"
        else:
            assert got == saved, f"{name}: {got!r} for {saved!r}"
        return
    if isinstance(saved, np.generic) and not isinstance(got, jax.Array):
        assert isinstance(got, np.generic), f"{name}: {type(got)} for a NumPy scalar"
    if is_key(saved):
        assert is_key(got), f"{name}: {type(got)} for a PRNG key"
        assert jax.random.key_impl(got) == jax.random.key_impl(saved)
    expected = host_bits(saved)
    assert_same_bits(expected, host_bits(got), name)
    if isinstance(got, jax.Array):
        data = jax.random.key_data(got) if is_key(got) else got
        for shard in data.addressable_shards:
            assert_same_bits(expected[shard.index], np.asarray(shard.data), f"{name} {shard}")
        if sharding is not None:
            assert got.sharding.is_equivalent_to(sharding, got.ndim), (
                f"{name}: {got.sharding} for {sharding}"
            )


def normalized(spec: P) -> tuple:
    """A PartitionSpec as a tuple of axis tuples without trailing unsharded entries."""
    out = [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]
    while out and not out[-1]:
        out.pop()
    return tuple(out)


def check_metadata(path: Any, saved: dict[str, Any]) -> None:
    """``jaxckpt.metadata`` agrees with what was saved: kind, shape, dtype, bytes, mesh, spec
    (and a Python leaf's value)."""
    infos = in_order(saved, jaxckpt.metadata(path))
    for name, leaf in saved.items():
        info = infos[name]
        if is_python(leaf):
            assert info.kind == "python", name
            check_leaf(f"{name} (metadata)", leaf, info.value)
            continue
        data = host_bits(leaf)
        assert info.shape == data.shape, f"{name}: {info.shape} for {data.shape}"
        assert info.nbytes == data.nbytes, f"{name}: {info.nbytes} bytes for {data.nbytes}"
        if is_key(leaf):
            assert (info.kind, info.dtype) == ("prng_key", str(leaf.dtype)), name
        else:
            want = "array" if isinstance(leaf, jax.Array) else "numpy"
            assert (info.kind, info.dtype) == (want, data.dtype), f"{name}: {info}"
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            assert info.mesh_axes == tuple(sharding.mesh.axis_names), name
            assert info.mesh_shape == tuple(sharding.mesh.devices.shape), name
            assert normalized(info.spec) == normalized(sharding.spec), f"{name}: {info.spec}"
        else:
            assert info.spec is None, f"{name}: {info.spec}"


# --- restore choices -----------------------------------------------------------------------


def mesh_fits(saved: dict[str, Any], mesh: Mesh) -> bool:
    """Every saved NamedSharding's spec binds to ``mesh`` (names present, sizes divide)."""
    for leaf in saved.values():
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
            shape = leaf.shape
            for dim, axes in zip(shape, normalized(leaf.sharding.spec), strict=False):
                if any(a not in mesh.axis_names for a in axes):
                    return False
                if dim % math.prod(mesh.shape[a] for a in axes):
                    return False
    return True


@st.composite
def target_leaves(
    draw: st.DrawFn, leaf: Any, mesh: Mesh, bound: Mesh | None = None
) -> tuple[Any, Any]:
    """A restore-target leaf for ``leaf`` and the sharding the result must have (None for
    NumPy or Python results). ``bound``: the restore's ``mesh=``, which a ShapeDtypeStruct
    without a sharding takes with the saved spec (without one, it means NumPy)."""
    if is_python(leaf):
        return leaf, None
    if is_key(leaf):
        s = NamedSharding(mesh, draw(specs(leaf.shape, mesh)))
        return (leaf, leaf.sharding) if draw(st.booleans()) else (s, s)
    arr = host_bits(leaf)
    if arr.dtype not in DEVICE_DTYPES or draw(st.integers(0, 3)) == 0:
        dtype = arr.dtype
        if dtype.kind in "iufc" and dtype.itemsize > 1 and draw(st.booleans()):
            dtype = dtype.newbyteorder(">")  # the same values, big-endian
        return np.zeros(arr.shape, dtype), None
    how = draw(st.sampled_from(["struct", "struct", "sharding", "array", "bare"]))
    if how == "bare":
        bare = jax.ShapeDtypeStruct(arr.shape, arr.dtype)
        return bare, None if bound is None else saved_sharding(leaf, bound)
    if draw(st.integers(0, 5)) == 0:
        s: Any = SingleDeviceSharding(jax.devices()[draw(st.integers(0, 7))])
    else:
        s = named(draw, mesh, draw(specs(arr.shape, mesh)))
    if how == "struct":
        return jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=s), s
    if how == "sharding":
        return s, s
    return jax.device_put(np.zeros(arr.shape, arr.dtype), s), s


def saved_sharding(leaf: Any, mesh: Mesh | None) -> Any:
    """The sharding a leaf restored without a target comes back with (None: not checked)."""
    if not isinstance(leaf, jax.Array):
        return None
    if isinstance(leaf.sharding, SingleDeviceSharding):
        return SingleDeviceSharding(jax.local_devices()[0])
    if mesh is None:
        return None
    spec = leaf.sharding.spec
    return NamedSharding(mesh, P(*spec[: leaf.ndim]))


@contextlib.contextmanager
def through_pinned_memory(on: bool):
    """Saves that read device parts through pinned host memory, as they do an accelerator's
    (CPU devices have such memory too): a stage's batched copy, a synchronous save's runs
    of small pieces in one batched copy (``staging.to_host_all``)."""
    real = staging._via_pinned
    if on:
        staging._via_pinned = lambda data: True
    try:
        yield
    finally:
        staging._via_pinned = real


# --- properties ----------------------------------------------------------------------------


@contextlib.contextmanager
def mapping_any_chunk(on: bool):
    """Saves that start every chunk on a 64-byte boundary and restores that map every whole
    aligned chunk onto CPU devices, whatever its size (``mapped``; 256 KiB or more
    otherwise, more than these trees hold)."""
    real = layout.SMALL_CHUNK_BYTES, layout.SMALL_CHUNK_BYTES
    if on:
        layout.SMALL_CHUNK_BYTES = layout.SMALL_CHUNK_BYTES = 1
    try:
        yield
    finally:
        layout.SMALL_CHUNK_BYTES, layout.SMALL_CHUNK_BYTES = real


@pytest.mark.property
@given(data=st.data())
def test_any_tree_restores_bit_exactly_onto_any_layout(data: st.DataObject, tmp_path_factory):
    """save(tree) on one mesh, restore onto another: same bytes in every leaf and replica;
    in about half the cases every whole chunk a restore onto CPU devices takes is mapped."""
    mapping = data.draw(st.booleans(), "chunks of any size mapped")
    event(f"chunks of any size mapped: {mapping}")
    with mapping_any_chunk(mapping):
        _any_tree(data, tmp_path_factory)


def _any_tree(data: st.DataObject, tmp_path_factory) -> None:
    mesh = data.draw(meshes(), "save mesh")
    tree = data.draw(trees(mesh), "tree")
    chunk_bytes = data.draw(st.sampled_from([None, None, 1, 7, 64, 300]), "chunk_bytes")
    budget = data.draw(st.sampled_from([None, None, 1, 100, 4096]), "read_budget_bytes")
    compression = data.draw(st.sampled_from([None, "zstd", "blosc"]), "compression")
    staged = data.draw(st.booleans(), "staged")
    pinned = data.draw(st.booleans(), "device parts through pinned memory")
    path = tmp_path_factory.mktemp("ckpt") / "c"
    saved = snapshot(tree)
    source = tree
    with through_pinned_memory(pinned):
        if staged:
            source = jaxckpt.stage(tree, compression=compression, chunk_bytes=chunk_bytes)
            mutate_numpy_leaves(tree, np.random.default_rng(0))  # the handle holds its own
        jaxckpt.save(path, source, chunk_bytes=chunk_bytes, compression=compression)
    event(f"through pinned memory: {pinned}")
    event(f"leaves: {min(len(saved), 4)}{'+' * (len(saved) >= 4)}")
    for leaf in saved.values():
        event(f"leaf: {kind_of(leaf)}")
    check_metadata(path, saved)
    report = verify(path)  # every chunk read, every CRC checked: no false alarm
    assert report.ok, report.problems
    assert report.bytes == sum(host_bits(v).nbytes for v in saved.values() if not is_python(v))

    how = data.draw(st.sampled_from(["target", "mesh", "saved"]), "restore")
    event(f"restore: {how}")
    if how == "target":
        other = data.draw(meshes(), "restore mesh")
        bound = other if mesh_fits(saved, other) and data.draw(st.booleans(), "mesh=") else None
        drawn = {n: data.draw(target_leaves(v, other, bound), n) for n, v in saved.items()}
        target = tree_lib.unflatten_like(tree, [t for t, _ in drawn.values()])
        paths = [p for p, _ in tree_lib.flatten(tree)]
        if len(paths) > 1 and all(paths) and data.draw(st.booleans(), "fewer leaves"):
            # a target of nested dicts naming some of the saved leaves (names are the keys)
            names = data.draw(st.lists(st.sampled_from(list(saved)), min_size=1, unique=True))
            target = nested(
                [(p, drawn[n][0]) for p, n in zip(paths, saved, strict=True) if n in names]
            )
        out = jaxckpt.restore(path, target=target, mesh=bound, read_budget_bytes=budget)
        assert jax.tree_util.tree_structure(out, is_leaf=lambda x: x is None) == (
            jax.tree_util.tree_structure(target, is_leaf=lambda x: x is None)
        )
        got = flat(out)
        event("target: " + ("fewer leaves" if len(got) < len(saved) else "every leaf"))
        for name, value in got.items():
            check_leaf(name, saved[name], value, sharding=drawn[name][1])
        return
    if how == "mesh":
        order = data.draw(st.permutations(range(8)), "restore devices")
        devices = [jax.devices()[i] for i in order]
        fits = [
            m
            for shape in MESH_SHAPES
            if mesh_fits(
                saved,
                m := Mesh(np.array(devices[: math.prod(shape)]).reshape(shape), AXES[: len(shape)]),
            )
        ]
        other = data.draw(st.sampled_from(fits), "restore mesh")
        got = in_order(saved, jaxckpt.restore(path, mesh=other, read_budget_bytes=budget))
        for name, leaf in saved.items():
            check_leaf(name, leaf, got[name], sharding=saved_sharding(leaf, other))
        return
    got = in_order(saved, jaxckpt.restore(path, read_budget_bytes=budget))
    for name, leaf in saved.items():
        if isinstance(leaf, jax.Array) and isinstance(leaf.sharding, NamedSharding):
            rebuilt = leaf.sharding.mesh.size == jax.device_count()
            assert isinstance(got[name], jax.Array) == (rebuilt or is_key(leaf)), name
            if rebuilt:
                assert normalized(got[name].sharding.spec) == normalized(leaf.sharding.spec)
        check_leaf(name, leaf, got[name], sharding=saved_sharding(leaf, None))


@st.composite
def per_process_values(draw: st.DrawFn) -> Any:
    """A per-process value: None, bytes, JSON, or a dict of NumPy arrays of hostile bits
    (the dtypes it takes: bool, integers, floats, complex; 64-bit and big-endian too)."""
    kind = draw(st.sampled_from(["none", "bytes", "json", "numpy"]))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "json":
        scalars = st.one_of(st.integers(-(2**70), 2**70), st.floats(allow_nan=False), st.text())
        return draw(
            st.recursive(
                st.one_of(scalars, st.booleans(), st.none()),
                lambda inner: st.one_of(
                    st.lists(inner, max_size=3), st.dictionaries(st.text(), inner, max_size=3)
                ),
                max_leaves=6,
            )
        )
    if kind == "numpy":
        rng = np.random.default_rng(draw(seeds()))
        dtypes = [d for d in DTYPES if d.type.__module__ == "numpy"]  # ml_dtypes: refused
        out = {}
        for key in draw(st.lists(keys(), min_size=1, max_size=3, unique=True)):
            arr = random_bits(draw(shapes(max_elements=64)), draw(st.sampled_from(dtypes)), rng)
            big = arr.dtype.itemsize > 1 and arr.dtype.kind != "b" and draw(st.booleans())
            out[key] = arr.astype(arr.dtype.newbyteorder(">")) if big else arr
        return out
    return None


def check_per_process(saved: Any, got: Any) -> None:
    if isinstance(saved, dict) and saved and all(isinstance(v, np.ndarray) for v in saved.values()):
        assert isinstance(got, dict) and set(got) == set(saved), (got, saved)
        for k, v in saved.items():
            assert_same_bits(host_bits(v), got[k], f"per_process[{k!r}]")
    elif isinstance(saved, bytes):
        assert got == saved
    else:
        assert json.dumps(got) == json.dumps(saved), (got, saved)


def mutate_numpy_leaves(tree: Any, rng: np.random.Generator) -> None:
    """Overwrites every writable NumPy array leaf of ``tree`` in place with other bits."""
    for leaf in tree_lib.leaves(tree):
        if isinstance(leaf, np.ndarray) and leaf.flags.writeable and leaf.size:
            leaf[...] = random_bits(leaf.shape, leaf.dtype, rng)


def snapshot(tree: Any) -> dict[str, Any]:
    """The saved-leaves map of ``tree`` with its NumPy and device arrays copied (the tree's
    own may be changed, deleted or donated once saved)."""

    def copied(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, jax.Array) and not is_key(v):
            return jax.device_put(np.array(v), v.sharding)
        return v

    return {n: copied(v) for n, v in flat(tree).items()}


def let_go(tree: Any, how: str, rng: np.random.Generator) -> None:
    """What a training loop does to the state it just saved: NumPy leaves overwritten in
    place, and device arrays kept, deleted, or donated to a computation."""
    mutate_numpy_leaves(tree, rng)
    seen: set[int] = set()
    for leaf in tree_lib.leaves(tree):
        if not isinstance(leaf, jax.Array) or is_key(leaf) or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        if how == "delete":
            leaf.delete()
        elif how == "donate" and leaf.dtype != np.dtype("uint1"):  # jit can't lower uint1
            s = leaf.sharding
            with jax.set_mesh(s.mesh) if isinstance(s, NamedSharding) else contextlib.nullcontext():
                jax.block_until_ready(_overwrite(leaf))


@functools.partial(jax.jit, donate_argnums=0)
def _overwrite(x: jax.Array) -> jax.Array:
    return jnp.zeros_like(x)


@pytest.mark.property
@given(data=st.data())
def test_manager_saves_and_restores_the_latest_step_bit_exactly(
    data: st.DataObject, tmp_path_factory
):
    """CheckpointManager, sync or async, of a tree or a ``stage`` handle: each step's tree
    and per-process value come back bit-exactly, also when, once ``save`` returned, its NumPy
    leaves were overwritten and its device arrays deleted or donated; the newest step is the
    latest, and a new manager over the directory finds the kept steps."""
    mesh = data.draw(meshes(), "mesh")
    opts = jaxckpt.Options(
        async_save=data.draw(st.booleans(), "async_save"),
        max_to_keep=2,
        chunk_bytes=data.draw(st.sampled_from([None, 1, 64]), "chunk_bytes"),
        read_budget_bytes=data.draw(st.sampled_from([None, 1, 1000]), "read_budget_bytes"),
        compression=data.draw(st.sampled_from([None, "zstd", "blosc"]), "compression"),
        staging_budget_bytes=data.draw(st.sampled_from([None, None, 1]), "staging_budget_bytes"),
    )
    event(f"async_save: {opts.async_save}")
    directory = tmp_path_factory.mktemp("run")
    rng = np.random.default_rng(data.draw(seeds(), "seed"))
    steps = sorted(data.draw(st.sets(st.integers(0, 10**9), min_size=1, max_size=3), "steps"))
    saved: dict[int, tuple[dict[str, Any], Any, Any]] = {}
    with jaxckpt.CheckpointManager(directory, opts) as mgr:
        for step in steps:
            tree = data.draw(trees(mesh, max_leaves=4), f"tree of step {step}")
            value = data.draw(per_process_values(), f"per_process of step {step}")
            expected = snapshot(tree)
            saved[step] = (expected, copy.deepcopy(value), unflatten(tree, expected))
            source = tree
            if data.draw(st.booleans(), "staged"):
                source = jaxckpt.stage(
                    tree, compression=opts.compression, chunk_bytes=opts.chunk_bytes
                )
            assert mgr.save(step, source, per_process=value, metrics={"step": float(step)})
            how = data.draw(st.sampled_from(["keep", "delete", "donate"]), "after save")
            event(f"after save: {how}")
            let_go(tree, how, rng)  # the save owns its host copy by now
            if isinstance(value, dict):
                mutate_numpy_leaves(value, rng)
        mgr.wait_until_finished()  # latest_step: the newest committed step
        assert mgr.latest_step() == steps[-1]
        expected, value, tree = saved[steps[-1]]
        restored = in_order(expected, mgr.restore())
        for name, leaf in expected.items():
            check_leaf(name, leaf, restored[name])
        check_per_process(value, mgr.per_process())
        check_metadata(mgr.step_path(steps[-1]).url, expected)
    with jaxckpt.CheckpointManager(directory, opts) as mgr:
        assert mgr.all_steps() == steps[-2:]
        for step in mgr.all_steps():
            expected, value, tree = saved[step]
            out = flat(mgr.restore(step, target=unflatten(tree, expected)))  # saved shardings
            for name, leaf in expected.items():
                check_leaf(name, leaf, out[name], sharding=getattr(leaf, "sharding", None))
            check_per_process(value, mgr.per_process(step))


@pytest.mark.property
@given(data=st.data())
def test_emergency_local_tier_restores_bit_exactly(data: st.DataObject, tmp_path_factory):
    """EmergencyCheckpointManager, one process: the newest local step comes back
    bit-exactly without a target, onto another mesh, or onto a target's shardings; in about
    half the cases every whole chunk it keeps for CPU devices is mapped."""
    mapping = data.draw(st.booleans(), "chunks of any size mapped")
    event(f"chunks of any size mapped: {mapping}")
    with mapping_any_chunk(mapping):
        _emergency_local(data, tmp_path_factory)


def _emergency_local(data: st.DataObject, tmp_path_factory) -> None:
    mesh = data.draw(meshes(), "mesh")
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1,
        remote=jaxckpt.Options(save_interval_steps=10**9),
        async_save=data.draw(st.booleans(), "async_save"),
    )
    root = tmp_path_factory.mktemp("emergency")
    rng = np.random.default_rng(data.draw(seeds(), "seed"))
    with jaxckpt.EmergencyCheckpointManager(root / "local", root / "remote", opts) as mgr:
        for step in (1, 2):
            tree = data.draw(trees(mesh, max_leaves=6), f"tree of step {step}")
            value = data.draw(per_process_values(), f"per_process of step {step}")
            expected = snapshot(tree)
            assert mgr.save(step, tree, per_process=value)
            let_go(tree, "keep", rng)  # NumPy leaves overwritten
        mgr.wait_until_finished()
        how = data.draw(st.sampled_from(["saved", "mesh", "target"]), "restore")
        event(f"restore: {how}")
        if how == "target":
            other = data.draw(meshes(), "restore mesh")
            drawn = {n: data.draw(target_leaves(v, other), n) for n, v in expected.items()}
            out = flat(mgr.restore(target=unflatten(tree, {n: t for n, (t, _) in drawn.items()})))
            for name, leaf in expected.items():
                check_leaf(name, leaf, out[name], sharding=drawn[name][1])
        else:
            other = None
            if how == "mesh":
                fits = [m for m in (data.draw(meshes(), f"mesh {i}") for i in range(4))]
                fits = [m for m in fits if mesh_fits(expected, m)] or [mesh]
                other = fits[0]
            got = in_order(expected, mgr.restore(mesh=other))
            for name, leaf in expected.items():
                check_leaf(name, leaf, got[name], sharding=saved_sharding(leaf, other))
        assert mgr.last_report is not None
        check_per_process(value, mgr.per_process())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_process_arrays_of_every_dtype_come_back_or_are_refused_on_save(dtype, tmp_path):
    """A per-process NumPy array comes back bit-exactly, or ``save`` refuses it before
    writing (float8_e5m2 calls itself kind 'f': it was saved, then unreadable)."""
    value = {"x": random_bits((3,), dtype, np.random.default_rng(0))}
    try:
        jaxckpt.save(tmp_path / "c", {"a": 1}, per_process=value)
    except jaxckpt.errors.UnsupportedLeafError:
        assert not (tmp_path / "c").exists()
        assert dtype.type.__module__.startswith("ml_dtypes"), f"NumPy's {dtype} refused"
        return
    check_per_process(value, jaxckpt.per_process(tmp_path / "c"))


def test_restore_onto_a_pinned_host_target(tmp_path):
    """A target sharding in pinned host memory (host offloading) gets the bytes there."""
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    x = random_bits((8, 4), np.dtype("bfloat16"), np.random.default_rng(0))
    jaxckpt.save(tmp_path / "c", {"x": x})
    s = NamedSharding(mesh, P("a"), memory_kind="pinned_host")
    target = {"x": jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)}
    check_leaf("x", x, jaxckpt.restore(tmp_path / "c", target=target)["x"], sharding=s)


@pytest.mark.parametrize("bits", [0xFFF8000000000000, 0x7FF8000000000001], ids=hex)
def test_python_float_nan_keeps_its_bits(bits: int, tmp_path):
    """A Python float leaf that is a NaN with its sign bit or a payload keeps its bits."""
    x = struct.unpack("<d", struct.pack("<Q", bits))[0]
    jaxckpt.save(tmp_path / "c", {"x": x})
    check_leaf("x", x, jaxckpt.restore(tmp_path / "c")["x"])
