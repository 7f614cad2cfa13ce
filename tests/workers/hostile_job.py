"""Worker: every dtype filled with random bits, through the multi-process paths, compared as
bytes on every shard.

usage: hostile_job.py MODE[,MODE...] ROOT   the modes in turn, in one job, each in its own
                                            folder of ROOT (save and restore share ROOT/ckpt):
  save        jaxckpt.save of the state on a (P, D) mesh
  restore     restore onto the saved shardings (read once + move where hosts differ), onto
              mesh=, onto another target
  regrid      restore onto the saved shardings and onto random specs only (a job of another
              process count: the other restores add compiles, not paths)
  manager     CheckpointManager: async save, then restore
  emergency   EmergencyCheckpointManager(replication=1): save step 1; the last process
              wipes its local directory; every process restores (its shards from peer copies)
  export      jaxckpt.export.save of the values as NumPy parameters (export/numpy) and as
              arrays on another mesh (export/arrays); every process restores both parameters
Env: JAXCKPT_TEST_MACHINES=separate gives each process its own machine ($JAXCKPT_HOST);
JAXCKPT_TEST_DTYPES (comma-separated names) narrows the dtypes; JAXCKPT_TEST_SEED draws the
random shapes, specs and bits (bench/fuzz.py runs fresh seeds); values depend on the seed
only, so any process count restores them.
"""

import os
import shutil
import sys
import warnings
from unittest import mock

import iostats
import multiproc

multiproc.init()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from hostile import DTYPES, assert_same_bits, random_bits  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxckpt  # noqa: E402
from jaxckpt._src import placement, ring  # noqa: E402

# Fixed leaves that read once (replicated over 'data') and random ones: each dtype gets
# ``RANDOM`` leaves of random shapes and PartitionSpecs drawn from $JAXCKPT_TEST_SEED.
SPECS = {"rep": P(None, "model"), "full": P("data", "model"), "all": P()}
SHAPE = (32, 64)
RANDOM = 2
# Leaves whose slices are 2 MiB or more (8 MiB over at most 4 'model' devices): restores
# read and replicate them in huge-page buffers (jaxckpt/_src/io/arrays.py: aligned_empty).
BIG = {"bfloat16": 8 << 20, "int4": 8 << 20}
# Leaves whose restored slices are whole chunks of 256 KiB or more, one or several back to
# back (a shard both processes hold is written in row blocks, one a process): restores onto
# CPU devices map them from the files (jaxckpt/_src/io/mapped.py).
MAPPED = {"float8_e4m3fn": 4 << 20, "bfloat16": 4 << 20}


def dtypes() -> list[np.dtype]:
    names = os.environ.get("JAXCKPT_TEST_DTYPES")
    return [d for d in DTYPES if not names or d.name in names.split(",")]


def random_spec(shape: tuple[int, ...], rng: np.random.Generator) -> P:
    """A spec valid on any mesh of 8 devices: mesh axes only on dimensions divisible by 8."""
    axes = [a for a in ("data", "model") if rng.random() < 0.7]
    entries: list = [None] * len(shape)
    for a in axes:
        dims = [d for d in range(len(shape)) if shape[d] % 8 == 0]
        if dims:
            d = int(rng.choice(dims))
            entries[d] = a if entries[d] is None else (entries[d], a)
    return P(*entries)


