"""Checkpoints written by orbax-checkpoint itself, read by jaxckpt (no orbax at run time)."""

import os

import jax
import multiproc
import numpy as np
import orbax_states
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt.errors import OrbaxFormatError

ocp = pytest.importorskip("orbax.checkpoint")
HERE = os.path.dirname(__file__)


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(x), tree)


def _assert_same(a, b):
    la, lb = jax.tree.leaves(_host(a)), jax.tree.leaves(_host(b))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def _abstract(state, mesh):
    """The TrainState's arrays as ShapeDtypeStructs on ``mesh`` (saved specs, or a
    replicated 0-d ``step``/``count``)."""

    def sds(x):
        if not isinstance(x, jax.Array):
            return x
        spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    return jax.tree.map(sds, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("orbax")
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    state = orbax_states.train_state(mesh)
    with ocp.StandardCheckpointer() as standard:  # default options; waits on exit
        standard.save(root / "standard", state)
    ckptr = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    ckptr.save(root / "per_array", args=ocp.args.PyTreeSave(state))
    zarr3 = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_zarr3=True))
    zarr3.save(root / "zarr3", args=ocp.args.PyTreeSave(state))
    mgr = ocp.CheckpointManager(root / "manager")
    mgr.save(7, args=ocp.args.StandardSave(state))
    mgr.wait_until_finished()
    return root, state


@pytest.mark.parametrize("layout", ["standard", "per_array", "zarr3", "manager/7"])
def test_orbax_train_state_restores_onto_other_meshes_and_as_numpy(saved, layout):
    root, state = saved
    path = root / layout
    for shape in ((2, 4), (2, 2)):
        devices = jax.devices()[: shape[0] * shape[1]]
        mesh = jax.make_mesh(shape, ("data", "model"), devices=devices)
        out = jaxckpt.restore(path, target=_abstract(state, mesh))
        _assert_same(out, state)
        kernel = out.params["Dense_0"]["kernel"]
        assert kernel.sharding.mesh.devices.shape == shape and kernel.sharding.spec == P(
            "data", "model"
        )
        assert int(out.step) == int(state.step)
        bound = jaxckpt.restore(path, mesh=mesh)  # no target: the saved specs on this mesh
        kernel = bound["params"]["Dense_0"]["kernel"]  # a dict: compare leaf by leaf name
        _assert_same(bound["params"], state.params)
        assert kernel.sharding.mesh.devices.shape == shape
    as_numpy = jaxckpt.restore(path, target=jax.tree.map(np.asarray, state))
    _assert_same(as_numpy, state)
    assert isinstance(as_numpy.params["Dense_1"]["kernel"], np.ndarray)


def test_metadata_matches_orbax(saved):
    root, _ = saved
    ours = jaxckpt.metadata(root / "standard")
    theirs = ocp.StandardCheckpointer().metadata(root / "standard").item_metadata.tree
    flat_theirs = {
        tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v
        for p, v in jax.tree_util.tree_flatten_with_path(theirs)[0]
    }
    flat_ours = {
        tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in p): v
        for p, v in jax.tree_util.tree_flatten_with_path(ours)[0]
    }
    arrays = {
        k: v
        for k, v in flat_theirs.items()
        if getattr(v, "shape", None) is not None and hasattr(v, "dtype")
    }
    assert arrays
    for key, meta in arrays.items():
        mine = flat_ours[key]
        assert tuple(mine.shape) == tuple(meta.shape), key
        assert np.dtype(mine.dtype) == np.dtype(meta.dtype), key


@pytest.mark.slow
def test_two_process_orbax_save_restores_in_one_process(tmp_path):
    worker = os.path.join(HERE, "workers", "orbax_save.py")
    multiproc.run(worker, 2, devices_per_process=4, args=[str(tmp_path / "c")]).check()
    assert any(n.startswith("ocdbt.process_") for n in os.listdir(tmp_path / "c"))
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    want = orbax_states.train_state(jax.make_mesh((2, 4), ("data", "model")))
    out = jaxckpt.restore(tmp_path / "c", target=_abstract(want, mesh))
    _assert_same(out, want)


def test_orbax_step_with_several_items_is_refused(tmp_path):
    mgr = ocp.CheckpointManager(tmp_path / "m", item_names=("a", "b"))
    x = {"w": np.ones(4, np.float32)}
    mgr.save(1, args=ocp.args.Composite(a=ocp.args.StandardSave(x), b=ocp.args.StandardSave(x)))
    mgr.wait_until_finished()
    with pytest.raises(OrbaxFormatError, match=r"items \['a', 'b'\].*pass the item's directory"):
        jaxckpt.restore(tmp_path / "m" / "1")
    out = jaxckpt.restore(tmp_path / "m" / "1" / "a")
    assert np.asarray(out["w"]).tolist() == [1.0] * 4
