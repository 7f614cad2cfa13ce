"""The cyclic garbage collector paused during restores and the saves a caller waits for
(jaxckpt/_src/gc_pause.py): off inside, as it was after (errors, nesting and threads
included), and many-leaf restores and saves run no collections."""

import gc
import threading

import jax
import numpy as np
import pytest
from hostile import assert_same_bits, random_bits

import jaxckpt
from jaxckpt._src import gc_pause


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_off_inside_and_back_after_even_on_errors(collector_on):
    with gc_pause.paused():
        assert not gc.isenabled()
        with gc_pause.paused():  # nested
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), gc_pause.paused():
        raise ValueError("a failed restore")
    assert gc.isenabled()


def test_a_collector_the_caller_turned_off_stays_off(collector_on):
    gc.disable()
    with gc_pause.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_threads_overlapping_leave_it_on_only_when_the_last_exits(collector_on):
    inside, leave = threading.Event(), threading.Event()

    def other():
        with gc_pause.paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with gc_pause.paused():
        t.start()
        inside.wait(10)
    assert not gc.isenabled()  # the other thread is still inside
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_a_restore_of_many_leaves_runs_no_collection(collector_on, tmp_path):
    dev, rng = jax.devices()[0], np.random.default_rng(7)
    host = {f"w{i}": random_bits((4, 4), np.dtype("bfloat16"), rng) for i in range(400)}
    state = {k: jax.device_put(v, dev) for k, v in host.items()}
    jaxckpt.save(tmp_path / "c", state)
    like = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in state.items()
    }
    before = sum(s["collections"] for s in gc.get_stats())
    out = jaxckpt.restore(tmp_path / "c", like)
    ran = sum(s["collections"] for s in gc.get_stats()) - before
    assert ran <= 1, f"{ran} collections during a 400-leaf restore"  # 40 without the pause
    assert gc.isenabled()
    for k in ("w0", "w399"):
        assert_same_bits(host[k], np.asarray(out[k]), k)


def _state(n: int):
    dev, rng = jax.devices()[0], np.random.default_rng(8)
    host = {f"w{i}": random_bits((4, 4), np.dtype("float32"), rng) for i in range(n)}
    return host, {k: jax.device_put(v, dev) for k, v in host.items()}


def test_a_save_of_many_leaves_runs_no_collection(collector_on, tmp_path):
    """``jaxckpt.save`` (the caller waits) and a manager's synchronous save run with the
    collector paused, and leave it on; the bytes come back exact."""
    host, state = _state(400)
    mgr = jaxckpt.CheckpointManager(tmp_path / "m", jaxckpt.Options(async_save=False))
    for name, save in [
        ("save", lambda: jaxckpt.save(tmp_path / "c", state)),
        ("manager", lambda: mgr.save(1, state, force=True)),
    ]:
        before = sum(s["collections"] for s in gc.get_stats())
        save()
        ran = sum(s["collections"] for s in gc.get_stats()) - before
        assert ran <= 1, f"{ran} collections during a 400-leaf {name}"  # 22-28 without
        assert gc.isenabled()
    mgr.close()
    out = jaxckpt.restore(tmp_path / "c")
    for k in ("w0", "w399"):
        assert_same_bits(host[k], np.asarray(out[k]), k)
    got = jaxckpt.CheckpointManager(tmp_path / "m").restore(1)
    assert_same_bits(host["w7"], np.asarray(got["w7"]), "manager w7")