def layout(seed: int) -> dict[str, tuple[np.dtype, tuple[int, ...], P]]:
    """{leaf: (dtype, shape, saved spec)} for every dtype."""
    rng = np.random.default_rng(seed)
    out = {}
    for d in dtypes():
        out.update({f"{d.name}/{k}": (d, SHAPE, spec) for k, spec in SPECS.items()})
        for k in range(RANDOM):
            shape = tuple(int(x) for x in rng.choice([1, 3, 8, 16, 24], rng.integers(0, 4)))
            out[f"{d.name}/r{k}"] = (d, shape, random_spec(shape, rng))
        if d.name in MAPPED:
            rows = MAPPED[d.name] // (64 * d.itemsize)
            out[f"{d.name}/rows"] = (d, (rows, 64), P("data", None))
            out[f"{d.name}/tall"] = (d, (rows, 64), P(None, "model"))
        if d.name in BIG:
            out[f"{d.name}/big"] = (d, (16, BIG[d.name] // (16 * d.itemsize)), P(None, "model"))
    return out


SEED = int(os.environ.get("JAXCKPT_TEST_SEED", "19"))
LAYOUT = layout(SEED)


def expected() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(SEED)
    return {name: random_bits(shape, d, rng) for name, (d, shape, _) in LAYOUT.items()}


def nest(flat: dict) -> dict:
    out: dict = {}
    for name, v in flat.items():
        a, b = name.split("/")
        out.setdefault(a, {})[b] = v
    return out


def state(mesh) -> dict:
    return nest(
        {
            name: jax.make_array_from_callback(
                v.shape, NamedSharding(mesh, LAYOUT[name][2]), lambda i, v=v: v[i]
            )
            for name, v in expected().items()
        }
    )


def check(out: dict, where: str, skip: frozenset = frozenset()) -> None:
    """Every shard this process holds equals the expected slice, byte for byte (dtypes in
    ``skip`` left out)."""
    for name, v in expected().items():
        a, b = name.split("/")
        if a in skip:
            continue
        arr = out[a][b]
        assert arr.dtype == v.dtype, (where, name, arr.dtype)
        for shard in arr.addressable_shards:
            assert_same_bits(v[shard.index], np.asarray(shard.data), f"{where} {name}")


def target(mesh, spec_of) -> dict:
    """Every leaf on ``mesh`` with ``spec_of(leaf name, shape)``."""
    return nest(
        {
            name: jax.ShapeDtypeStruct(shape, d, sharding=NamedSharding(mesh, spec_of(name, shape)))
            for name, (d, shape, _) in LAYOUT.items()
        }
    )


def saved_spec(name: str, shape: tuple[int, ...]) -> P:
    return LAYOUT[name][2]


def main(modes: str, root: str) -> None:
    if os.environ.get("JAXCKPT_TEST_MACHINES") == "separate":
        os.environ["JAXCKPT_HOST"] = f"host{jax.process_index()}"
    for mode in modes.split(","):
        run(mode, os.path.join(root, "ckpt" if mode in ("save", "restore", "regrid") else mode))


def check_fingerprints(path: str) -> None:
    """Every leaf's fingerprint, added up from the pieces each process wrote, is that of the
    whole expected array (io/fingerprint.py): the layout does not enter it."""
    from jaxckpt._src.io import fingerprint
    from jaxckpt._src.manifest import read_manifest
    from jaxckpt._src.storage import location

    records = {r.name: r for r in read_manifest(location(path)).leaves}
    for name, v in expected().items():
        assert records[name].fingerprint == fingerprint.of_array(v), name


def emergency_options(timeout_s: float) -> jaxckpt.EmergencyOptions:
    """Local saves every step with one peer copy; the remote tier all but unused."""
    remote = jaxckpt.Options(save_interval_steps=100, max_to_keep=3, timeout_s=timeout_s)
    return jaxckpt.EmergencyOptions(
        local_interval_steps=1, replication=1, timeout_s=timeout_s, remote=remote
    )


def run(mode: str, path: str) -> None:
    pid, n = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((n, jax.device_count() // n), ("data", "model"))
    if mode == "save":
        jaxckpt.save(path, state(mesh))
        check_fingerprints(path)
    elif mode in ("restore", "regrid"):
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            with iostats.counting_maps() as maps:
                check(jaxckpt.restore(path, target=target(mesh, saved_spec)), "saved specs")
        # (jax warned of each donated buffer it could not reuse); a dependency's deprecation
        # notices on first use are not the restore's
        said = [str(w.message) for w in warned if not issubclass(w.category, DeprecationWarning)]
        assert not said, said
        assert maps[0] or not set(MAPPED) & {d.name for d in dtypes()}, "nothing was mapped"
        other = jax.make_mesh((jax.device_count() // n, n), ("data", "model"))
        if mode == "restore":
            check(jaxckpt.restore(path, mesh=mesh), "mesh=")
            check(jaxckpt.restore(path, target=target(other, lambda k, s: P())), "replicated")
        rng = np.random.default_rng(SEED + 1)
        check(
            jaxckpt.restore(path, target=target(other, lambda k, s: random_spec(s, rng))), "random"
        )
        if mode == "restore":  # as onto accelerators: read into the host ring, copied out
            accelerator = {"JAXCKPT_ADOPT": "0", "JAXCKPT_MAP": "0"}
            with (
                mock.patch.dict(os.environ, accelerator),
                mock.patch.object(placement, "WHOLE_LEAF_BYTES", 0),
            ):  # (every leaf through the ring: none put whole)
                out = jaxckpt.restore(path, target=target(other, lambda k, s: random_spec(s, rng)))
            assert ring._ring is not None and not ring._ring.pinned
            ring._ring.region[:] = 0xA5  # nothing restored lives in the ring
            check(out, "ring")
            with mock.patch.dict(os.environ, accelerator):  # small leaves put whole
                out = jaxckpt.restore(path, target=target(other, lambda k, s: random_spec(s, rng)))
            ring._ring.region[:] = 0x5A
            check(out, "ring, small leaves whole")
    elif mode == "manager":
        with jaxckpt.CheckpointManager(path) as mgr:
            mgr.save(1, state(mesh))
            mgr.wait_until_finished()
            check(mgr.restore(1, target=target(mesh, saved_spec)), "manager")
    elif mode == "emergency":
        opts = emergency_options(60)
        local = os.path.join(path, f"local{pid}")
        with jaxckpt.EmergencyCheckpointManager(local, os.path.join(path, "remote"), opts) as m:
            m.save(1, state(mesh))
        multihost_utils.sync_global_devices("saved")
        if pid == n - 1:
            shutil.rmtree(local)
        multihost_utils.sync_global_devices("wiped")
        with (
            jaxckpt.EmergencyCheckpointManager(local, os.path.join(path, "remote"), opts) as m,
            iostats.counting_maps() as maps,
        ):
            out = m.restore(target=target(mesh, saved_spec))
            report = m.last_report
        assert report is not None and report.step == 1, report
        if pid != n - 1:  # its own copies on its disk: the large slices mapped from them
            assert maps[0] or not set(MAPPED) & {d.name for d in dtypes()}, "nothing mapped"
        check(out, f"emergency ({report.tier})")
        print("REPORT", report, flush=True)
    elif mode == "export":  # parameters as NumPy values and as arrays on another mesh
        narrow = frozenset({"int1", "uint1", "int2", "uint2"})  # jax.export can't store them
        exp = {k: v for k, v in expected().items() if k.split("/")[0] not in narrow}
        other = jax.make_mesh((jax.device_count() // n, n), ("data", "model"))
        arrays = {
            k: jax.make_array_from_callback(
                v.shape, NamedSharding(other, LAYOUT[k][2]), lambda i, v=v: v[i]
            )
            for k, v in exp.items()
        }
        for name, params in (("numpy", exp), ("arrays", arrays)):
            jaxckpt.export.save(
                os.path.join(path, name),
                lambda p, x: x,
                nest(params),
                jax.ShapeDtypeStruct((4,), np.float32),
                mesh=mesh,
                in_specs=(P(),),
                out_specs=P(),
            )
            check(jaxckpt.restore(os.path.join(path, name, "params")), f"export {name}", narrow)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("ok", mode, pid, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
