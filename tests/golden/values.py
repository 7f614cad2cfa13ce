"""The values written into the golden checkpoints. Never change these: the golden files on
disk were written from them, and the tests compare every restore against them bit-exactly."""

import ml_dtypes
import numpy as np

MESH_SHAPE = (4, 2)
AXES = ("data", "model")
STEP = 7  # the emergency tier's step

# name -> (values, PartitionSpec entries; None = a NumPy leaf)
ARRAYS = {
    "f32": (np.arange(8 * 8, dtype=np.float32).reshape(8, 8) / 7, ("data", "model")),
    "bf16": ((np.arange(16, dtype=np.float32) - 5).astype(ml_dtypes.bfloat16), ("model",)),
    "int4": ((np.arange(8 * 4) % 15 - 7).astype(ml_dtypes.int4).reshape(8, 4), ("data", None)),
    "f8": ((np.arange(12, dtype=np.float32) / 4).astype(ml_dtypes.float8_e4m3fn), (None,)),
    "i32_replicated": (np.arange(10, dtype=np.int32) * -3, ()),
    "count": (np.asarray(42, np.int32), ()),  # 0-d, like TrainState.step
    "c64": (np.arange(4, dtype=np.complex64) * (1 + 2j), ("data",)),
}
NUMPY = {
    "np_u8": np.arange(6, dtype=np.uint8).reshape(2, 3),
    "np_bool": np.array([True, False, True]),
}
SCALAR = np.float32(2.5)  # a NumPy scalar
PYTHON = {"i": 3, "f": 0.25, "b": True, "s": "golden", "n": None}
KEY_SEED = 1234  # jax.random.key(KEY_SEED), threefry
ALIGNED = {  # (1.8) a small leaf, then one whose chunk (256 KiB) starts on a page boundary
    "a_small": np.arange(5, dtype=np.float32),
    "b_large": (np.arange(1 << 16, dtype=np.uint64) * 2654435761 % (1 << 32))
    .astype(np.uint32)
    .view(np.float32),  # every bit pattern kind: NaN payloads, -0.0, subnormals
}


def local_values(step: int) -> dict[str, np.ndarray]:
    """The emergency tier's arrays at ``step``."""
    return {
        "w": np.arange(16 * 8, dtype=np.float32).reshape(16, 8) + step,
        "b": np.arange(8, dtype=np.float32) * step,
    }


LOCAL_SPECS = {"w": ("data", "model"), "b": ("model",)}


def state(mesh):
    """The golden checkpoint's pytree on ``mesh`` (a (4, 2) mesh with AXES)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tree = {
        name: jax.make_array_from_callback(
            v.shape, NamedSharding(mesh, P(*spec)), lambda i, v=v: v[i]
        )
        for name, (v, spec) in ARRAYS.items()
    }
    tree.update(NUMPY)
    tree["scalar"] = SCALAR
    tree["python"] = dict(PYTHON)
    tree["key"] = jax.random.key(KEY_SEED)
    return tree


def expected() -> dict:
    """``state`` as host values (keys as key data), for comparisons."""
    import jax

    tree = {name: v for name, (v, _) in ARRAYS.items()}
    tree.update(NUMPY)
    tree["scalar"] = SCALAR
    tree["python"] = dict(PYTHON)
    tree["key"] = np.asarray(jax.random.key_data(jax.random.key(KEY_SEED)))
    return tree


# The exported function and its parameters: integer-valued floats, so outputs are exact.
EXPORT_W = np.arange(8 * 4, dtype=np.float32).reshape(8, 4) - 10
EXPORT_B = np.arange(4, dtype=np.float32)
EXPORT_X = (np.arange(4 * 8, dtype=np.float32).reshape(4, 8) % 5) - 2


def export_fn(params, x):
    return x @ params["w"] + params["b"]


def per_process(pid: int) -> dict:
    """Format 1.4: each process's own value (a grain iterator's position)."""
    return {"next_index": 10 + pid, "shard": f"{pid}/2"}
