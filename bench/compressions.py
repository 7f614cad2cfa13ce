"""Compression against none: stored bytes, save and restore GB/s, on weights trained for real
and on the bench state, in one table.

    python bench/compressions.py [--steps 200] [--hidden 2048] [--bench-gb 0.5] [--repeats 3]
                                 [--sweep] [--json FILE]

Two states, on a (4, 2) mesh of 8 CPU devices, each saved with ``compression`` None,
``"zstd"`` and ``"blosc"`` in turn (the order alternating), ``--repeats`` times:

- **trained**: an MLP (Flax; 64 -> hidden -> hidden -> 10, bf16 parameters) trained
  ``--steps`` Adam steps (Optax; its moments in float32) on scikit-learn's digits, the
  1,797 8x8 images the package ships; parameters and moments sharded along ``data``;
- **bench**: ``bench/train_state.py``'s state of ``--bench-gb`` GB (float32 normal draws).

Measured from outside the library: the stored bytes are the sizes of the checkpoint's files
on disk (``os.walk``), the ratio the state's logical bytes over them; save GB/s is logical
bytes over the wall time of ``jaxckpt.save`` (committed, fsynced); restore GB/s the same for
``jaxckpt.restore`` onto the saved shardings with the checkpoint's page cache dropped first
(``harness.drop_cold``), every leaf checked bit-exact (CRC32) against what was saved. Each
figure is the median of the repeats and is set against none's of the same run (``x none``).
``CPU s/GB``: the process's user + system CPU seconds (every thread) per logical GB, which
the machine's other load barely changes: the cores a host spends to save or restore at
1 GB/s (at a bucket link of B GB/s per host, B times that keeps up with the link).
The trained state's parts (parameters, mu, nu) are saved once more each for their ratios.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
import zlib

import harness

harness.cpu_devices(8)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import train_state  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402

COMPRESSIONS = (None, "zstd", "blosc")


def trained(steps: int, hidden: int, mesh: jax.sharding.Mesh) -> tuple[dict, str]:
    """The MLP's parameters (bf16) and Adam moments (float32) after ``steps`` steps on the
    digits, sharded along ``data``; and a line on the training (loss, accuracy)."""
    import flax.linen as nn
    import jax.numpy as jnp
    import optax
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.data / 16.0).astype(np.float32)
    labels = digits.target.astype(np.int32)

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for _ in range(2):
                x = nn.relu(nn.Dense(hidden, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x))
            return nn.Dense(10, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)(x)

    model = MLP()
    params = model.init(jax.random.key(0), images[:1])["params"]
    opt = optax.adam(1e-3)

    def f32(tree):  # noqa: ANN001, ANN202
        return jax.tree.map(lambda a: a.astype(jnp.float32), tree)

    opt_state = opt.init(f32(params))

    def loss_fn(p, x, y):  # noqa: ANN001, ANN202
        logits = model.apply({"params": p}, x).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step(p, s, x, y):  # noqa: ANN001, ANN202
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = opt.update(f32(grads), s, f32(p))
        p = jax.tree.map(lambda a, u: (a.astype(jnp.float32) + u).astype(a.dtype), p, updates)
        return p, s, loss

    rng = np.random.default_rng(0)
    losses = []
    for _ in range(steps):
        batch = rng.integers(0, len(images), 128)
        params, opt_state, loss = step(params, opt_state, images[batch], labels[batch])
        losses.append(float(loss))
    logits = model.apply({"params": params}, images)
    accuracy = float((np.asarray(logits).argmax(-1) == labels).mean())
    adam = opt_state[0]
    state = {
        "params": params,
        "opt_state": {"mu": adam.mu, "nu": adam.nu, "count": adam.count},
        "step": steps,
    }
    note = (
        f"trained: {steps} steps on digits, loss {np.mean(losses[:10]):.3f} -> "
        f"{np.mean(losses[-10:]):.3f}, train accuracy {accuracy:.3f}"
    )
    return jax.tree.map(lambda a: _placed(a, mesh), state), note


def _placed(a, mesh: jax.sharding.Mesh):  # noqa: ANN001, ANN202
    """``a`` sharded along ``data`` on its first dimension where it divides, else replicated."""
    if not isinstance(a, jax.Array):
        return a
    data = mesh.shape["data"]
    spec = P("data") if a.ndim and a.shape[0] % data == 0 else P()
    return jax.device_put(a, NamedSharding(mesh, spec))


def logical_bytes(tree: dict) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if isinstance(x, jax.Array))


def stored_bytes(path: str) -> int:
    """The sizes of every file of the checkpoint on disk."""
    return sum(os.path.getsize(f) for f in harness.files_under(path))


def crcs(tree: dict) -> list[int]:
    return [
        zlib.crc32(np.ascontiguousarray(np.asarray(x)).view(np.uint8))
        for x in jax.tree.leaves(tree)
        if isinstance(x, jax.Array)
    ]


def measure(name: str, state: dict, root: str, repeats: int) -> list[dict]:
    """Save and cold restore of ``state`` with each compression, alternating; checked."""
    nbytes, want = logical_bytes(state), crcs(state)
    target = jax.tree.map(
        lambda x: (
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            if isinstance(x, jax.Array)
            else x
        ),
        state,
    )
    times: dict = {
        c: {k: [] for k in ("save", "restore", "cpu", "rcpu", "stored")} for c in COMPRESSIONS
    }
    for rep in range(-1, repeats):  # -1: a warm-up, not counted
        for c in harness.alternate(COMPRESSIONS, rep):
            path = os.path.join(root, f"{name}-{c}-{rep}")
            with harness.Clock() as saved:
                jaxckpt.save(path, state, compression=c)
            harness.drop_cold(path)
            with harness.Clock() as restored:
                out = jax.block_until_ready(jaxckpt.restore(path, target=target))
            if crcs(out) != want:
                raise AssertionError(f"{name} {c}: the restore differs from what was saved")
            if rep >= 0:
                times[c]["save"].append(saved.seconds)
                times[c]["restore"].append(restored.seconds)
                times[c]["cpu"].append(saved.cpu)
                times[c]["rcpu"].append(restored.cpu)
                times[c]["stored"].append(stored_bytes(path))
            del out
            shutil.rmtree(path)
    rows = []
    for c in COMPRESSIONS:
        t = times[c]
        rows.append(
            {
                "state": name,
                "compression": str(c),
                "logical_bytes": nbytes,
                "stored_bytes": int(np.median(t["stored"])),
                "ratio": nbytes / np.median(t["stored"]),
                "save_gbps": harness.gbps(nbytes, t["save"]),
                "restore_gbps": harness.gbps(nbytes, t["restore"]),
                "save_cpu_s_per_gb": np.median(t["cpu"]) / (nbytes / harness.GB),
                "restore_cpu_s_per_gb": np.median(t["rcpu"]) / (nbytes / harness.GB),
            }
        )
    none = rows[0]
    for r in rows:
        r["save_x"] = r["save_gbps"] / none["save_gbps"]
        r["restore_x"] = r["restore_gbps"] / none["restore_gbps"]
    return rows


def part_ratios(state: dict, root: str) -> list[dict]:
    """The ratio of each part of the trained state saved alone (one save each)."""
    parts = {
        "trained params (bf16)": state["params"],
        "trained mu (f32)": state["opt_state"]["mu"],
        "trained nu (f32)": state["opt_state"]["nu"],
    }
    rows = []
    for name, tree in parts.items():
        for c in COMPRESSIONS:
            path = os.path.join(root, f"part-{c}")
            jaxckpt.save(path, tree, compression=c)
            ratio = logical_bytes(tree) / stored_bytes(path)
            rows.append({"state": name, "compression": str(c), "ratio": ratio})
            shutil.rmtree(path)
    return rows


def sweep(state: dict) -> None:
    """Blosc's level and block size against zstd's on the largest trained kernel (bf16) and
    its mu (float32): each written as one chunk into memory by TensorStore (one thread),
    ratio and GB/s of the write and the read (``--sweep``; what ``codecs.BLOSC_BLOCK_BYTES``
    and the default level come from)."""
    import tensorstore as ts

    name = max(state["params"], key=lambda k: state["params"][k]["kernel"].size)
    arrays = {
        "kernel bf16": np.asarray(state["params"][name]["kernel"]),
        "mu f32": np.asarray(state["opt_state"]["mu"][name]["kernel"]),
    }
    codecs = [("zstd", 1, None), ("zstd", 3, None)] + [
        ("blosc", level, block) for level in (1, 3, 5) for block in (0, 256 << 10, 1 << 20)
    ]
    table = harness.Table(
        (
            ("array", "<12"),
            ("codec", "<8"),
            ("level", ">6"),
            ("block KiB", ">10"),
            ("ratio", ">7.3f"),
            ("write GB/s", ">11.3f"),
            ("read GB/s", ">10.3f"),
        ),  # fmt: skip
        sep=" ",
    )
    rows = []
    for label, x in arrays.items():
        for codec, level, block in codecs:
            config: dict = {"level": level}
            if codec == "blosc":
                config = {"cname": "zstd", "clevel": level, "shuffle": "shuffle",
                          "typesize": x.dtype.itemsize, "blocksize": block}  # fmt: skip
            ctx = ts.Context()
            meta = {
                "shape": list(x.shape),
                "data_type": str(x.dtype),
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(x.shape)}},
                "codecs": [{"name": "bytes"}, {"name": codec, "configuration": config}],
            }
            spec = {"driver": "zarr3", "kvstore": "memory://a/", "create": True, "metadata": meta}
            store = ts.open(spec, context=ctx).result()
            writes, reads = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                store.write(x).result()
                writes.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                back = store.read().result()
                reads.append(time.perf_counter() - t0)
            assert back.tobytes() == x.tobytes(), (label, codec, level, block)
            kv = ts.KvStore.open("memory://a/", context=ctx).result()
            stored = len(kv.read("c/" + "/".join("0" * x.ndim)).result().value)
            rows.append((label, codec, level, None if block is None else block >> 10,
                         x.nbytes / stored, harness.gbps(x.nbytes, writes),
                         harness.gbps(x.nbytes, reads)))  # fmt: skip
    print(f"\n{name}/kernel {arrays['kernel bf16'].shape}, one chunk, medians of 3 (block 0: "
          "blosc's own choice)")  # fmt: skip
    table.print(rows, rule=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--bench-gb", type=float, default=0.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--sweep", action="store_true", help="also blosc's levels and block sizes")
    a = ap.parse_args()
    mesh = train_state.make_mesh((4, 2), 8)
    t0 = time.perf_counter()
    state, note = trained(a.steps, a.hidden, mesh)
    harness.log(f"{note} ({time.perf_counter() - t0:.0f} s)")
    if a.sweep:
        sweep(state)
    rows, parts = [], []
    with harness.scratch("jaxckpt-compression-bench-") as root:
        rows += measure("trained", state, root, a.repeats)
        parts = part_ratios(state, root)
        del state
        harness.log("trained state measured")
        bench, _ = train_state.build_state(a.bench_gb, mesh)
        rows += measure("bench", bench, root, a.repeats)
    table = harness.Table(
        (
            ("state", "<22"),
            ("compression", "<12"),
            ("stored MB", ">10.1f"),
            ("ratio", ">7.3f"),
            ("save GB/s", ">10.3f"),
            ("x none", ">7.2f"),
            ("CPU s/GB", ">9.2f"),
            ("restore GB/s", ">13.3f"),
            ("x none", ">7.2f"),
            ("CPU s/GB", ">9.2f"),
        ),
        sep=" ",
    )
    print(note)
    print(f"trained: {rows[0]['logical_bytes'] / 1e6:.1f} MB; bench: {a.bench_gb} GB; "
          f"medians of {a.repeats}; restores cold (page cache dropped)")  # fmt: skip
    table.print(
        [
            (
                r["state"],
                r["compression"],
                r["stored_bytes"] / 1e6,
                r["ratio"],
                r["save_gbps"],
                r["save_x"],
                r["save_cpu_s_per_gb"],
                r["restore_gbps"],
                r["restore_x"],
                r["restore_cpu_s_per_gb"],
            )  # fmt: skip
            for r in rows
        ]
        + [(p["state"], p["compression"], None, p["ratio"]) for p in parts],
        rule=True,
    )
    if a.json:
        harness.write_json(a.json, {"note": note, "rows": rows, "parts": parts, "args": vars(a)})


if __name__ == "__main__":
    main()
