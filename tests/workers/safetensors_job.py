"""Worker: jaxckpt.safetensors across processes.

usage: safetensors_job.py save DIR     saves a data-parallel + sharded tree; prints
                                       ``IO <json>`` (the bytes this process wrote: wchar)
       safetensors_job.py load DIR     loads it onto (processes, 8/processes) with each
                                       process needing half the rows; page cache dropped
                                       first; prints ``IO <json>`` (rchar, and the bytes
                                       its devices need) and checks the values
"""

import json
import sys

import multiproc
from iostats import drop_page_cache, io

multiproc.init()

import jax  # noqa: E402
import jax.experimental.multihost_utils  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

DTYPES = [
    np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.float16, np.uint32, np.int64,
    np.uint64, np.float64, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
]  # fmt: skip


def expected() -> dict:
    small = np.arange(8 * 16).reshape(8, 16) % 7
    return {
        "w": np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024),
        "e": (np.arange(256 * 512) % 251).astype(ml_dtypes.bfloat16).reshape(256, 512),
        "b": np.arange(1024, dtype=np.int32),
        **{f"d_{np.dtype(t).name}": small.astype(t) for t in DTYPES},
    }


SAVE_SPECS = {"w": P(None, "model"), "e": P("data", "model"), "b": P()}  # w, b replicated over data
LOAD_SPECS = {"w": P("data", "model"), "e": P("data", None), "b": P("data")}
for _t in DTYPES:
    SAVE_SPECS[f"d_{np.dtype(_t).name}"] = P("data", "model")
    LOAD_SPECS[f"d_{np.dtype(_t).name}"] = P(None, "data")


def main(mode: str, path: str) -> None:
    n = jax.process_count()
    mesh = jax.make_mesh((n, 8 // n), ("data", "model"))
    exp = expected()
    if mode == "save":
        tree = {
            k: jax.make_array_from_callback(
                v.shape, NamedSharding(mesh, SAVE_SPECS[k]), lambda i, v=v: v[i]
            )
            for k, v in exp.items()
        }
        before = io()
        jaxckpt.safetensors.save(path, tree, max_file_bytes=1 << 20)
        print(
            "IO",
            # wchar: bytes this process passed to write/pwrite (processes share pages of the
            # files, so write_bytes, counted once per page dirtied, goes to whoever was first)
            json.dumps({"wchar": io()["wchar"] - before["wchar"]}),
            flush=True,
        )
    else:
        target = {
            k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, LOAD_SPECS[k]))
            for k, v in exp.items()
        }
        if jax.process_index() == 0:
            drop_page_cache(path)
        jax.experimental.multihost_utils.sync_global_devices("dropped")
        before = io()
        out = jaxckpt.safetensors.load(path, target)
        read = io()["rchar"] - before["rchar"]
        need = 0
        for k, v in out.items():
            seen = set()
            for shard in v.addressable_shards:
                key = str(shard.index)
                if key not in seen:
                    seen.add(key)
                    need += shard.data.nbytes
                np.testing.assert_array_equal(np.asarray(shard.data), exp[k][shard.index])
        print("IO", json.dumps({"rchar": read, "need": need}), flush=True)
    print("ok", mode, jax.process_index(), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
