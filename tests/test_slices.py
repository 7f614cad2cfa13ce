"""The one way slices are read (jaxckpt/_src/io/slices.py): both restores go through it, a
corrupt chunk is named one way through either, and the read budget holds through either."""

import dataclasses
import functools
import os
import re
from typing import TypeVar
from urllib.parse import urlparse

import jax
import numpy as np
import pytest
from conftest import flip_a_chunk_byte, sharded
from hostile import DTYPES, assert_same_bits, random_bits

import jaxckpt
from jaxckpt._src.emergency import local
from jaxckpt._src.io import inflight, slices
from jaxckpt._src.storage import location
from jaxckpt.errors import ChecksumError

T = TypeVar("T")


@pytest.fixture
def calls(monkeypatch):
    """Every call of ``slices.read`` (the real one runs): its database, requests and
    budget, seen from outside the restores."""
    seen: list[tuple[str, int, int | None]] = []
    real = slices.read

    def spying(db, requests, open_leaf, **kw):
        seen.append((db.url, len(requests), kw.get("budget")))
        return real(db, requests, open_leaf, **kw)

    monkeypatch.setattr(slices, "read", spying)
    return seen


@pytest.fixture
def peak(monkeypatch):
    """The most bytes read but not yet consumed at any moment of any read (``InFlight``
    watched from outside: its bytes held after each read is started), and each read's size."""
    seen = {"held": 0, "largest": 0}

    class Watched(inflight.InFlight[T]):
        def add(self, nbytes, start, use, what=None):
            super().add(nbytes, start, use, what)
            seen["held"] = max(seen["held"], self._held)
            seen["largest"] = max(seen["largest"], nbytes)

    monkeypatch.setattr(slices, "InFlight", Watched)
    return seen


def _tree(mesh):
    """Random bit patterns of every dtype (NaN payloads, sub-byte kinds), sharded, replicated
    and split over the other axis: the slices the budget tests bound are at most 16 KiB."""
    rng = np.random.default_rng(4)
    specs = [("data",), (), (None, "model")]
    tree = {
        d.name: sharded(random_bits((64, 16), d, rng), mesh, specs[i % len(specs)])
        for i, d in enumerate(DTYPES)
    }
    tree["w"] = sharded(random_bits((256, 64), np.dtype(np.float32), rng), mesh, ("data",))
    return tree


def _same(want, got, where):
    assert_same_bits(np.asarray(want), np.asarray(got), where)


def _emergency_step(root, mesh):
    """A real local step written by the emergency manager (one process), and its record."""
    opts = jaxckpt.EmergencyOptions(
        local_interval_steps=1, remote=jaxckpt.Options(save_interval_steps=100)
    )
    tree = _tree(mesh)
    with jaxckpt.EmergencyCheckpointManager(root / "l", root / "r", opts) as mgr:
        mgr.save(5, tree)
        mgr.wait_until_finished()
    step = local.read_step(location(root / "l"), 5)
    assert step is not None
    return tree, step


def test_a_corrupt_chunk_fails_a_restore_naming_leaf_chunk_and_file(tmp_path, mesh42, calls):
    tree = _tree(mesh42)
    jaxckpt.save(tmp_path / "c", tree, chunk_bytes=4096)
    flipped, _ = flip_a_chunk_byte(tmp_path / "c")
    with pytest.raises(ChecksumError) as info:
        jaxckpt.restore(tmp_path / "c", target=jax.tree.map(lambda a: a.sharding, tree))
    text = str(info.value)
    assert "failed its CRC32C check" in text and flipped in text, text
    assert "leaf '" in text and "chunk '" in text and "written by process 0" in text, text
    assert len(calls) == 1 and calls[0][0].endswith("/c/arrays")  # through the front door


