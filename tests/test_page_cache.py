"""drop_page_cache: a save's local files leave the page cache as they are written (checked
with mincore, the kernel's own account of which pages of a file are cached), and what was
saved still restores bit-exact."""

import ctypes
import dataclasses
import mmap
import os
import shutil

import numpy as np
import pytest
from conftest import assert_tree_equal, sharded
from hostile import DTYPES, assert_same_bits, random_bits
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src import saving
from jaxckpt._src.io import linux, page_cache

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


def save(path, tree, **writes) -> None:
    """``jaxckpt.save`` with the page-cache choices a manager's ``Options`` make."""
    saving.commit(saving.prepare(path, tree, writes=saving.Writes(**writes)))


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
    save(tmp_path / "kept", state, direct_io=False)  # (None: O_DIRECT on a disk)
    save(tmp_path / "dropped", state, drop_page_cache=True, direct_io=False)
    kept, total = cached_under(tmp_path / "kept" / "arrays")
    dropped, same = cached_under(tmp_path / "dropped" / "arrays")
    assert abs(total - same) < 1024 and same > 512 << 10 and kept >= total // 2
    # at most a page or so of the small files written last (the OCDBT manifest)
    assert dropped <= 16 << 10, f"{dropped} of {same} bytes still cached"
    assert_tree_equal(jaxckpt.restore(tmp_path / "dropped"), state)


def test_managers_pass_drop_page_cache_on(tmp_path, mesh42):
    state = {"w": sharded(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), mesh42, P())}
    opts = jaxckpt.Options(drop_page_cache=True, direct_io=False, run_log=False)
    with jaxckpt.CheckpointManager(tmp_path / "dir", opts) as mgr:
        mgr.save(1, state)
    assert cached_under(tmp_path / "dir")[0] < 16 << 10  # the small files written after
    remote = dataclasses.replace(opts, save_interval_steps=1)  # the remote tier's own
    eopts = jaxckpt.EmergencyOptions(
        1, drop_page_cache=True, direct_io=False, run_log=False, remote=remote
    )
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
    save(tmp_path / "c", tree, drop_page_cache=True, direct_io=False)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert_same_bits(x, np.asarray(out["x"]), f"{dtype} sharded")
    assert_same_bits(x[:8], out["n"], f"{dtype} numpy")


# --- where a save uses O_DIRECT by default ---------------------------------------------------

MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 254:0 / / rw,relatime - ext4 /dev/vda rw,discard
25 24 0:23 / /dev/shm rw,relatime - tmpfs tmpfs rw,size=24684084k
40 27 0:40 / /mnt/ckpt rw,relatime shared:5 - nfs4 srv:/export rw,vers=4.2
41 40 8:16 / /mnt/ckpt/local rw,relatime - xfs /dev/sdb rw
42 27 8:17 / /mnt/my\040disk rw,relatime master:3 - btrfs /dev/sdc rw
43 27 0:50 / /mnt/ckpt2 rw - fuse.gcsfuse bucket rw
44 27 8:18 / /mnt/ckpt2 rw - ext4 /dev/sdd rw
not a mount line
"""


@pytest.mark.parametrize(
    "path,fstype",
    [
        ("/", "ext4"),
        ("/home/me/run", "ext4"),
        ("/proc/self", "proc"),
        ("/dev/shm/x", "tmpfs"),
        ("/mnt/ckpt", "nfs4"),
        ("/mnt/ckpt/step_1", "nfs4"),
        ("/mnt/ckpt/local/step_1", "xfs"),  # the mount below the NFS one
        ("/mnt/ckpt/localx", "nfs4"),  # a name that starts like a mount point is not in it
        ("/mnt/my disk/run", "btrfs"),  # mountinfo writes the space as \040
        ("/mnt/ckpt2/a", "ext4"),  # mounted over: the last mount of a point is the one seen
    ],
)
def test_the_filesystem_of_a_path_is_its_deepest_mount(path, fstype):
    assert linux.mount_type(MOUNTINFO, path) == fstype


def test_o_direct_by_default_on_disk_filesystems_only(tmp_path):
    assert linux.mount_type("", "/a") is None
    assert page_cache.direct_io("/dev/shm/run", True) is True  # asked: as asked
    assert page_cache.direct_io(str(tmp_path), False) is False
    fstype = linux.filesystem(str(tmp_path / "not" / "made" / "yet"))
    assert fstype is not None  # (Linux: /proc/self/mountinfo)
    assert page_cache.direct_io(str(tmp_path), None) == (fstype in linux.DIRECT_IO_FILESYSTEMS)
    if linux.filesystem("/dev/shm") == "tmpfs":
        assert page_cache.direct_io("/dev/shm/run", None) is False


def test_a_plain_save_writes_with_o_direct_where_its_filesystem_takes_it(
    tmp_path, mesh42, o_direct_opens
):
    """``direct_io`` None (the default): O_DIRECT on ext4/xfs/btrfs, then only each data
    file's last part block went through the page cache (mincore); the page cache elsewhere
    (tmpfs: /dev/shm). False: never. The bytes restore exactly either way."""
    x = random_bits((512, 512), np.dtype(np.float32), np.random.default_rng(4))  # 1 MiB
    tree = {"w": sharded(x, mesh42, P("data", "model")), "b": x[:3]}
    opened = o_direct_opens
    jaxckpt.save(tmp_path / "default", tree)
    disk = linux.filesystem(str(tmp_path)) in linux.DIRECT_IO_FILESYSTEMS
    data = tmp_path / "default" / "arrays" / "d"
    if disk and hasattr(os, "O_DIRECT"):
        # (written under the step's temporary name, then renamed)
        assert opened and all(
            p.startswith(str(tmp_path / "default")) and "/arrays/d/" in p for p in opened
        ), opened
        assert cached_under(data)[0] <= 4096 * len(os.listdir(data))
    else:
        assert opened == []
    opened.clear()
    save(tmp_path / "off", tree, direct_io=False)
    assert opened == []
    tmpfs = linux.filesystem("/dev/shm") == "tmpfs" and os.access("/dev/shm", os.W_OK)
    shm = "/dev/shm" if tmpfs else None
    if shm is not None:
        d = os.path.join(shm, f"jaxckpt-test-{os.getpid()}")
        try:
            jaxckpt.save(d, tree)
            assert opened == []
            assert_tree_equal(jaxckpt.restore(d, target=tree), tree)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    for name in ("default", "off"):
        assert_tree_equal(jaxckpt.restore(tmp_path / name, target=tree), tree)


def test_the_emergency_local_tier_keeps_the_page_cache_by_default(tmp_path, mesh42, o_direct_opens):
    """EmergencyOptions' None: the local tier through the page cache (a restarted process
    reads its step back from memory); the remote tier as its Options say (None: O_DIRECT on a
    disk filesystem)."""
    x = random_bits((64, 32), np.dtype(np.float32), np.random.default_rng(5))
    tree = {"x": sharded(x, mesh42, P("data", "model"))}
    opened = o_direct_opens
    o = jaxckpt.EmergencyOptions(
        local_interval_steps=1, run_log=False, remote=jaxckpt.Options(save_interval_steps=1)
    )
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        assert_tree_equal(mgr.restore(target=tree), tree)
    assert not any(p.startswith(str(tmp_path / "l")) for p in opened), opened
    remote = any(p.startswith(str(tmp_path / "r")) for p in opened)
    disk = linux.filesystem(str(tmp_path)) in linux.DIRECT_IO_FILESYSTEMS
    assert remote == (disk and hasattr(os, "O_DIRECT")), opened
