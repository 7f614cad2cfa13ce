"""Shared fixtures. Eight virtual CPU devices, set before jax is imported."""

import json
import os
import pathlib
from typing import Any

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# Properties (``@pytest.mark.property``) leave max_examples to these profiles: "ci" keeps the
# suite bounded and the same from run to run; bench/fuzz.py runs them under "fuzz" with fresh
# seeds for as long as asked.
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile(  # derandomized: a CI failure repeats on the next run
    "ci", max_examples=20, deadline=None, suppress_health_check=_SLOW_OK, derandomize=True
)
settings.register_profile("fuzz", max_examples=200, deadline=None, suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("JAXCKPT_HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def mesh42():
    return jax.make_mesh((4, 2), ("data", "model"))


@pytest.fixture
def x64():
    """64-bit dtypes on (int64, float64, complex128 arrays), for hostile-value tests."""
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.fixture
def ckpt_dir(tmp_path):
    return tmp_path / "ckpt"


@pytest.fixture
def o_direct_opens(monkeypatch) -> list[str]:
    """The paths opened with O_DIRECT from now on (``os.open`` watched, not changed)."""
    opened: list[str] = []
    real = os.open

    def recording(path, flags, *args, **kwargs):  # (shutil.rmtree passes dir_fd=)
        if flags & getattr(os, "O_DIRECT", 0):
            opened.append(str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", recording)
    return opened


class Calls:
    """Counts the calls of ``owner.name`` (the real one runs) for a test's length."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.count = 0
        real = getattr(owner, name)

        def counting(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)


def listing(directory) -> list[str]:
    """A manager directory's entries, less its run log (``runlog/``, format 1.6) and the
    writer's lease of an open manager (``.jaxckpt-lease``)."""
    return sorted(n for n in os.listdir(directory) if n not in ("runlog", ".jaxckpt-lease"))


def leaf_spec(step, name: str) -> dict:
    """The TensorStore spec of leaf ``name`` of the checkpoint ``step`` as docs/FORMAT.md
    gives it: zarr3 over the step's OCDBT database, nothing from jaxckpt."""
    manifest = json.loads((pathlib.Path(step) / "manifest.json").read_text())
    assert any(leaf["name"] == name for leaf in manifest["leaves"]), name
    return {
        "driver": "zarr3",
        "kvstore": {
            "driver": "ocdbt",
            "base": f"file://{pathlib.Path(step) / manifest['arrays']}/",
        },
        "path": name + "/",
    }


def sharded(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def assert_tree_equal(a, b):
    """Bit-exact equality of two pytrees (structure, dtypes and values)."""
    la, ta = jax.tree_util.tree_flatten(a, is_leaf=lambda x: x is None)
    lb, tb = jax.tree_util.tree_flatten(b, is_leaf=lambda x: x is None)
    assert ta == tb, f"structure differs:\n{ta}\n{tb}"
    for x, y in zip(la, lb, strict=True):
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert isinstance(y, jax.Array) and y.dtype == x.dtype
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        if isinstance(x, (jax.Array, np.ndarray, np.generic)):
            x, y = np.asarray(x), np.asarray(y)
            assert x.dtype == y.dtype, (x.dtype, y.dtype)
            assert x.shape == y.shape, (x.shape, y.shape)
            assert x.tobytes() == y.tobytes()
        else:
            assert type(x) is type(y) and x == y, (x, y)


def flip_a_chunk_byte(path) -> tuple[str, int]:
    """Corrupts a checkpoint at ``path``: one byte in the middle of the biggest chunk value of
    its biggest data file; returns the file and the byte's offset. (A data file may also hold B-tree nodes of earlier generations
    that nothing references: flipping a byte there changes nothing, so the byte is taken
    from a value the B-tree points to, found with ``tensorstore.ocdbt.dump``.)"""
    import tensorstore as ts

    from jaxckpt._src.io import arrays
    from jaxckpt._src.storage import location

    db = arrays.database_dir(location(str(path)), None)
    kv = ts.KvStore.open(arrays.kvstore_spec(db), context=arrays.new_context()).result()
    keys = {k.decode() for k in kv.list().result()}
    values = [v for v in arrays.chunk_bytes(kv.base, db, keys).values() if not v.inline]
    biggest = max({v.file for v in values}, key=os.path.getsize)
    value = max((v for v in values if v.file == biggest), key=lambda v: v.stop - v.start)
    offset = (value.start + value.stop) // 2
    flip_byte(biggest, offset)
    return biggest, offset


def flip_byte(file, offset: int, mask: int = 0xFF) -> None:
    """XORs the byte at ``offset`` of ``file`` with ``mask``, in place."""
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ mask]))


# --- S3: a moto server on 127.0.0.1 -----------------------------------------------------------

S3_BUCKET = "jaxckpt-test"


@pytest.fixture(scope="session")
def s3_server():
    """``s3://<bucket>`` on a moto S3 server at 127.0.0.1 (a thread of this process).

    Sets AWS_ENDPOINT_URL and fake credentials in ``os.environ`` for the session (other
    AWS_* settings that could redirect requests are removed) and puts them back after.
    """
    import logging

    moto_server = pytest.importorskip("moto.server", reason="needs moto[s3], flask, flask-cors")
    import boto3

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one log line per request else
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    no_proxy = ",".join(
        p for p in (os.environ.get("NO_PROXY") or os.environ.get("no_proxy"), "127.0.0.1") if p
    )
    env = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_REGION": "us-east-1",
        "NO_PROXY": no_proxy,  # libcurl (TensorStore) and botocore honour a proxy otherwise
        "no_proxy": no_proxy,
    }
    drop = [
        "AWS_ENDPOINT_URL_S3",
        "AWS_IGNORE_CONFIGURED_ENDPOINT_URLS",
        "AWS_DEFAULT_REGION",
        "AWS_PROFILE",
    ]
    saved = {k: os.environ.get(k) for k in [*env, *drop]}
    os.environ.update(env)
    for k in drop:
        os.environ.pop(k, None)
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket=S3_BUCKET
        )
        yield f"s3://{S3_BUCKET}"
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def s3_url(s3_server, request):
    """A fresh, empty ``s3://<bucket>/<prefix>`` for one test."""
    import re
    import uuid

    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", request.node.name)[:60]
    return f"{s3_server}/{name}-{uuid.uuid4().hex[:8]}"
