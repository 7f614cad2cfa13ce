"""Worker: a data-parallel state (parameters replicated over a 'data' axis that spans the
processes, sharded over 'model'), saved and restored; I/O measured from /proc/self/io.

usage: data_parallel.py save DIR      saves, prints ``IO <json>`` (write_bytes of the save)
       data_parallel.py restore DIR   restores onto the same mesh (page cache of the
                                      checkpoint's files dropped first; prints ``IO <json>``
                                      with /proc/self/io and TensorStore's file kvstore
                                      bytes_read) and onto another mesh, checks both
"""

import json
import os
import sys

import multiproc
from iostats import drop_page_cache, io, ts_file_bytes_read

multiproc.init()

import jax  # noqa: E402
import jax.experimental.multihost_utils  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def expected() -> dict:
    big = {f"w{i}": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024) + i for i in range(4)}
    small = {f"b{i}": np.arange(16, dtype=np.float32) * i for i in range(12)}
    return {
        "params": big,  # 4 MiB each, replicated over 'data'
        "small": small,  # replicated everywhere, 64 B each
        "sharded": np.arange(1 << 19, dtype=np.float32),  # over every device
        # wide shards: the parts each process writes are column slabs (strided views)
        "wide": np.arange(256 * 4096, dtype=np.float32).reshape(256, 4096),
        "host": np.arange(10, dtype=np.int32),  # a NumPy leaf
        "step": 3,
    }


def specs() -> dict:
    return {
        "params": {f"w{i}": P(None, "model") for i in range(4)},
        "small": {f"b{i}": P() for i in range(12)},
        "sharded": P(("data", "model")),
        "wide": P("model", None),
    }


def state(mesh) -> dict:
    exp = expected()
    out = jax.tree.map(
        lambda v, s: jax.make_array_from_callback(v.shape, NamedSharding(mesh, s), lambda i: v[i]),
        {k: exp[k] for k in ("params", "small", "sharded", "wide")},
        specs(),
    )
    return {**out, "host": exp["host"], "step": exp["step"]}


def check(out: dict) -> None:
    exp = expected()
    for (path, want), got in zip(
        jax.tree_util.tree_flatten_with_path(exp)[0], jax.tree.leaves(out), strict=True
    ):
        if isinstance(got, jax.Array):
            for shard in got.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(want)[shard.index])
        else:
            np.testing.assert_array_equal(got, want, err_msg=str(path))


def main(mode: str, path: str) -> None:
    n = jax.process_count()
    if os.environ.get("JAXCKPT_TEST_HOSTS") == "separate":  # simulated machines
        os.environ["JAXCKPT_HOST"] = f"machine{jax.process_index()}"
    mesh = jax.make_mesh((n, 8 // n), ("data", "model"))
    if mode == "save":
        s = state(mesh)
        jax.block_until_ready(s)
        before = io()
        jaxckpt.save(path, s)
        after = io()
        print("IO", json.dumps({k: after[k] - before[k] for k in after}), flush=True)
    else:
        if "://" not in path:
            drop_page_cache(path)
        jax.experimental.multihost_utils.sync_global_devices("dropped")
        before, ts_before, s3_before = io(), ts_file_bytes_read(), ts_file_bytes_read("s3")
        out = jaxckpt.restore(path)
        after = io()
        delta = {k: after[k] - before[k] for k in after}
        delta["ts_file_bytes_read"] = ts_file_bytes_read() - ts_before
        delta["ts_s3_bytes_read"] = ts_file_bytes_read("s3") - s3_before
        print("IO", json.dumps(delta), flush=True)
        check(out)
        other = jax.make_mesh((8 // n, n), ("data", "model"))
        check(jaxckpt.restore(path, mesh=other))
    print("ok", mode, jax.process_index(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
