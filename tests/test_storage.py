"""Locations (local paths, file://, s3://, gs://) and checkpoints on a real S3 HTTP server.

The S3 tests run against moto's server on 127.0.0.1 (the ``s3_server`` fixture): TensorStore
talks HTTP to it exactly as it would to S3, with the endpoint, region and credentials taken
from the AWS_* environment variables.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from conftest import assert_tree_equal, sharded
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt import errors
from jaxckpt._src.storage import Location, location, s3_options

# --- parsing -------------------------------------------------------------------------------


def test_local_paths(tmp_path, monkeypatch):
    loc = location(str(tmp_path / "run" / "step_1") + "/")
    assert loc == Location(str(tmp_path / "run" / "step_1"))
    assert loc.is_local and loc.scheme == "file" and loc.name == "step_1"
    assert loc.parent() == Location(str(tmp_path / "run"))
    assert loc.join("arrays", "p0").url == str(tmp_path / "run" / "step_1" / "arrays" / "p0")
    assert location(tmp_path / "x") == location(str(tmp_path / "x"))  # os.PathLike
    assert location(loc) is loc
    assert location(f"file://{tmp_path}/x") == Location(f"{tmp_path}/x")
    monkeypatch.chdir(tmp_path)
    assert location("rel/dir").url == str(tmp_path / "rel" / "dir")
    assert location("/").url == "/"
    assert loc.kvstore() == {"driver": "file", "path": str(tmp_path / "run" / "step_1") + "/"}


def test_object_store_urls(monkeypatch):
    for var in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID"):
        monkeypatch.delenv(var, raising=False)
    s3 = location("s3://bucket/run/step_1/")
    assert s3.url == "s3://bucket/run/step_1" and s3.scheme == "s3" and not s3.is_local
    assert s3.name == "step_1" and s3.parent() == Location("s3://bucket/run")
    assert s3.join("arrays").url == "s3://bucket/run/step_1/arrays"
    assert s3.kvstore() == {"driver": "s3", "bucket": "bucket", "path": "run/step_1/"}
    assert location("s3://bucket").kvstore() == {"driver": "s3", "bucket": "bucket", "path": ""}
    gs = location("gs://b2/a/b")
    assert gs.scheme == "gs" and gs.name == "b"
    assert gs.kvstore() == {"driver": "gcs", "bucket": "b2", "path": "a/b/"}
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    assert "endpoint" not in gs.kvstore()  # AWS settings are for s3:// only


@pytest.mark.parametrize("url", ["http://host/x", "hdfs://nn/x", "S4://b/x"])
def test_unsupported_scheme(url):
    with pytest.raises(errors.StorageError, match="unsupported scheme"):
        location(url)


def test_s3_options_from_environment():
    assert s3_options({}) == {}
    assert s3_options({"AWS_REGION": "eu-west-1"}) == {}  # AWS itself: bucket's own region
    env = {"AWS_ENDPOINT_URL": "http://minio:9000/", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert s3_options(env) == {"endpoint": "http://minio:9000", "aws_region": "eu-west-1"}
    env |= {"AWS_REGION": "eu-west-3", "AWS_ENDPOINT_URL_S3": "https://s3.example"}
    assert s3_options(env) == {"endpoint": "https://s3.example", "aws_region": "eu-west-3"}
    assert s3_options(env | {"AWS_IGNORE_CONFIGURED_ENDPOINT_URLS": "true"}) == {}
    assert s3_options({"AWS_ACCESS_KEY_ID": "k"}) == {"aws_credentials": {"type": "environment"}}
    with pytest.raises(errors.StorageError, match="http"):
        s3_options({"AWS_ENDPOINT_URL": "minio:9000"})


def test_local_small_files(tmp_path):
    loc = location(tmp_path / "d")
    assert loc.read_bytes("f") is None and not loc.exists("f") and loc.list_children() == []
    loc.write_bytes("f", b"hello")
    loc.join("sub").write_bytes("g", b"")
    assert loc.read_bytes("f") == b"hello" and loc.exists("f")
    assert loc.list_children() == ["f", "sub"]
    loc.delete_file("f")
    loc.delete_file("f")
    assert loc.list_children() == ["sub"]
    loc.remove()
    assert not pathlib.Path(loc.url).exists()


# --- S3 ------------------------------------------------------------------------------------


def _kv(url: str) -> ts.KvStore:
    return ts.KvStore.open(location(url).kvstore()).result()


def _delete(url: str, key: str) -> None:
    _kv(url).delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()


def test_s3_small_files(s3_url):
    base = location(s3_url)
    assert base.read_bytes("x") is None and not base.exists("x") and base.list_children() == []
    base.write_bytes("top", b"1")
    base.join("a", "b").write_bytes("c", b"2")
    base.join("a").write_bytes("d", b"")
    location(s3_url + "x").write_bytes("sibling", b"3")  # shares the string prefix only
    assert base.read_bytes("top") == b"1" and base.exists("top")
    assert base.join("a").exists("d") and base.join("a").read_bytes("d") == b""
    assert base.list_children() == ["a", "top"]  # the next path component only
    assert base.join("a").list_children() == ["b", "d"]
    base.join("a").remove()
    assert base.list_children() == ["top"]
    base.write_bytes("top2", b"4")
    base.delete_file("top")  # exactly that key, not "top2"
    base.delete_file("absent")
    assert base.list_children() == ["top2"]
    assert location(s3_url + "x").read_bytes("sibling") == b"3"
    with pytest.raises(errors.StorageError, match="whole bucket"):
        location(s3_url).parent().remove()


def _tree(mesh):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 32)).astype(np.float32)
    return {
        "params": {
            "w": sharded(w, mesh, ("data", "model")),
            "b": sharded(jnp.asarray(rng.standard_normal(32), jnp.bfloat16), mesh, (None,)),
            "e": sharded(rng.integers(-128, 127, (16, 8)).astype(np.int8), mesh, ("model",)),
        },
        "opt": [np.arange(6, dtype=np.int64).reshape(2, 3), np.float32(0.5)],
        "key": jax.random.key(3),
        "step": 7,
        "name": "run",
    }


def test_s3_round_trip_bit_exact(mesh42, s3_url):
    tree = _tree(mesh42)
    jaxckpt.save(s3_url, tree, custom_metadata={"note": "s3"})
    assert_tree_equal(jaxckpt.restore(s3_url), tree)
    assert jaxckpt.custom_metadata(s3_url) == {"note": "s3"}
    # Onto another layout: a 1-d mesh over all eight devices.
    mesh8 = jax.make_mesh((8,), ("x",))
    target = {"params": {"w": NamedSharding(mesh8, P(None, "x"))}}
    out = jaxckpt.restore(s3_url, target=target)
    assert out["params"]["w"].sharding == target["params"]["w"]
    assert np.asarray(out["params"]["w"]).tobytes() == np.asarray(tree["params"]["w"]).tobytes()
    # Committed last, and a step is a handful of objects (the OCDBT data files are few).
    keys = sorted(k.decode() for k in _kv(s3_url).list().result())
    assert {"COMMITTED", "manifest.json", "arrays/manifest.ocdbt"} <= set(keys)
    assert len(keys) <= 12, keys
    assert location(s3_url).list_children() == ["COMMITTED", "arrays", "manifest.json"]


def test_s3_metadata(mesh42, s3_url):
    jaxckpt.save(s3_url, _tree(mesh42))
    info = jaxckpt.metadata(s3_url)
    w = info["params"]["w"]
    assert w.shape == (64, 32) and w.dtype == np.float32 and w.nbytes == 64 * 32 * 4
    assert w.mesh_axes == ("data", "model") and w.mesh_shape == (4, 2)
    assert w.spec == P("data", "model")
    assert info["params"]["b"].dtype == jnp.bfloat16 and info["step"].value == 7


def test_s3_refuses_to_overwrite(s3_url):
    jaxckpt.save(s3_url, {"a": np.ones(3), "n": 1})
    with pytest.raises(errors.CheckpointExistsError, match="already holds"):
        jaxckpt.save(s3_url, {"a": np.zeros(3), "n": 2})
    assert_tree_equal(jaxckpt.restore(s3_url), {"a": np.ones(3), "n": 1})


def test_s3_missing_checkpoint(s3_url):
    with pytest.raises(errors.CheckpointNotFoundError, match="nothing is there"):
        jaxckpt.restore(s3_url)


def test_s3_interrupted_save_is_not_restorable(mesh42, s3_url):
    jaxckpt.save(s3_url, _tree(mesh42))
    _delete(s3_url, "COMMITTED")  # a save that died after its arrays and manifest
    with pytest.raises(errors.CheckpointNotFoundError, match="never finished"):
        jaxckpt.restore(s3_url)
    with pytest.raises(errors.CheckpointNotFoundError, match="never finished"):
        jaxckpt.metadata(s3_url)
    _delete(s3_url, "manifest.json")  # ... or one that died before its manifest
    with pytest.raises(errors.CheckpointNotFoundError, match="never finished"):
        jaxckpt.restore(s3_url)


def test_s3_save_over_an_interrupted_save(mesh42, s3_url):
    jaxckpt.save(s3_url, _tree(mesh42))
    _delete(s3_url, "COMMITTED")
    _delete(s3_url, "manifest.json")
    # The same leaf names with other shapes and dtypes, and fewer leaves.
    tree = {
        "params": {"w": sharded(np.full((16, 8), 2, np.int32), mesh42, ("data",))},
        "step": 8,
    }
    jaxckpt.save(s3_url, tree)
    assert_tree_equal(jaxckpt.restore(s3_url), tree)
    assert set(jaxckpt.metadata(s3_url)) == {"params", "step"}


def test_s3_corrupted_chunk_is_detected(mesh42, s3_url):
    x = sharded(
        np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32), mesh42, ("data",)
    )
    jaxckpt.save(s3_url, {"layer": {"w": x}})
    arrays = _kv(s3_url + "/arrays")
    sizes = {k: len(arrays.read(k).result().value) for k in arrays.list().result()}
    biggest = max(sizes, key=sizes.get)
    data = bytearray(arrays.read(biggest).result().value)
    data[len(data) // 2] ^= 0xFF
    arrays.write(biggest, bytes(data)).result()
    with pytest.raises(errors.ChecksumError, match=r"layer/w"):
        jaxckpt.restore(s3_url)


@pytest.mark.slow
def test_s3_two_processes_save_one_restores(s3_url):
    """Each process writes its own OCDBT database on S3; process 0 merges and commits."""
    import json
    import os

    import multiproc

    worker = os.path.join(os.path.dirname(__file__), "workers", "save_restore.py")
    multiproc.run(worker, 2, devices_per_process=4, args=["save", s3_url]).check()
    manifest = json.loads(location(s3_url).read_bytes("manifest.json"))
    assert manifest["process_count"] == 2 and all(b > 0 for b in manifest["bytes_per_process"])
    assert location(s3_url).join("arrays").list_children() == ["d", "manifest.ocdbt", "p0", "p1"]
    multiproc.run(worker, 1, devices_per_process=8, args=["restore", s3_url]).check()