def test_a_corrupt_chunk_fails_an_emergency_read_in_the_same_words(tmp_path, mesh42, calls):
    """The emergency tier counts a failed copy as missing (never uses its data) and reads
    on; the reason is the front door's error, worded as a restore's."""
    tree, step = _emergency_step(tmp_path, mesh42)
    flipped, _ = flip_a_chunk_byte(tmp_path / "l" / "00000005")
    calls.clear()
    got, _, bad = local.read_slices(step, step.held)
    assert len(calls) == 1 and calls[0][0].endswith("/00000005/arrays")
    assert bad, "the flipped chunk's slice must fail"
    for key, why in bad:
        assert key not in got
        assert why.startswith("ChecksumError: leaf ") and "failed its CRC32C check" in why, why
        assert flipped in why, why
    assert len(got) + len(bad) == len(step.held)  # the other slices were read on
    for key, data in got.items():  # and exactly
        want = np.asarray(tree[key.leaf])[tuple(slice(a, b) for a, b in key.box)]
        _same(want, data.view(want.dtype), str(key))


def test_a_restore_keeps_its_read_budget(tmp_path, mesh42, calls, peak):
    tree = _tree(mesh42)
    jaxckpt.save(tmp_path / "c", tree, chunk_bytes=4096)
    budget = 40 << 10  # a few slices: later reads wait for earlier ones to be used
    target = jax.tree.map(lambda a: a.sharding, tree)
    out = jaxckpt.restore(tmp_path / "c", target=target, read_budget_bytes=budget)
    for k, v in tree.items():
        _same(v, out[k], k)
    assert calls[0][2] == budget
    assert 0 < peak["held"] <= max(budget, peak["largest"])
    assert peak["largest"] < budget  # (so the budget, not one slice, bounded the reads)


def test_an_emergency_read_keeps_its_read_budget(tmp_path, mesh42, calls, peak):
    tree, step = _emergency_step(tmp_path, mesh42)
    calls.clear()
    budget = 40 << 10
    got, _, bad = local.read_slices(step, step.held, budget=budget)
    assert not bad and len(got) == len(step.held)
    assert calls[0][2] == budget
    assert 0 < peak["held"] <= max(budget, peak["largest"])
    assert peak["largest"] < budget
    for key, data in got.items():
        want = np.asarray(tree[key.leaf])[tuple(slice(a, b) for a, b in key.box)]
        _same(want, data.view(want.dtype), str(key))


def test_fits_takes_a_buffer_only_as_it_is_read():
    f32, u32 = np.dtype(np.float32), np.dtype(np.uint32)
    buf = np.zeros((4, 2), f32)
    assert slices.fits(buf, (4, 2), f32, f32) is buf
    assert slices.fits(buf, (4, 2), u32, f32).dtype == u32  # the saved dtype's carrier
    assert slices.fits(buf, (2, 4), f32, f32) is None  # another shape
    assert slices.fits(buf.T, (2, 4), f32, f32) is None  # not C-contiguous
    assert slices.fits(buf, (4, 2), np.dtype(np.int32), np.dtype(np.int32)) is None
    assert slices.fits(None, (4, 2), f32, f32) is None


