"""drop_page_cache: a save's local files leave the page cache as they are written (checked
with mincore, the kernel's own account of which pages of a file are cached), and what was
saved still restores bit-exact."""

import ctypes
import mmap
import os

import numpy as np
import pytest
from conftest import assert_tree_equal, sharded
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src import page_cache

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="Linux only")
_libc = ctypes.CDLL(None, use_errno=True)


def cached_bytes(path) -> int:
    """Bytes of the file at ``path`` in the page cache (mincore over a private mapping)."""
    size = os.path.getsize(path)
    if not size:
        return 0
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(m)
        vec = (ctypes.c_ubyte * pages)()
        rc = _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), size, vec)
        assert rc == 0, os.strerror(ctypes.get_errno())
        del anchor
    finally:
        m.close()
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def cached_under(root) -> tuple[int, int]:
    """(bytes cached, bytes in files) under ``root``."""
    cached = total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            path = os.path.join(directory, name)
            cached += cached_bytes(path)
            total += os.path.getsize(path)
    return cached, total


def write_and_fsync(path, nbytes: int) -> None:
    block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(nbytes >> 20):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def test_dropping_leaves_nothing_of_the_files_cached(tmp_path):
    kept, dropped = tmp_path / "kept", tmp_path / "dropped"
    kept.mkdir()
    (dropped / "sub").mkdir(parents=True)
    write_and_fsync(kept / "a.bin", 16 << 20)
    with page_cache.dropping(str(dropped)):
        write_and_fsync(dropped / "a.bin", 16 << 20)
        write_and_fsync(dropped / "sub" / "b.bin", 8 << 20)  # below the root, made late
    assert cached_under(kept)[0] == 16 << 20  # written files stay cached by default
    assert cached_under(dropped) == (0, 24 << 20)
    with page_cache.dropping(str(tmp_path / "off"), enabled=False):
        pass  # nothing started, nothing to stop


def test_a_save_with_drop_page_cache_restores_exactly(tmp_path, mesh42):
    rng = np.random.default_rng(1)
    state = {
        "w": sharded(rng.integers(0, 2**32, (256, 512), dtype=np.uint32).view(np.float32),
                     mesh42, P("data", "model")),
        "b": rng.standard_normal(1000).astype(np.float32),
    }  # fmt: skip
    jaxckpt.save(tmp_path / "kept", state)
    jaxckpt.save(tmp_path / "dropped", state, drop_page_cache=True)
    kept, total = cached_under(tmp_path / "kept" / "arrays")
    dropped, same = cached_under(tmp_path / "dropped" / "arrays")
    assert abs(total - same) < 1024 and same > 512 << 10 and kept >= total // 2
    # at most a page or so of the small files written last (the OCDBT manifest)
    assert dropped <= 16 << 10, f"{dropped} of {same} bytes still cached"
    assert_tree_equal(jaxckpt.restore(tmp_path / "dropped"), state)


def test_managers_pass_drop_page_cache_on(tmp_path, mesh42):
    state = {"w": sharded(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), mesh42, P())}
    opts = jaxckpt.Options(drop_page_cache=True, run_log=False)
    with jaxckpt.CheckpointManager(tmp_path / "dir", opts) as mgr:
        mgr.save(1, state)
    assert cached_under(tmp_path / "dir")[0] < 16 << 10  # the small files written after
    eopts = jaxckpt.EmergencyOptions(1, 1, drop_page_cache=True, run_log=False)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", eopts) as mgr:
        mgr.save(1, state)
        mgr.wait_until_finished()
    for tier in ("l", "r"):
        cached, total = cached_under(tmp_path / tier)
        assert total > 64 * 64 * 4 and cached < 16 << 10, (tier, cached, total)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", eopts) as mgr:
        assert_tree_equal(mgr.restore(target=state), state)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_hostile_values_saved_with_drop_page_cache_restore_bit_exactly(
    dtype, x64, mesh42, tmp_path
):
    x = random_bits((64, 32), dtype, np.random.default_rng(3))
    tree = {"x": sharded(x, mesh42, P("data", "model")), "n": x[:8]}
    jaxckpt.save(tmp_path / "c", tree, drop_page_cache=True)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert_same_bits(x, np.asarray(out["x"]), f"{dtype} sharded")
    assert_same_bits(x[:8], out["n"], f"{dtype} numpy")
