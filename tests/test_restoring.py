"""restore of one checkpoint: targets, other meshes, dtype casts, partial restores, read errors."""

import collections
import itertools
import json
import os
import re
import threading

import flax.struct
import iostats
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import assert_tree_equal, flip_a_chunk_byte, sharded
from flax.training import train_state
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors
from jaxckpt._src.io import linux
from jaxckpt._src.io.direct import Reader

Point = collections.namedtuple("Point", ["x", "y"])


@flax.struct.dataclass
class Pair:
    a: jax.Array
    b: dict


def test_containers_restore_into_their_types(mesh42, tmp_path):
    arr = sharded(np.ones((4, 2), np.float32), mesh42, ("data",))
    tree = {
        "tuple": (arr, 1),
        "list": [arr, [arr]],
        "named": Point(arr, 2.0),
        "struct": Pair(arr, {"c": arr}),
    }
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert isinstance(out["named"], Point) and isinstance(out["struct"], Pair)
    assert isinstance(out["tuple"], tuple)
    assert_tree_equal(out, tree)
    plain = jaxckpt.restore(tmp_path / "c")
    assert set(plain["struct"]) == {"a", "b"} and set(plain["named"]) == {"x", "y"}


def test_single_device_sharding_restore(tmp_path):
    x = jax.device_put(np.arange(4.0), jax.devices()[5])
    jaxckpt.save(tmp_path / "c", {"x": x})
    out = jaxckpt.restore(tmp_path / "c", target={"x": SingleDeviceSharding(jax.devices()[2])})
    assert out["x"].sharding.device_set == {jax.devices()[2]}
    np.testing.assert_array_equal(out["x"], x)


@pytest.mark.parametrize("direct", ["1", "0"])
@pytest.mark.parametrize("rows", [512, 8192])  # slices of 32 KiB; of 512 KiB
def test_restored_replicas_do_not_share_memory(rows, direct, mesh42, tmp_path, monkeypatch):
    """Read buffers become device buffers without a copy, but never two devices' at once;
    shards smaller than a huge page are read into the leaf's one huge-page mapping, by the
    direct path and by TensorStore alike, bytes exact."""
    monkeypatch.setenv("JAXCKPT_DIRECT_READ", direct)
    bits = np.random.default_rng(rows).integers(0, 2**32, (rows, 64), dtype=np.uint32)
    x = sharded(bits.view(np.float32), mesh42, ("data",))  # NaN payloads, -0.0, subnormals
    jaxckpt.save(tmp_path / "c", {"x": x})
    out = jaxckpt.restore(tmp_path / "c", target={"x": x})["x"]
    np.testing.assert_array_equal(np.asarray(out).view(np.uint32), bits)
    spans = sorted((s.data.unsafe_buffer_pointer(), s.data.nbytes) for s in out.addressable_shards)
    assert len({a for a, _ in spans}) == len(spans) == 8
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))
    if rows == 8192 and direct == "0" and os.path.exists("/proc/self/maps"):
        assert len({_mapping_of(a) for a, _ in spans}) == 1
    elif rows == 8192:  # 512 KiB slices: each copy a mapping of its chunk (``mapped``)
        assert all(_file_mapped_at(a).startswith(str(tmp_path)) for a, _ in spans)
    # donating the restored array must not disturb anything else restored
    other = jaxckpt.restore(tmp_path / "c", target={"x": x})["x"]
    jax.jit(lambda a: a * 2, donate_argnums=0)(out).block_until_ready()
    np.testing.assert_array_equal(np.asarray(other).view(np.uint32), bits)


