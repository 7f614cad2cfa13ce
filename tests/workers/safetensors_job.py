"""Worker: jaxckpt.safetensors across processes.

usage: safetensors_job.py save DIR     saves a data-parallel + sharded tree; prints
                                       ``IO <json>`` (the bytes this process wrote: wchar)
       safetensors_job.py load DIR     loads it onto (processes, 8/processes) with each
                                       process needing half the rows; page cache dropped
                                       first; prints ``IO <json>`` (rchar, and the bytes
                                       its devices need) and checks the values
       safetensors_job.py hostile DIR  saves random bit patterns (NaN payloads: bf16, f16,
                                       f32, float8) replicated, sharded and through a
                                       reshape/transpose/reshape chain, loads them back
                                       whole on every process and compares bytes (with
                                       JAXCKPT_TEST_HOSTS=separate each process is its own
                                       host)
"""

import json
import os
import sys

import multiproc
from hostile import assert_same_bits, random_bits
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


HOSTILE = [
    ml_dtypes.bfloat16,
    np.float16,
    np.float32,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]
# Llama's RoPE row permutation of q/k (HF halves -> interleaved), then nn.Linear's transpose
ROPE = [
    jaxckpt.safetensors.Stack(),
    jaxckpt.safetensors.Reshape((16, 8), (4, 2, 2, 8)),
    jaxckpt.safetensors.Transpose((0, 2, 1, 3)),
    jaxckpt.safetensors.Reshape((4, 2, 2, 8), (16, 8)),
    jaxckpt.safetensors.Transpose((1, 0)),
]


def hostile_values() -> dict:
    rng = np.random.default_rng(19)
    out = {}
    for t in HOSTILE:
        name = np.dtype(t).name
        out[f"norm_{name}"] = random_bits((8,), t, rng)  # a replicated norm scale
        out[f"w_{name}"] = random_bits((8, 16), t, rng)
    out["q"] = random_bits((2, 8, 16), ml_dtypes.bfloat16, rng)  # stacked, through ROPE
    return out


def hostile(path: str, mesh) -> None:
    exp = hostile_values()
    save_spec = {k: P() if k.startswith("norm") else P("data", "model") for k in exp}
    save_spec["q"] = P(None, "model", "data")
    tree = {
        k: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, save_spec[k]), lambda i, v=v: v[i]
        )
        for k, v in exp.items()
    }
    names = [(r"^q$", "model.layers.{i}.self_attn.q_proj.weight")]
    transforms = [(r"^q$", ROPE)]
    jaxckpt.safetensors.save(path, tree, names=names, transforms=transforms, max_file_bytes=400)
    if jax.process_index() == 0:  # the reference reads what was written, bit for bit
        import safetensors

        from jaxckpt._src.safetensors.format import DTYPES as ST

        ref = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                with open(os.path.join(path, f), "rb") as fh:
                    for name, t in safetensors.deserialize(fh.read()):
                        arr = np.frombuffer(bytes(t["data"]), ST[t["dtype"]])
                        ref[name] = arr.reshape(t["shape"])
        for k, v in exp.items():
            if k != "q":
                assert_same_bits(v, ref[k], k)
        for i in range(2):  # the NumPy model of ROPE, inverted: leaf layer -> file tensor
            want = exp["q"][i].T.reshape(4, 2, 2, 8).transpose(0, 2, 1, 3).reshape(16, 8)
            assert_same_bits(want, ref[f"model.layers.{i}.self_attn.q_proj.weight"], f"q{i}")
    # every process needs every leaf whole (replicated), and q split over "model"
    target = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, P()))
        for k, v in exp.items()
    }
    target["q"] = jax.ShapeDtypeStruct(
        exp["q"].shape, exp["q"].dtype, sharding=NamedSharding(mesh, P(None, None, "model"))
    )
    out = jaxckpt.safetensors.load(path, target, names=names, transforms=transforms)
    for k, v in out.items():
        for shard in v.addressable_shards:
            assert_same_bits(exp[k][shard.index], np.asarray(shard.data), f"{k} {shard.index}")


def main(mode: str, path: str) -> None:
    n = jax.process_count()
    if os.environ.get("JAXCKPT_TEST_HOSTS") == "separate":  # simulated machines
        os.environ["JAXCKPT_HOST"] = f"host{jax.process_index()}"
    mesh = jax.make_mesh((n, 8 // n), ("data", "model"))
    exp = expected()
    if mode == "hostile":
        hostile(path, mesh)
    elif mode == "save":
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
