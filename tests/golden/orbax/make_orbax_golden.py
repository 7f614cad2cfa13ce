"""Writes the golden Orbax checkpoints: orbax-checkpoint itself saves one small tree in every
save style its version has, and the values go beside them (``expected.npz``/``.json``) so
tests/test_orbax_golden.py compares bytes without orbax.

Run once per Orbax version, each in its own virtualenv (Python 3.11, CPU), from the repo root:

    python -m venv /tmp/orbax05 && /tmp/orbax05/bin/pip install 'orbax-checkpoint==0.5.10' \
        'jax[cpu]==0.4.26' 'jaxlib==0.4.26' 'flax==0.8.2' 'optax==0.2.2' 'numpy<2' \
        'tensorstore==0.1.56' 'ml_dtypes<0.5' 'chex<0.1.87'
    python -m venv /tmp/orbax0523 && /tmp/orbax0523/bin/pip install 'orbax-checkpoint==0.5.23' \
        'jax[cpu]==0.4.30' 'flax==0.8.5' 'optax==0.2.3' 'numpy<2' 'tensorstore==0.1.63'
    python -m venv /tmp/orbax06 && /tmp/orbax06/bin/pip install 'orbax-checkpoint==0.6.4' \
        'jax[cpu]==0.4.31' 'flax==0.9.0' 'optax==0.2.3' 'numpy<2' 'tensorstore==0.1.64'
    python -m venv /tmp/orbax011 && /tmp/orbax011/bin/pip install 'orbax-checkpoint==0.11.24' \
        'jax[cpu]==0.6.2' 'flax==0.10.6' 'optax==0.2.4' 'tensorstore==0.1.72'
        # (orbax 0.11.24 calls jax.monitoring.record_scalar: jax 0.5.3 is too old)
    /tmp/orbax05/bin/python tests/golden/orbax/make_orbax_golden.py
    /tmp/orbax0523/bin/python tests/golden/orbax/make_orbax_golden.py
    /tmp/orbax06/bin/python tests/golden/orbax/make_orbax_golden.py
    /tmp/orbax011/bin/python tests/golden/orbax/make_orbax_golden.py
    python tests/golden/orbax/make_orbax_golden.py       # the project's own orbax (0.12.x)

Each run writes tests/golden/orbax/<orbax version>/<style>/ on a (4, 2) mesh of 8 CPU devices.
Styles: ``standard`` (StandardCheckpointer), ``flax`` (the Flax guide's PyTreeCheckpointer with
``orbax_utils.save_args_from_target``: before flax 0.9 that aggregates every leaf that is not
on several devices into the msgpack ``checkpoint`` file), ``ocdbt`` and ``no_ocdbt``
(PyTreeCheckpointHandler), ``zarr3``, and ``maxtext`` (a CheckpointManager with the item
``items`` saved through ``Composite``, as MaxText does). The expected values are what Orbax
itself restores from each style (they must agree; ``orbax_read_back`` in expected.json says
where they differ from the values saved: orbax 0.11.24 canonicalizes sharded bf16 NaNs).
"""

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from importlib.metadata import version  # noqa: E402

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BF16 = np.dtype(ml_dtypes.bfloat16)
SPECIAL = [np.nan, -0.0, np.inf, -np.inf]


