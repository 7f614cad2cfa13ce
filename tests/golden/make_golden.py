"""Regenerates the golden files of the current format version (see tests/test_golden.py).

    python tests/golden/make_golden.py

writes tests/golden/v<major>.<minor>/ (refusing to overwrite an existing one: golden files
of a released version never change) and, for 1.0, v1.1_extra/: the 1.0 checkpoint with
fields a later minor might add, edited into its manifest by hand (here: by this script).
"""

import json
import os
import shutil
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/, for multiproc
sys.path.insert(0, HERE)

import jax  # noqa: E402
import multiproc  # noqa: E402
import values  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402


def add_unknown_fields(manifest_path: str, minor: int) -> None:
    """What a later minor version may add: top-level and per-leaf fields, a higher minor."""
    with open(manifest_path) as f:
        doc = json.load(f)
    doc["format_version"] = [doc["format_version"][0], minor]
    doc["a_future_field"] = {"nested": [1, 2, 3]}
    for leaf in doc["leaves"]:
        leaf["a_future_leaf_field"] = "ignored by older readers"
    with open(manifest_path, "w") as f:
        json.dump(doc, f, indent=1)


def main() -> None:
    major, minor = jaxckpt.FORMAT_VERSION
    out = os.path.join(HERE, f"v{major}.{minor}")
    if os.path.exists(out):
        sys.exit(f"{out} exists: golden files of a written version never change")
    os.makedirs(out)
    mesh = jax.make_mesh(values.MESH_SHAPE, values.AXES)
    jaxckpt.save(os.path.join(out, "checkpoint"), values.state(mesh))
    if (major, minor) >= (1, 2):  # sub-chunks: chunks smaller than the shards
        jaxckpt.save(os.path.join(out, "checkpoint_chunked"), values.state(mesh), chunk_bytes=16)
    if (major, minor) >= (1, 8):  # a chunk after a gap of zero bytes
        one = jax.devices()[0]
        aligned = {k: jax.device_put(v, one) for k, v in values.ALIGNED.items()}
        jaxckpt.save(os.path.join(out, "checkpoint_aligned"), aligned)
    if (major, minor) >= (1, 10):  # blosc: byte shuffle by the element's size, then zstd
        jaxckpt.save(os.path.join(out, "checkpoint_blosc"), values.state(mesh), compression="blosc")
    params = {
        "w": jax.device_put(values.EXPORT_W, NamedSharding(mesh, P(None, "model"))),
        "b": jax.device_put(values.EXPORT_B, NamedSharding(mesh, P("model"))),
    }
    jaxckpt.export.save(
        os.path.join(out, "export"),
        values.export_fn,
        params,
        jax.ShapeDtypeStruct(values.EXPORT_X.shape, values.EXPORT_X.dtype),
        mesh=mesh,
        in_specs=P("data", None),
        out_specs=P("data", "model"),
        device_counts=[8],
    )
    env = {"JAXCKPT_HOST": "golden-host"}  # names the machine in local.json, not this one's
    res = multiproc.run(os.path.join(HERE, "worker.py"), 2, args=["save", out], env=env)
    res.check()
    shutil.rmtree(os.path.join(out, "remote"), ignore_errors=True)  # no remote step was due
    if (major, minor) == (1, 0):
        extra = os.path.join(HERE, "v1.1_extra")
        shutil.copytree(os.path.join(out, "checkpoint"), os.path.join(extra, "checkpoint"))
        add_unknown_fields(os.path.join(extra, "checkpoint", "manifest.json"), 1)
    print("wrote", out)


if __name__ == "__main__":
    main()
