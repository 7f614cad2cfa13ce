"""Compression (``compression=`` of ``jaxckpt.save`` and ``Options``; the codecs are
``jaxckpt._src.io.arrays``): zstd, and blosc's byte shuffle by the element's size then zstd,
written so that TensorStore alone opens them, bit-exact for every dtype, and read back by
TensorStore whatever the restore's path (the direct and mapped paths take raw chunks only).
"""

import json
import os

import iostats
import jax
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts
from conftest import leaf_spec, sharded
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors
from jaxckpt._src.io import codecs, linux, mapped


def _zarr_json(ckpt, name: str) -> dict:
    """Leaf ``name``'s zarr metadata as stored, read with TensorStore's own kvstore."""
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{ckpt}/arrays/"}).result()
    return json.loads(kv.read(f"{name}/zarr.json").result().value)


def _stored_bytes(ckpt) -> int:
    """The bytes of the checkpoint's array files on disk (B-tree and data files)."""
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(os.path.join(ckpt, "arrays"))
        for f in files
    )


def test_a_blosc_leaf_opens_with_tensorstore_alone(mesh42, tmp_path):
    """The spec docs/FORMAT.md gives (zarr3 over the step's OCDBT database), nothing from
    jaxckpt: the codecs are bytes, blosc (zstd, byte shuffle by the bf16's 2 bytes, level
    1, 1 MiB blocks) and crc32c, and the values come back byte for byte."""
    x = random_bits((64, 32), np.dtype(ml_dtypes.bfloat16), np.random.default_rng(1))
    jaxckpt.save(tmp_path / "c", {"params": {"w": sharded(x, mesh42, ("data", "model"))}},
                 compression="blosc")  # fmt: skip
    store = ts.open(leaf_spec(tmp_path / "c", "params/w")).result()
    assert_same_bits(x, store.read().result(), "TensorStore alone")
    blosc = {"cname": "zstd", "clevel": 1, "shuffle": "shuffle", "typesize": 2,
             "blocksize": 1 << 20}  # fmt: skip
    assert _zarr_json(tmp_path / "c", "params/w")["codecs"] == [
        {"name": "bytes", "configuration": {"endian": "little"}},
        {"name": "blosc", "configuration": blosc},
        {"name": "crc32c"},
    ]


@pytest.mark.parametrize("maps", ["mapped", "read"])
def test_hostile_values_bit_exact_through_blosc_onto_any_mesh(
    maps, x64, mesh42, tmp_path, monkeypatch
):
    """Random bit patterns of every dtype (NaN payloads, -0.0, subnormals; bool, int4,
    float8s, complex) through blosc, each shuffled by its stored element's size: back
    bit-exact onto the saved mesh and onto meshes that join or cut its chunks, with the
    direct reader and file mappings allowed or switched off (``JAXCKPT_MAP=0``). TensorStore
    reads every blosc chunk: no ``preadv`` of the direct reader, no slice mapped; the raw
    leaf beside them is mapped where mappings are allowed (so the count can fail)."""
    if maps == "mapped":
        monkeypatch.setattr(mapped, "enabled", lambda path: mapped._kernel())
    else:
        monkeypatch.setenv(linux.MAP, "0")
    monkeypatch.delenv(linux.DIRECT_READ, raising=False)
    rng = np.random.default_rng(3)
    values = {d.name: random_bits((32, 16), d, rng) for d in DTYPES}
    tree = {k: sharded(v, mesh42, ("data", "model")) for k, v in values.items()}
    tree["numpy_bf16"] = values["bfloat16"]
    jaxckpt.save(tmp_path / "blosc", tree, compression="blosc:3")
    for d in DTYPES:
        codec = _zarr_json(tmp_path / "blosc", d.name)["codecs"][1]
        assert codec["name"] == "blosc" and codec["configuration"]["clevel"] == 3
        assert codec["configuration"]["typesize"] == d.itemsize, d  # (int4: one byte each)
    raw = np.arange(1 << 18, dtype=np.float32).reshape(1024, 256)  # 256 KiB chunks: mappable
    jaxckpt.save(tmp_path / "raw", {"r": sharded(raw, mesh42, ("data",))})

    preads = []  # the direct reader's (not its page-cache probes, RWF_NOWAIT)
    real = os.preadv

    def counting(fd, buffers, offset, *rest):
        if not (rest and rest[0] & getattr(os, "RWF_NOWAIT", 0)):
            preads.append(offset)
        return real(fd, buffers, offset, *rest)

    monkeypatch.setattr(os, "preadv", counting)
    for shape in [(4, 2), (2, 4), (8, 1)]:
        mesh = jax.make_mesh(shape, ("data", "model"))
        target = {k: NamedSharding(mesh, P("data", "model")) for k in values}
        target["numpy_bf16"] = values["bfloat16"]
        with iostats.counting_maps() as maps_count:
            out = jaxckpt.restore(tmp_path / "blosc", target=target)
        for k, v in values.items():
            assert_same_bits(v, np.asarray(out[k]), f"{k} onto {shape}")
            for shard in out[k].addressable_shards:
                assert_same_bits(v[shard.index], np.asarray(shard.data), f"{k} {shard.device}")
        assert_same_bits(values["bfloat16"], out["numpy_bf16"], "numpy")
        assert preads == [] and maps_count == [0], (shape, len(preads), maps_count)
    with iostats.counting_maps() as maps_count:
        out = jaxckpt.restore(tmp_path / "raw", target={"r": NamedSharding(mesh42, P("data"))})
    np.testing.assert_array_equal(np.asarray(out["r"]), raw)
    assert (maps_count[0] > 0) == (maps == "mapped" and mapped.enabled(str(tmp_path)))
    assert (maps_count[0] > 0) or preads  # the raw leaf: mapped, else read directly