def random_bits(shape, dtype, rng) -> np.ndarray:
    """Random bit patterns (NaN payloads included); floats start with NaN, -0.0, +-inf."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    out = np.frombuffer(rng.bytes(n * dtype.itemsize), dtype).copy()
    if dtype.kind == "f" or dtype == BF16:
        k = min(n, len(SPECIAL))
        out[:k] = np.array(SPECIAL[:k], np.float32).astype(dtype)
        if n > k:  # a NaN with a payload other than the default one
            out[k : k + 1] = np.frombuffer(
                (b"\x7f\xc1" if dtype.itemsize == 2 else b"\x7f\xa0\x00\x05")[::-1], dtype
            )
    return out.reshape(shape)


# name -> (shape, dtype, PartitionSpec or "numpy"/"single"/"python")
LEAVES = {
    "params/dense/kernel": ((16, 8), np.float32, P("data", "model")),
    "params/dense/bias": ((8,), BF16, P("model")),
    "params/embed": ((6, 8), BF16, P(None, "data")),
    "params/layers/0": ((8, 4), np.float32, P(("data", "model"))),
    "params/layers/1": ((4, 2), np.int32, P("data", "model")),
    "opt_state/mu": ((16, 8), np.float32, P("data", None)),
    "opt_state/count": ((), np.int32, P()),
    "replicated": ((5,), np.float32, P()),
    "single": ((3,), BF16, "single"),
    "host": ((3, 2), np.float32, "numpy"),
    "host_scalar": ((), np.float32, "numpy"),
    "step": ((), np.int64, "python"),
}


def values() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(19)
    return {name: random_bits(shape, dt, rng) for name, (shape, dt, _) in LEAVES.items()}


def build(mesh) -> dict:
    """The tree Orbax saves: nested dicts and a list, leaves placed as LEAVES says."""
    tree: dict = {}
    for name, v in values().items():
        spec = LEAVES[name][2]
        if spec == "python":
            leaf = int(v)
        elif spec == "numpy":
            leaf = v
        elif spec == "single":
            leaf = jax.device_put(v, jax.devices()[0])
        else:
            leaf = jax.make_array_from_callback(
                v.shape, NamedSharding(mesh, spec), lambda i, v=v: v[i]
            )
        *parents, last = name.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    tree["params"]["layers"] = [tree["params"]["layers"]["0"], tree["params"]["layers"]["1"]]
    return tree


def save_all(root: str, tree: dict) -> list[str]:
    """Every style this Orbax has; returns the styles written."""
    written = []

    def pytree(path, **kw):
        ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**kw)).save(
            path, args=ocp.args.PyTreeSave(tree)
        )

    styles = {
        "standard": lambda p: _standard(p, tree),
        "flax": lambda p: _flax_guide(p, tree),
        "ocdbt": lambda p: pytree(p, use_ocdbt=True),
        "no_ocdbt": lambda p: pytree(p, use_ocdbt=False),
        "zarr3": lambda p: pytree(p, use_zarr3=True),
        "maxtext": lambda p: _maxtext(p, tree),
    }
    for style, save in styles.items():
        path = os.path.join(root, style)
        shutil.rmtree(path, ignore_errors=True)
        try:
            save(path)
        except Exception as e:  # a style this version lacks
            print(f"{style}: not written ({type(e).__name__}: {e})", file=sys.stderr)
            shutil.rmtree(path, ignore_errors=True)
            continue
        written.append(style)
    return written


def _standard(path, tree):
    ckptr = ocp.StandardCheckpointer()
    try:
        ckptr.save(path, tree)
    except TypeError:  # 0.5: args only
        ckptr.save(path, args=ocp.args.StandardSave(tree))
    if hasattr(ckptr, "wait_until_finished"):  # 0.5: synchronous
        ckptr.wait_until_finished()


def _flax_guide(path, tree):
    from flax.training import orbax_utils

    ckptr = ocp.PyTreeCheckpointer()
    ckptr.save(path, tree, save_args=orbax_utils.save_args_from_target(tree))
    if hasattr(ckptr, "wait_until_finished"):
        ckptr.wait_until_finished()


def _maxtext(path, tree):
    mgr = ocp.CheckpointManager(path, item_names=("items",))
    mgr.save(3, args=ocp.args.Composite(items=ocp.args.PyTreeSave(item=tree)))
    mgr.wait_until_finished()
    mgr.close()


def main() -> None:
    ver = version("orbax-checkpoint")
    root = os.path.join(HERE, ver)
    os.makedirs(root, exist_ok=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    written = save_all(root, build(mesh))
    vals, checks = read_back(root, written, values())
    np.savez(
        os.path.join(root, "expected.npz"),
        **{n.replace("/", "."): v.view(f"u{v.dtype.itemsize}") for n, v in vals.items()},
    )
    doc = {
        "orbax": ver,
        "jax": jax.__version__,
        "tensorstore": version("tensorstore"),
        "mesh": {"shape": [4, 2], "axis_names": ["data", "model"]},
        "styles": written,
        "orbax_read_back": checks,
        "leaves": {
            n: {
                "dtype": "bfloat16" if dt == BF16 else np.dtype(dt).name,
                "shape": list(shape),
                "spec": spec if isinstance(spec, str) else [_entry(e) for e in spec],
            }
            for n, (shape, dt, spec) in LEAVES.items()
        },
    }
    with open(os.path.join(root, "expected.json"), "w") as f:
        json.dump(doc, f, indent=1)
    print(ver, written)


def read_back(root: str, styles: list[str], want: dict) -> tuple[dict, dict]:
    """What Orbax itself restores from each style: the expected values are those (where the
    save changed bits, e.g. orbax 0.11.24 canonicalizes sharded bf16 NaN payloads), and every
    style must agree."""
    got, checks = {}, {}
    for style in styles:
        path = os.path.join(root, style, *(["3", "items"] if style == "maxtext" else []))
        try:
            tree = ocp.PyTreeCheckpointer().restore(path)
        except Exception as e:
            checks[style] = f"orbax could not restore it: {type(e).__name__}"
            continue
        pairs = jax.tree_util.tree_flatten_with_path(tree)[0]
        read = {
            "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): np.asarray(v)
            for p, v in pairs
        }
        read = {n: read[n].astype(want[n].dtype).reshape(want[n].shape) for n in want}
        changed = sorted(n for n in want if read[n].tobytes() != want[n].tobytes())
        checks[style] = f"orbax restores other bits in {changed}" if changed else "orbax agrees"
        for n in changed:
            if n in got and got[n].tobytes() != read[n].tobytes():
                raise SystemExit(f"{style}: orbax reads {n} differently from another style")
            got[n] = read[n]
    return {**want, **got}, checks


def _entry(e):
    return list(e) if isinstance(e, tuple) else e


if __name__ == "__main__":
    main()