def _file_mapped_at(address: int) -> str:
    """The file mapped at ``address`` ("" for anonymous memory)."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(v, 16) for v in fields[0].split("-"))
            if lo <= address < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    raise AssertionError(f"no mapping holds {address:#x}")


def _mapping_of(address: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            if lo <= address < hi:
                return line.split()[0]
    raise AssertionError(f"no mapping holds {address:#x}")


# --- a Flax TrainState with Optax AdamW onto other meshes ---------------------------------


def _train_state(mesh):
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(16)])
    params = model.init(jax.random.key(0), jnp.ones((1, 32)))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(1e-3))

    def spec(x):
        if x.ndim == 2:
            return NamedSharding(mesh, P("data", "model"))
        if x.ndim == 1 and x.shape[0] % 2 == 0:
            return NamedSharding(mesh, P("model"))
        return NamedSharding(mesh, P())

    state = jax.tree.map(lambda x: jax.device_put(x, spec(x)) if hasattr(x, "ndim") else x, state)
    grads = jax.tree.map(jnp.ones_like, state.params)
    return state.apply_gradients(grads=grads), spec


@pytest.mark.parametrize(
    "shape,names",
    [
        ((2, 4), ("data", "model")),
        ((8, 1), ("data", "model")),
        ((2, 2), ("data", "model")),
        ((1, 1), ("data", "model")),
    ],
)
def test_train_state_restores_onto_other_meshes(shape, names, mesh42, tmp_path):
    state, _ = _train_state(mesh42)
    jaxckpt.save(tmp_path / "c", state)
    n = shape[0] * shape[1]
    new_mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]).reshape(shape), names)
    _, spec = _train_state(new_mesh)
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=spec(x)) if hasattr(x, "ndim") else x
        ),
        state,
    )
    out = jaxckpt.restore(tmp_path / "c", target=target)
    assert_tree_equal(out, state)
    leaf = out.params["params"]["layers_0"]["kernel"]
    assert leaf.sharding.mesh.devices.shape == shape
    assert out.opt_state[0].mu["params"]["layers_0"]["kernel"].sharding.mesh.devices.shape == shape


def test_restore_onto_1d_mesh_and_as_numpy(mesh42, tmp_path):
    state, _ = _train_state(mesh42)
    jaxckpt.save(tmp_path / "c", state)
    mesh8 = jax.make_mesh((8,), ("data",))
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh8, P()))
            if hasattr(x, "ndim")
            else x
        ),
        state,
    )
    assert_tree_equal(jaxckpt.restore(tmp_path / "c", target=target), state)
    as_numpy = jax.tree.map(
        lambda x: np.zeros(x.shape, x.dtype) if hasattr(x, "ndim") else x, state
    )
    out = jaxckpt.restore(tmp_path / "c", target=as_numpy)
    assert isinstance(out.params["params"]["layers_0"]["kernel"], np.ndarray)
    assert_tree_equal(
        out, jax.tree.map(lambda x: np.asarray(x) if hasattr(x, "ndim") else x, state)
    )


def test_restore_without_target_uses_numpy_when_mesh_does_not_fit(mesh42, tmp_path):
    x = sharded(np.arange(32.0, dtype=np.float32).reshape(8, 4), mesh42, ("data", "model"))
    # a checkpoint saved on a mesh bigger than the devices we have now
    jaxckpt.save(tmp_path / "c", {"x": x})
    manifest = json.loads((tmp_path / "c" / "manifest.json").read_text())
    manifest["meshes"][0]["shape"] = [8, 2]  # pretend it was 16 devices
    manifest["meshes"][0]["device_ids"] = np.arange(16).reshape(8, 2).tolist()
    manifest["meshes"][0]["process_indices"] = np.zeros((8, 2), int).tolist()
    manifest["leaves"][0]["chunk_shape"] = [1, 2]  # the shards of an (8, 2) mesh
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(manifest))
    out = jaxckpt.restore(tmp_path / "c")
    assert isinstance(out["x"], np.ndarray)
    np.testing.assert_array_equal(out["x"], np.asarray(x))


def test_mesh_argument_binds_saved_specs(mesh42, tmp_path):
    x = sharded(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh42, ("data", "model"))
    y = sharded(np.arange(8.0, dtype=np.float32), mesh42, ("model",))
    jaxckpt.save(tmp_path / "c", {"x": x, "y": y})
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    out = jaxckpt.restore(tmp_path / "c", mesh=mesh)
    assert out["x"].sharding == NamedSharding(mesh, P("data", "model"))
    assert out["y"].sharding == NamedSharding(mesh, P("model"))
    assert_tree_equal(out, {"x": x, "y": y})
    with pytest.raises(
        errors.ShardingError, match=r"/c: leaf 'x'.*missing \['model'\].*pass a mesh"
    ):
        jaxckpt.restore(tmp_path / "c", mesh=jax.make_mesh((8,), ("data",)))


def test_partial_restore_and_missing_leaf(mesh42, tmp_path):
    tree = {
        "a": sharded(np.ones((4, 4), np.float32), mesh42, ("data",)),
        "b": {"c": 1, "d": np.ones(3)},
    }
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c", target={"b": {"d": np.zeros(3)}})
    assert set(out) == {"b"} and set(out["b"]) == {"d"}
    np.testing.assert_array_equal(out["b"]["d"], np.ones(3))
    with pytest.raises(errors.LeafNotFoundError, match="b/e"):
        jaxckpt.restore(tmp_path / "c", target={"b": {"e": np.zeros(3)}})


def test_dtype_cast_on_restore(mesh42, tmp_path):
    x = sharded(np.linspace(-2, 2, 32, dtype=np.float32).reshape(8, 4), mesh42, ("data",))
    jaxckpt.save(tmp_path / "c", {"x": x})
    target = {"x": jax.ShapeDtypeStruct((8, 4), jnp.bfloat16, sharding=x.sharding)}
    out = jaxckpt.restore(tmp_path / "c", target=target)
    assert out["x"].dtype == jnp.bfloat16
    want = np.asarray(x).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out["x"]), want)
    for shard in out["x"].addressable_shards:  # each replica cast too, in a buffer of its own
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    assert len({s.data.unsafe_buffer_pointer() for s in out["x"].addressable_shards}) == 8


def test_sharding_leaves_as_target(mesh42, tmp_path):
    x = sharded(np.arange(16.0, dtype=np.float32).reshape(4, 4), mesh42, ("data",))
    jaxckpt.save(tmp_path / "c", {"x": x})
    s = NamedSharding(jax.make_mesh((2, 4), ("a", "b")), P("b"))
    out = jaxckpt.restore(tmp_path / "c", target={"x": s})
    assert out["x"].sharding == s
    np.testing.assert_array_equal(out["x"], x)


def test_shape_mismatch(mesh42, tmp_path):
    jaxckpt.save(tmp_path / "c", {"x": np.ones((4, 4))})
    with pytest.raises(errors.ShapeMismatchError, match=r"'x'.*\(4, 4\).*\(4, 5\)"):
        jaxckpt.restore(tmp_path / "c", target={"x": np.zeros((4, 5))})


def test_mesh_fills_in_target_leaves_without_sharding(mesh42, tmp_path):
    x = sharded(np.arange(64.0, dtype=np.float32).reshape(8, 8), mesh42, ("data", "model"))
    jaxckpt.save(tmp_path / "c", {"x": x, "y": np.ones(3)})
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    target = {"x": jax.ShapeDtypeStruct((8, 8), jnp.bfloat16), "y": np.zeros(3)}
    out = jaxckpt.restore(tmp_path / "c", target=target, mesh=mesh)
    assert out["x"].sharding == NamedSharding(mesh, P("data", "model"))
    assert out["x"].dtype == jnp.bfloat16 and isinstance(out["y"], np.ndarray)
    np.testing.assert_array_equal(np.asarray(out["x"]), np.asarray(x).astype(jnp.bfloat16))


# --- errors ----------------------------------------------------------------------------------


def test_missing_and_uncommitted_checkpoints(tmp_path):
    with pytest.raises(errors.CheckpointNotFoundError, match="nothing is there"):
        jaxckpt.restore(tmp_path / "nope")
    jaxckpt.save(tmp_path / "c", {"a": np.ones(2)})
    os.remove(tmp_path / "c" / "COMMITTED")
    with pytest.raises(errors.CheckpointNotFoundError, match="never finished"):
        jaxckpt.restore(tmp_path / "c")


def test_newer_major_format_is_refused(tmp_path):
    jaxckpt.save(tmp_path / "c", {"a": np.ones(2)})
    path = tmp_path / "c" / "manifest.json"
    doc = json.loads(path.read_text())
    doc["format_version"] = [2, 0]
    path.write_text(json.dumps(doc))
    with pytest.raises(errors.FormatVersionError, match="version 2.0"):
        jaxckpt.restore(tmp_path / "c")


def test_corrupted_chunk_is_detected_and_named(mesh42, tmp_path):
    x = sharded(
        np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32), mesh42, ("data",)
    )
    jaxckpt.save(tmp_path / "c", {"layer": {"w": x}})
    flipped, offset = flip_a_chunk_byte(tmp_path / "c")
    with pytest.raises(errors.ChecksumError, match=r"layer/w.*process 0") as e:
        jaxckpt.restore(tmp_path / "c")
    # the data file and the byte range of the chunk, as jaxckpt verify names them
    start, stop = re.search(rf"{re.escape(flipped)} \(bytes (\d+)-(\d+)\)", str(e.value)).groups()
    assert int(start) <= offset <= int(stop), (offset, str(e.value))


def _file_bytes_read() -> int:
    """Bytes this process has read with read syscalls (the OS's rchar, outside jaxckpt):
    TensorStore's reads and the direct path's preadv alike."""
    return iostats.io()["rchar"]


@pytest.mark.parametrize(
    "chunk_bytes, budget, reads",
    [(None, 32 << 20, 1), (None, 16 << 20, 1), (None, 4 << 20, 4), (256 << 10, 4 << 20, 1)],
)
def test_chunk_bytes_bound_what_a_thin_slice_restore_reads(
    chunk_bytes, budget, reads, mesh42, tmp_path, monkeypatch
):
    """Saved as 4 row shards of 4 MiB; restored with each of 8 devices needing 1/8 of every
    shard's columns. Slices that need parts of the same chunks are read in groups, each
    chunk once for all of a group's slices (``slices._groups``, ``scatter``), a group up to
    the read budget: with 32 or 16 MiB, the 8 slices of 2 MiB are one group, each chunk read
    once (with 16 MiB, groups of half the budget read each chunk twice); with 4 MiB, groups
    of two slices each read every chunk whole (a chunk is read whole to check its CRC32C,
    by TensorStore too): 4x, the case ``chunk_bytes`` is for: chunks of 256 KiB are each
    needed by two slices, a group within the budget reads them once again. (Read, not
    mapped: ``JAXCKPT_MAP=0``; a mapping's page faults are no reads a process's ``rchar``
    counts.)"""
    monkeypatch.setenv(linux.MAP, "0")
    x = np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data", None))}, chunk_bytes=chunk_bytes)
    chunks = jaxckpt.metadata(tmp_path / "c")  # the manifest records the chunk shape
    rec = json.loads((tmp_path / "c" / "manifest.json").read_text())["leaves"][0]
    assert chunks["x"].shape == (2048, 2048)
    if chunk_bytes:
        assert np.prod(rec["chunk_shape"]) * 4 <= chunk_bytes
    cols = NamedSharding(jax.make_mesh((8,), ("x",)), P(None, "x"))
    before = _file_bytes_read()
    out = jaxckpt.restore(tmp_path / "c", target={"x": cols}, read_budget_bytes=budget)
    read = _file_bytes_read() - before
    assert np.asarray(out["x"]).tobytes() == x.tobytes()
    ratio = read / x.nbytes
    print(f"chunk_bytes={chunk_bytes} budget={budget}: read {ratio:.2f}x the bytes needed", end=" ")
    assert reads - 0.01 <= ratio <= reads + 0.01, ratio  # (and each chunk's 4-byte CRC)


def test_restore_onto_pinned_host_memory(mesh42, tmp_path):
    """A target in pinned host memory gets its slices there, bytes unchanged."""
    from hostile import assert_same_bits, random_bits

    x = random_bits((8, 8), np.dtype(jnp.bfloat16), np.random.default_rng(0))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data", "model"))})
    s = NamedSharding(mesh42, P("model"), memory_kind="pinned_host")
    out = jaxckpt.restore(
        tmp_path / "c", target={"x": jax.ShapeDtypeStruct((8, 8), x.dtype, sharding=s)}
    )
    assert out["x"].sharding == s
    assert_same_bits(x, np.asarray(out["x"]))


def test_without_a_target_list_elements_keep_their_index(tmp_path):
    """An empty container has no leaves, so no saved path: inside a list it comes back as
    {} and the elements after it keep their indices (and saved names); a dict key with a
    lone surrogate is stored and restored (found by the property suite)."""
    tree = {"l": [{}, np.arange(2.0), (), 3], "\ud800": 1.5}
    jaxckpt.save(tmp_path / "c", tree)
    out = jaxckpt.restore(tmp_path / "c")
    assert out["l"][0] == {} and out["l"][2] == {} and out["l"][3] == 3
    np.testing.assert_array_equal(out["l"][1], np.arange(2.0))
    assert out["\ud800"] == 1.5


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_state_dropped_before_a_restore_gives_its_memory_back_before_the_reads(
    mesh42, tmp_path, monkeypatch
):
    """``del state; state = restore(...)``: the dropped arrays' host memory (CPU devices:
    128 MiB here, replicas included) is handed back before the new state is read, not when
    the restore ends (jax frees it at its next transfer, and a CPU restore puts its leaves
    at the end): the process's RSS while the reads start falls well below where it was
    (jax may release a buffer a moment after ``del``: the lowest of them). Read into fresh
    memory (``JAXCKPT_MAP=0``): mapped from the files, the arrays' pages are the page
    cache's, and a replica's count in the RSS only once touched."""
    monkeypatch.setenv("JAXCKPT_MAP", "0")
    x = np.random.default_rng(0).standard_normal((8192, 2048)).astype(np.float32)  # 64 MiB
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))})
    seen: list[int] = []

    def watched(real):
        def start(self, *args):
            seen.append(_rss())
            return real(self, *args)

        return start

    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    held = _rss()
    del out
    for how in ("start", "map"):  # a read into fresh memory, or a mapping of the file
        monkeypatch.setattr(Reader, how, watched(getattr(Reader, how)))
    out = jaxckpt.restore(tmp_path / "c")
    assert seen and min(seen) < held - (96 << 20), [(s - held) >> 20 for s in seen]
    np.testing.assert_array_equal(np.asarray(out["x"]), x)


def test_onto_cpu_devices_the_caller_sets_each_read_slice_aside(mesh42, tmp_path, monkeypatch):
    """Onto CPU devices ``Placement.put`` only sets a slice aside (the devices adopt the
    leaf's slices together): that runs on the restoring thread, with no thread to hand
    each slice over to (the hand-over cost more than the put)."""
    from jaxckpt._src.placement import Placement

    x = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",)), "r": sharded(x, mesh42, ())})
    threads: set[str] = set()
    real = Placement.put

    def put(self, index, data, *args, **kw):
        threads.add(threading.current_thread().name)
        return real(self, index, data, *args, **kw)

    monkeypatch.setattr(Placement, "put", put)
    out = jaxckpt.restore(tmp_path / "c")
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    np.testing.assert_array_equal(np.asarray(out["r"]), x)
    assert threads == {threading.current_thread().name}


def test_a_restore_from_the_disk_faults_its_buffers_in_ahead_of_the_reads(
    x64, mesh42, tmp_path, monkeypatch
):
    """Files not in the page cache: the restore hands a thread the memory the direct reads
    fill (each slice's buffer and its replicas' places), every byte once, in read order; the
    thread populates a prefix of it (``arrays.populate``: it stops when the reads are done,
    so how far it gets depends on the machine's load), and the restore is bit-exact for
    every dtype (random bits). From the page cache nothing is handed over."""
    from jaxckpt._src.io import arrays, slices

    rng = np.random.default_rng(21)
    specs = [P("data"), P(), P(None, "model")]
    tree = {
        f"{d.name}": sharded(random_bits((64, 32), d, rng), mesh42, specs[i % 3])
        for i, d in enumerate(DTYPES)
    }
    tree["big"] = sharded(random_bits((1024, 256), np.dtype(np.float32), rng), mesh42, P("data"))
    jaxckpt.save(tmp_path / "c", tree)
    if not arrays.populate(arrays.aligned_empty((1 << 16,), np.dtype(np.uint8))):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    handed: list[int] = []  # the fill buffers' addresses, in the order given to the thread
    populated: list[int] = []
    nbytes: list[int] = []  # the bytes handed over, a restore at a time
    real_populate, real_populating = arrays.populate, slices._populating

    def watching(buf, stop=lambda: False):
        populated.append(buf.ctypes.data)
        return real_populate(buf, stop)

    def handing(regions):
        handed.extend(r.ctypes.data for r in regions)
        nbytes.append(sum(r.nbytes for r in regions))
        return real_populating(regions)

    monkeypatch.setattr(arrays, "populate", watching)
    monkeypatch.setattr(slices, "_populating", handing)
    monkeypatch.delenv(linux.DIRECT_READ, raising=False)
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()
    }
    for cold in (True, False):  # the second restore finds the files cached
        if cold:
            iostats.drop_page_cache(str(tmp_path / "c"))
        out = jaxckpt.restore(tmp_path / "c", target=target)
        for k, v in tree.items():
            assert_same_bits(np.asarray(v), np.asarray(out[k]), k)
        # every device's copy: each device holds a shard or a replica; but the big leaf's
        # slices (256 KiB whole chunks) are mappings of the files, no fresh memory (``mapped``)
        held = sum(
            a.addressable_shards[0].data.nbytes * len(a.addressable_shards)
            for k, a in tree.items()
            if a.dtype.kind != "b"
            and jax.dtypes.itemsize_bits(a.dtype) == 8 * a.dtype.itemsize
            and k != "big"
        )
        assert nbytes == [held if cold else 0]
        assert len(set(handed)) == len(handed)  # no buffer twice
        assert populated == handed[: len(populated)]
        for seen in (handed, populated, nbytes):
            seen.clear()


def test_small_leaves_put_whole_let_go_of_their_host_buffers_as_they_are_put(
    mesh42, tmp_path, monkeypatch
):
    """As onto an accelerator (``JAXCKPT_ADOPT=0``, jax's put made to copy, as a device
    does): once every leaf is put, before the restore ends, no small leaf's host buffer is
    alive (a request that held one kept them all to the end, beyond the read budget)."""
    import gc
    import weakref

    from jaxckpt._src import placement, restoring

    monkeypatch.setenv("JAXCKPT_ADOPT", "0")
    monkeypatch.setenv(linux.MAP, "0")
    real_put, real_buffers, real_read = (
        placement._put, placement.Placement._host_buffers, restoring.slices.read
    )  # fmt: skip
    monkeypatch.setattr(placement, "_put", lambda *a: real_put(*a[:3], [b.copy() for b in a[3]]))
    regions: list[weakref.ref] = []

    def host_buffers(self):
        out = real_buffers(self)
        base = next(iter(out.values()))[0]
        while isinstance(base.base, np.ndarray):
            base = base.base
        regions.append(weakref.ref(base))
        return out

    alive: list[int] = []

    def read(*args, **kwargs):
        n = real_read(*args, **kwargs)
        gc.collect()
        alive.append(sum(r() is not None for r in regions))
        return n

    monkeypatch.setattr(placement.Placement, "_host_buffers", host_buffers)
    monkeypatch.setattr(restoring.slices, "read", read)
    state = {
        f"x{i}": sharded(np.full((16, 8), i, np.float32), mesh42, ("data",)) for i in range(20)
    }
    jaxckpt.save(tmp_path / "c", state)
    out = jaxckpt.restore(tmp_path / "c", target=state)
    assert len(regions) == 20 and alive == [0], (len(regions), alive)
    assert_tree_equal(out, state)