def test_blosc_groups_the_exponent_bytes_of_bf16_weights(mesh42, tmp_path):
    """Weights as an initializer draws them (normal, bf16), in chunks of 512 KiB: blosc
    stores them in fewer bytes than zstd, which stores them in fewer than none; every save
    restores exactly."""
    w = (np.random.default_rng(5).standard_normal((2048, 512)) * 0.02).astype(ml_dtypes.bfloat16)
    sizes = {}
    for c in (None, "zstd", "blosc"):
        path = tmp_path / str(c)
        jaxckpt.save(path, {"w": sharded(w, mesh42, ("data",))}, compression=c)
        sizes[c] = _stored_bytes(path)
        assert_same_bits(w, np.asarray(jaxckpt.restore(path)["w"]), str(c))
    assert sizes["blosc"] < sizes["zstd"] / 1.05 < sizes[None] / 1.1, sizes


def test_levels_and_their_checks(tmp_path):
    """A level after a colon reaches the codec; unknown names and levels out of range are
    refused naming the value and the fix, by the options, ``save`` (with the path) and
    ``stage``, before anything is written."""
    x = np.ones((4, 4), np.float32)
    jaxckpt.save(tmp_path / "z", {"x": x}, compression="zstd:9")
    codec = _zarr_json(tmp_path / "z", "x")["codecs"][1]
    assert codec["name"] == "zstd" and codec["configuration"]["level"] == 9
    jaxckpt.save(tmp_path / "d", {"x": x}, compression="zstd")  # the level it always had
    assert _zarr_json(tmp_path / "d", "x")["codecs"][1]["configuration"]["level"] == 3
    assert jaxckpt.Options(compression="blosc:9").compression == "blosc:9"
    fix = r"pass None, 'zstd' or 'blosc'.*'blosc:1' to 'blosc:9'"
    for bad in ("lz4", "blosc:0", "blosc:10", "zstd:23", "zstd:", "blosc:x", "BLOSC"):
        with pytest.raises(errors.OptionsError, match=rf"compression={bad!r}.*{fix}"):
            jaxckpt.Options(compression=bad)
        with pytest.raises(errors.OptionsError, match=rf"/bad: compression={bad!r}.*{fix}"):
            jaxckpt.save(tmp_path / "bad", {"x": x}, compression=bad)
        with pytest.raises(errors.OptionsError, match=fix):
            jaxckpt.stage({"x": x}, compression=bad)
    assert sorted(os.listdir(tmp_path)) == ["d", "z"]


def test_blosc_chunks_stay_under_its_limit(mesh42, tmp_path, monkeypatch):
    """Blosc compresses at most 2 GiB at once: a blosc save cuts shards into chunks of at
    most ``BLOSC_MAX_CHUNK_BYTES`` (here made 4 KiB), a smaller ``chunk_bytes`` still
    wins, and zstd keeps whole shards."""
    monkeypatch.setattr(codecs, "BLOSC_MAX_CHUNK_BYTES", 4 << 10)
    x = np.arange(128 * 64, dtype=np.float32).reshape(128, 64)  # shards of 8 KiB on (4, 2)
    tree = {"x": sharded(x, mesh42, ("data", None))}
    for name, compression, chunk_bytes, want in [
        ("blosc", "blosc", None, [32, 32]),
        ("small", "blosc", 2 << 10, [16, 32]),
        ("zstd", "zstd", None, [32, 64]),
    ]:
        jaxckpt.save(tmp_path / name, tree, compression=compression, chunk_bytes=chunk_bytes)
        assert jaxckpt.metadata(tmp_path / name)["x"].shape == (128, 64)
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["leaves"][0]["chunk_shape"] == want, name
        np.testing.assert_array_equal(np.asarray(jaxckpt.restore(tmp_path / name)["x"]), x)