@pytest.mark.slow
def test_a_stalled_read_fails_the_job_within_the_bound_naming_process_and_object(s3_url):
    """Two processes restore from S3 through a proxy that never answers the one ranged GET
    of process 1's chunk: process 1 fails after the stall bound, naming itself, its host,
    the data file and the chunk; process 0, waiting at the restore's barrier, fails at once
    naming process 1, long before the barrier's own timeout."""
    import multiproc
    import tensorstore as ts
    from faultproxy import FaultProxy

    from jaxckpt._src.io import arrays

    w = np.arange(64 * 256, dtype=np.float32).reshape(64, 256)
    mesh = jax.make_mesh((2,), ("d",))
    jaxckpt.save(s3_url, {"w": sharded(w, mesh, ("d",))})  # chunks w/c/0/0, w/c/1/0
    db = arrays.database_dir(location(s3_url), None)
    base = ts.KvStore.open(db.kvstore()).result()
    stalled = arrays.chunk_bytes(base, db, {"w/c/1/0"})["w/c/1/0"]  # process 1's rows
    obj = urlparse(stalled.file).path  # /<key> of the data file (bucket: its host)

    def decide(method, path, headers):
        ranged = {k.lower(): v for k, v in headers.items()}.get("range", "")
        stall = (
            method == "GET" and path.endswith(obj) and ranged.startswith(f"bytes={stalled.start}-")
        )
        return "stall" if stall else None

    moto = urlparse(os.environ["AWS_ENDPOINT_URL"])
    worker = os.path.join(os.path.dirname(__file__), "workers", "stall_job.py")
    stall_s, timeout_s = 2.0, 60.0
    with FaultProxy((moto.hostname, moto.port), decide=decide) as proxy:
        job = multiproc.run(
            worker,
            2,
            devices_per_process=1,
            args=[s3_url, str(stall_s), str(timeout_s)],
            env={"AWS_ENDPOINT_URL": proxy.endpoint},
            timeout_s=90,
        )
    assert proxy.injected["stall"] >= 1
    assert job.returncodes == [3, 3], job.outputs
    p0, p1 = job.outputs
    took = [float(re.search(r"failed \w+ after ([\d.]+)s", out).group(1)) for out in job.outputs]
    assert "failed ReadStalledError" in p1 and "process 1 of 2 (host h1)" in p1, p1
    assert stalled.file in p1 and "'w/c/1/0'" in p1 and "stall_timeout_s=2" in p1, p1
    assert "failed CoordinationError" in p0, p0
    assert "process 1 (host h1) failed instead of reaching barrier" in p0, p0
    assert stalled.file in p0, p0  # the stalled process's error, passed on
    assert stall_s <= took[1] < stall_s + 15 and took[0] < stall_s + 15 < timeout_s, took


def test_slices_of_a_few_mib_are_read_in_groups_each_failing_by_itself(
    tmp_path, mesh42, monkeypatch
):
    """Slices of whole chunks larger than the reader's batch of small ones go to the threads
    several at a time (``_groups``: one task, one entry of the budget, at most
    ``GROUP_BYTES``); each slice still gets its own bytes, and a corrupt chunk fails only
    its own slice, named by its own chunk, while the others of its group are handed on."""
    import tensorstore as ts
    from conftest import flip_byte

    from jaxckpt._src.io import arrays, direct
    from jaxckpt._src.readers import any_manifest

    rows = 1024  # 16 chunks and slices of 1 MiB: two groups of 8
    x = random_bits((16 * rows, 256), np.dtype(np.float32), np.random.default_rng(7))
    jaxckpt.save(tmp_path / "c", {"x": sharded(x, mesh42, ("data",))}, chunk_bytes=rows * 1024)
    loc = location(str(tmp_path / "c"))
    _, manifest = any_manifest(loc)
    (rec,) = [leaf for leaf in manifest.leaves if leaf.name == "x"]
    db = arrays.database_dir(loc, None)
    kv = ts.KvStore.open(arrays.kvstore_spec(db), context=arrays.new_context()).result()
    at = arrays.chunk_bytes(kv.base, db, {"x/c/5/0"})["x/c/5/0"]
    flip_byte(at.file, (at.start + at.stop) // 2)

    groups: list[int] = []
    real = direct.Reader.start_group

    def start_group(self, items):
        groups.append(len(items))
        return real(self, items)

    monkeypatch.setattr(direct.Reader, "start_group", start_group)
    got: dict[int, np.ndarray] = {}
    bad: dict[int, Exception] = {}
    requests = [
        slices.Request(
            rec,
            ((k * rows, (k + 1) * rows), (0, 256)),
            lambda data, copies, k=k: got.__setitem__(k, np.array(data)),
        )
        for k in range(16)
    ]
    opener = functools.partial(arrays.open_leaf, db, ctx=arrays.new_context())
    slices.read(db, requests, opener, failed=lambda r, e: bad.__setitem__(r.index[0][0] // rows, e))
    assert groups == [8, 8]
    assert list(bad) == [5] and isinstance(bad[5], ChecksumError), bad
    assert "'x/c/5/0'" in str(bad[5]) and at.file in str(bad[5]), bad[5]
    assert sorted(got) == [k for k in range(16) if k != 5]
    for k, data in got.items():
        _same(x[k * rows : (k + 1) * rows], data, f"slice {k}")


def test_a_slice_whose_memory_cant_be_had_fails_alone_in_its_group(tmp_path, mesh42, monkeypatch):
    """Slices of two leaves that cut through chunks read as one group; no buffer can be had
    for leaf 'b' (a MemoryError): its slices fail, each named by 'b', and those of 'a' are
    read and handed on, bit for bit. Where the whole group fails after 'b's buffers were
    refused, 'b's slices still fail with their own error."""
    from jaxckpt._src.io import arrays, direct
    from jaxckpt._src.readers import any_manifest

    rng = np.random.default_rng(0)
    xs = {
        "a": random_bits((64, 96), np.dtype(np.float32), rng),
        "b": random_bits((64, 96), np.dtype(np.float16), rng),
    }
    jaxckpt.save(
        tmp_path / "c", {k: sharded(v, mesh42, ("data",)) for k, v in xs.items()}, chunk_bytes=2048
    )
    loc = location(str(tmp_path / "c"))
    recs = {leaf.name: leaf for leaf in any_manifest(loc)[1].leaves}
    db = arrays.database_dir(loc, None)
    real = arrays.aligned_empty

    def failing(shape, dtype, *args, **kwargs):
        if np.dtype(dtype) == np.float16:
            raise MemoryError("no memory for a float16 buffer")
        return real(shape, dtype, *args, **kwargs)

    monkeypatch.setattr(arrays, "aligned_empty", failing)
    got: dict = {}
    bad: dict = {}
    requests = [
        slices.Request(
            recs[n], ((0, 64), (c, c + 7)), lambda d, _, k=(n, c): got.__setitem__(k, np.array(d))
        )
        for n in ("a", "b")
        for c in (0, 7, 14, 21)
    ]
    opener = functools.partial(arrays.open_leaf, db, ctx=arrays.new_context())
    slices.read(
        db, requests, opener, failed=lambda r, e: bad.__setitem__((r.leaf.name, r.index[1][0]), e)
    )
    assert sorted(got) == [("a", c) for c in (0, 7, 14, 21)]
    for (n, c), data in got.items():
        _same(xs[n][:, c : c + 7], data, f"{n} {c}")
    assert sorted(bad) == [("b", c) for c in (0, 7, 14, 21)]
    assert all("leaf 'b'" in str(e) and "no memory" in str(e) for e in bad.values()), bad

    # 'b's buffers refused by the ring (``stage``) before the group starts, and the whole
    # group failing after: each slice of 'b' fails with its own error, each of 'a' the group's
    def no_slot(nbytes: int) -> np.ndarray:
        raise MemoryError("no ring slot for 'b'")

    def broken(self, items):
        raise OSError("the reader's threads are gone")

    monkeypatch.setattr(direct.Reader, "start_group", broken)
    staged = [dataclasses.replace(r, stage=no_slot) if r.leaf.name == "b" else r for r in requests]
    bad.clear()
    slices.read(
        db, staged, opener, failed=lambda r, e: bad.__setitem__((r.leaf.name, r.index[1][0]), e)
    )
    assert len(bad) == 8, bad
    for (n, _), e in bad.items():
        assert f"leaf {n!r}" in str(e), e
        assert ("no ring slot" if n == "b" else "threads are gone") in str(e), e


def _fake(sizes_and_keys: list[tuple[int, set[str]]]) -> tuple[list, dict]:
    """Requests of those sizes whose plans need parts of those chunks (``_groups``' view)."""
    from types import SimpleNamespace as NS

    requests = [NS(nbytes=n) for n, _ in sizes_and_keys]
    plans = {
        i: NS(parts=[NS(key=k) for k in sorted(ks)]) for i, (_, ks) in enumerate(sizes_and_keys)
    }
    return requests, plans


def test_a_group_ends_before_the_slices_that_need_the_next_ones_chunks():
    """Six slices of 8 KiB on a (3, 2) mesh over 8 row chunks: each pair needs the same
    chunks (the rows' two column halves), and each pair shares a chunk with the next. A
    group may hold 5 of them; it ends after the second pair, not inside the third, which
    goes on together: 9 chunk reads, not 11 (found by a review: the greedy end split the
    last pair; half the budget read 10)."""
    a, b, c = {"0", "1", "2"}, {"2", "3", "4", "5"}, {"5", "6", "7"}
    requests, plans = _fake([(8192, a), (8192, a), (8192, b), (8192, b), (8192, c), (8192, c)])
    groups = [g for g, _ in slices._groups(requests, plans, set(), 10739, 42958)]
    assert groups == [[0, 1, 2, 3], [4, 5]], groups
    reads = sum(len({p.key for i in g for p in plans[i].parts}) for g in groups)
    assert reads == 6 + 3
    # the pair goes on together only where it fits the cap with the next slice
    groups = [g for g, _ in slices._groups(requests, plans, set(), 10739, 16384)]
    assert groups == [[0, 1], [2, 3], [4, 5]], groups
    big = [(8192, a), (8192, c), (8192, c), (8192, c)]  # three that need c, past a cap of 16 KiB
    requests, plans = _fake(big)
    groups = [g for g, _ in slices._groups(requests, plans, set(), 4096, 16384)]
    assert groups == [[0], [1, 2], [3]], groups


def _half_budget_groups(requests: list, plans: dict, limit: int, cap: int) -> list[list[int]]:
    """The grouping before groups could take the whole budget (e4e367e): greedy, a group of
    slices that share chunks going on up to half the budget (every request here has parts)."""
    groups: list[list[int]] = [[]]
    keys: set[str] = set()
    size = 0
    for i, r in enumerate(requests):
        mine = {p.key for p in plans[i].parts}
        if groups[-1] and size + r.nbytes > limit and not (keys & mine and size + r.nbytes <= cap):
            groups.append([])
            keys, size = set(), 0
        groups[-1].append(i)
        size += r.nbytes
        keys |= mine
    return groups


def test_groups_never_read_more_chunks_than_half_budget_groups_did():
    """Random 2-D layouts (chunk grids and slice grids, in row or column order) and budgets:
    the bytes of chunks the groups read, each chunk once a group, are never more than with
    groups of at most half the budget (the rule before), and less in some."""
    rng = np.random.default_rng(0)
    fewer = 0
    for _ in range(3000):
        gh, gw, nh, nw = (int(x) for x in rng.integers(1, 5, 4))
        h, w = int(np.lcm(gh, nh)) * int(rng.integers(1, 3)), int(np.lcm(gw, nw)) * 2
        ch, cw, sh, sw, scale = h // gh, w // gw, h // nh, w // nw, 1 << 10
        order = [(i, j) for i in range(nh) for j in range(nw)]
        if rng.random() < 0.5:
            order = sorted(order, key=lambda ij: (ij[1], ij[0]))
        layout = [
            (sh * sw * scale, {f"{a}.{b}" for a in range(i * sh // ch, -(-(i + 1) * sh // ch))
                               for b in range(j * sw // cw, -(-(j + 1) * sw // cw))})
            for i, j in order
        ]  # fmt: skip
        requests, plans = _fake(layout)
        budget = int(np.exp(rng.uniform(np.log(4096), np.log(1 << 24))))
        limit = min(slices.GROUP_BYTES, budget // 4)

        def read(groups: list[list[int]], plans: dict = plans, chunk: int = ch * cw * scale) -> int:
            return sum(chunk * len({p.key for i in g for p in plans[i].parts}) for g in groups)

        now = read([g for g, _ in slices._groups(requests, plans, set(), limit, budget)])
        before = read(_half_budget_groups(requests, plans, limit, budget // 2))
        assert now <= before, (layout, budget, now, before)
        fewer += now < before
    assert fewer > 0
