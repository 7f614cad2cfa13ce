"""jaxckpt's own OCDBT writer: TensorStore reads every byte of what it writes back exactly;
the encodings are TensorStore's own, byte for byte; whatever it can't take goes to
TensorStore; with direct_io the files bypass the page cache."""

import itertools
import os
import types
import uuid

import iostats
import jax
import numpy as np
import pytest
import tensorstore as ts
from conftest import Calls, sharded
from hostile import DTYPES, assert_same_bits, bits, random_bits

import jaxckpt
from jaxckpt import errors
from jaxckpt._src import saving
from jaxckpt._src.io import arrays, layout, linux, ocdbt_write
from jaxckpt._src.storage import location


@pytest.fixture
def ts_writes(monkeypatch):
    """Counts TensorStore's writes (``arrays.write``), which ours replace."""
    return Calls(monkeypatch, arrays, "write")


def _read_with_tensorstore(path, name: str) -> np.ndarray:
    db = arrays.database_dir(location(str(path)), None)
    return (
        ts.open(arrays.array_spec(db, name), context=arrays.new_context()).result().read().result()
    )


def _one_leaf(name: str, x: np.ndarray, chunk: int, get=None) -> arrays.ArrayWrite:
    """A write of 1-D ``x`` as leaf ``name`` in chunks of ``chunk`` elements."""
    meta = arrays.zarr_metadata(x.shape, x.dtype.name, [chunk], None)
    return arrays.ArrayWrite(name, meta, [(((0, len(x)),), get or (lambda: x))], True, x.nbytes)


def _new_db(tmp_path):
    db = location(str(tmp_path / "db"))
    db.makedirs()
    return db


def _dtypes() -> list[np.dtype]:
    return [d for d in DTYPES if d.itemsize < 8 or jax.config.jax_enable_x64]


# --- encodings ------------------------------------------------------------------------------


def test_varints_are_uleb128():
    # values TensorStore wrote into a manifest: 1024 and 100_000_000 (its configuration)
    assert ocdbt_write.varint(0) == b"\x00"
    assert ocdbt_write.varint(127) == b"\x7f"
    assert ocdbt_write.varint(128) == b"\x80\x01"
    assert ocdbt_write.varint(1024) == b"\x80\x08"
    assert ocdbt_write.varint(100_000_000) == bytes.fromhex("80c2d72f")
    assert ocdbt_write.varint(2**64 - 1) == b"\xff" * 9 + b"\x01"


def test_a_leaf_node_is_byte_for_byte_the_one_tensorstore_writes(tmp_path):
    """TensorStore told to write uncompressed nodes: its leaf node of inline values is ours."""
    kv = {
        "driver": "ocdbt",
        "base": f"file://{tmp_path}/",
        "config": {"compression": None, "max_inline_value_bytes": 1024},
    }
    store = ts.KvStore.open(kv).result()
    entries = [(b"a/c/0/0", b"\x01" * 28), (b"a/c/1/0", b"\x02" * 300), (b"a/zarr.json", b"{}")]
    txn = ts.Transaction()
    for key, value in entries:
        store.with_transaction(txn).write(key, value).result()
    txn.commit_async().result()
    base = ts.KvStore.open(f"file://{tmp_path}/").result()
    root = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
    _, _, path, offset, length = root.split(":")
    with open(tmp_path / path, "rb") as f:
        f.seek(int(offset))
        theirs = f.read(int(length))
    assert ocdbt_write.leaf_node(entries, []) == theirs


# --- the contract with TensorStore, byte for byte -----------------------------------------------
#
# jaxckpt writes a format it does not own. These tests hold its encodings to TensorStore's own:
# TensorStore writes a database (or encodes a manifest) and jaxckpt's encoder is given the same
# content; the bytes must be equal. (tensorstore.ocdbt.dump decodes manifests and nodes;
# undump_manifest is TensorStore's manifest encoder; there is no encoder for B+tree nodes in
# TensorStore's Python API, so a node is compared with one TensorStore wrote to disk.)


def _location(loc: str) -> tuple[str, int, int]:
    """``"btreenode::d/<hex>:offset:length"`` (a dump's location): path, offset, length."""
    _, base_path, path, offset, length = loc.split(":")
    assert base_path == ""  # TensorStore's writes, like ours, have every base path empty
    return path, int(offset), int(length)


def _read_at(path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _dumped_manifest(encoded: bytes) -> dict:
    """TensorStore's decoding of a ``manifest.ocdbt`` (it needs no other file)."""
    kv = ts.KvStore.open("memory://").result()
    kv.write("manifest.ocdbt", encoded).result()
    return ts.ocdbt.dump(kv).result()


def _zstd_decoded(frame: bytes, nbytes: int) -> bytes:
    """A zstd frame decompressed by TensorStore itself (its zarr3 ``zstd`` codec: the test
    needs no zstd package), which must hold exactly ``nbytes``."""
    ctx = ts.Context()
    meta = {
        "shape": [nbytes],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [nbytes]}},
        "codecs": [{"name": "bytes"}, {"name": "zstd", "configuration": {"level": 0}}],
    }
    spec = {"driver": "zarr3", "kvstore": "memory://z/", "metadata": meta, "create": True}
    array = ts.open(spec, context=ctx).result()
    ts.KvStore.open("memory://z/", context=ctx).result().write("c/0", frame).result()
    return array.read().result().tobytes()


def _as_uncompressed(encoded: bytes, magic: int, nbytes: int) -> bytes:
    """A manifest or node TensorStore encoded with zstd (compression format 1), decompressed
    and framed again uncompressed, as jaxckpt writes them: header (magic, total length,
    version 0, compression 0), body, CRC32C of everything before it."""
    assert encoded[:4] == magic.to_bytes(4, "big")
    assert int.from_bytes(encoded[4:12], "little") == len(encoded)
    assert encoded[12:14] == b"\x00\x01"  # version 0, zstd
    return ocdbt_write.framed(magic, _zstd_decoded(encoded[14:-4], nbytes))


def test_the_manifest_is_byte_for_byte_the_one_tensorstore_writes(tmp_path, monkeypatch):
    """TensorStore writes a leaf (chunks of more than 1 KiB: out of line for it too, as every
    chunk is for us) into a new database configured as ``arrays.kvstore_spec`` configures
    jaxckpt's, in one atomic commit. ``ocdbt_write.manifest`` is then given that database's
    root node location and data file, the key count and out-of-line bytes of jaxckpt's own
    ``plan`` of the same leaf, and TensorStore's uuid and commit time (the two values that
    differ on every write). Compared: our ``manifest.ocdbt`` with TensorStore's, byte for
    byte, after TensorStore's body is decompressed (it zstd-compresses manifests as the
    configuration names; we write ours uncompressed, which the header says); and TensorStore's
    encoding of what it decodes from ours (``dump`` then ``undump_manifest``) with the file it
    wrote, byte for byte, compressed (with TensorStore 0.1.81 or later, which has
    ``undump_manifest``)."""
    x = np.arange(3000, dtype=np.uint16)
    write = _one_leaf("x", x, 700)  # 5 chunks of 1404 bytes with their CRC32C, one padded
    db = _new_db(tmp_path)
    ctx = arrays.new_context()
    txn = ts.Transaction(atomic=True)
    spec = {"driver": "zarr3", "kvstore": arrays.kvstore_spec(db), "metadata": write.metadata}
    out = ts.open({**spec, "create": True}, context=ctx, transaction=txn).result()
    out.write(x).result()
    txn.commit_async().result()
    theirs = (tmp_path / "db" / "manifest.ocdbt").read_bytes()
    dumped = ts.ocdbt.dump(ts.KvStore.open(db.kvstore()).result()).result()
    assert dumped["version_tree_nodes"] == []
    (version,) = dumped["versions"]  # one commit: one version, as ours
    assert version["generation_number"] == 1 and version["root_height"] == 0
    path, offset, length = _location(version["root"]["location"])

    planned = ocdbt_write.plan([write])
    assert planned is not None
    entries, _ = planned
    indirect = sum(v.length for _, v in entries if isinstance(v, ocdbt_write.Ref))
    assert (len(entries), indirect) == (6, 5 * 1404)
    assert version["root"]["statistics"] == {
        "num_keys": len(entries),
        "num_indirect_value_bytes": indirect,
        "num_tree_bytes": length,  # one node: the tree's bytes are the root's
    }
    uid = uuid.UUID(dumped["config"]["uuid"])
    monkeypatch.setattr(ocdbt_write, "uuid", types.SimpleNamespace(uuid4=lambda: uid))
    when = version["commit_time"]
    monkeypatch.setattr(ocdbt_write, "time", types.SimpleNamespace(time_ns=lambda: when))
    ours = ocdbt_write.manifest(ocdbt_write.Ref(0, offset, length), [path], len(entries), indirect)

    magic = ocdbt_write._MANIFEST_MAGIC
    assert ours == _as_uncompressed(theirs, magic, len(ours) - 18)
    if hasattr(ts.ocdbt, "undump_manifest"):  # (TensorStore 0.1.81 and later)
        assert ts.ocdbt.undump_manifest(_dumped_manifest(ours)) == theirs


def test_our_written_manifest_is_tensorstores_encoding_of_itself(tmp_path):
    """The ``manifest.ocdbt`` a save writes (``ocdbt_write.write``), decoded by TensorStore
    and encoded again by it (``dump``, ``undump_manifest``), is our file byte for byte once
    TensorStore's zstd body is decompressed: no field TensorStore would write differently,
    none it ignores, nothing after the last."""
    if not hasattr(ts.ocdbt, "undump_manifest"):
        pytest.skip("TensorStore before 0.1.81 has no manifest encoder (undump_manifest)")
    x = np.arange(5000, dtype=np.float32)
    db = _new_db(tmp_path)
    ocdbt_write.write(db, [_one_leaf("x", x, 1000)])
    ours = (tmp_path / "db" / "manifest.ocdbt").read_bytes()
    dumped = _dumped_manifest(ours)
    assert dumped["config"] == {
        **dumped["config"],
        "compression": {"id": "zstd"},
        "max_inline_value_bytes": arrays.OCDBT_CONFIG["max_inline_value_bytes"],
        "max_decoded_node_bytes": arrays.OCDBT_CONFIG["max_decoded_node_bytes"],
        "version_tree_arity_log2": 4,
    }
    reencoded = ts.ocdbt.undump_manifest(dumped)
    assert ours == _as_uncompressed(reencoded, ocdbt_write._MANIFEST_MAGIC, len(ours) - 18)


@pytest.mark.parametrize("file_bytes", [0, 1], ids=["one-data-file", "a-file-per-value"])
def test_a_leaf_node_of_out_of_line_values_is_byte_for_byte_tensorstores(tmp_path, file_bytes):
    """TensorStore told to write uncompressed nodes and to store values of more than 8 bytes
    out of line (short ``zarr.json``-like values inline, as ours are; chunks out of line, as
    all of ours are), in one commit, either into one data file (values back to back:
    offsets past 0) or into a data file per value (a node's table of several prefix-coded
    paths, as a save of more than 128 MiB has). ``leaf_node`` given the same keys, inline
    values and (file, offset, length) of each out-of-line value, with the files in the order
    of TensorStore's data file table (sorted by path: ``DataFileTableBuilder::Finalize`` in
    tensorstore/kvstore/ocdbt/format/data_file_id_codec.cc), makes TensorStore's node byte
    for byte."""
    kv = {
        "driver": "ocdbt",
        "base": f"file://{tmp_path}/",
        "config": {"compression": None, "max_inline_value_bytes": 8},
        "target_data_file_size": file_bytes,
    }
    store = ts.KvStore.open(kv).result()
    values = {
        b"a/c/0": b"\x01" * 28,
        b"a/c/1": bytes(range(256)) * 2,  # a length of two varint bytes
        b"a/zarr.json": b"{}",
        b"b/c/0/0": b"\x03" * 9,
        b"b/c/0/1": b"\x04" * 130,
        b"b/zarr.json": b'{"b":1}',
        b"long/" + b"k" * 200 + b"/c/0": b"\x05" * 40,  # a key length of two varint bytes
    }
    txn = ts.Transaction()
    for key, value in values.items():
        store.with_transaction(txn).write(key, value).result()
    txn.commit_async().result()
    base = ts.KvStore.open(f"file://{tmp_path}/").result()
    root = ts.ocdbt.dump(base).result()["versions"][-1]["root"]["location"]
    path, offset, length = _location(root)
    theirs = _read_at(tmp_path / path, offset, length)
    node = ts.ocdbt.dump(base, root).result()
    assert node["height"] == 0
    where = {
        e["key"]: _location(e["indirect_value"]) for e in node["entries"] if e.get("indirect_value")
    }
    assert sorted(where) == sorted(k for k, v in values.items() if len(v) > 8)
    files = sorted({p for p, _, _ in where.values()})
    assert len(files) == (1 if file_bytes == 0 else len(where))
    if file_bytes == 0:  # back to back: every offset but the first past 0
        assert len({o for _, o, _ in where.values()}) == len(where)
    refs = {k: ocdbt_write.Ref(files.index(p), o, n) for k, (p, o, n) in where.items()}
    entries = [(k, refs.get(k, v)) for k, v in sorted(values.items())]
    assert ocdbt_write.leaf_node(entries, files) == theirs
    for k, (p, o, n) in where.items():  # the refs are where TensorStore put the values
        assert _read_at(tmp_path / p, o, n) == values[k]


def test_a_tensorstore_whose_dump_fails_restores_through_tensorstore(tmp_path, monkeypatch):
    """The direct read path finds every chunk through ``tensorstore.ocdbt.dump`` (the B-tree
    walk, ``arrays.btree``). Where that fails (a TensorStore without it, or whose dump
    changed shape), nothing is planned for the direct path and TensorStore reads every
    slice: the restore is still exact."""
    from jaxckpt._src.io import chunk_plan

    rng = np.random.default_rng(15)
    tree = {"a": random_bits((512, 64), np.dtype(np.float32), rng), "b": np.arange(7)}
    jaxckpt.save(tmp_path / "c", tree)

    def gone(*args, **kwargs):
        raise AttributeError("module 'tensorstore.ocdbt' has no attribute 'dump'")

    monkeypatch.setattr(ts.ocdbt, "dump", gone)
    planned = []
    real = chunk_plan.plan_slices
    monkeypatch.setattr(
        chunk_plan, "plan_slices", lambda *a: planned.append(real(*a)) or planned[-1]
    )
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    assert planned == [{}]
    for k, v in tree.items():
        assert_same_bits(v, np.asarray(out[k]), k)


def test_a_saves_data_files_are_in_tensorstores_table_order():
    """A save of 6 x 64 MiB plans 6 data files (``DATA_FILES_PER_PROCESS``); the B+tree
    node's data file table lists them in ``plan``'s order, which must be TensorStore's (see
    the node test above): sorted by path, so a node of several data files is the bytes
    TensorStore would write for it. (Planned only: nothing is read or
    written.)"""
    n = arrays.MIN_DATA_FILE_BYTES
    meta = arrays.zarr_metadata((6 * n,), "uint8", [n], None)
    pieces = [(((i * n, (i + 1) * n),), lambda: None) for i in range(6)]
    names = []
    for _ in range(4):  # 4 plans of 6 random names: sorted by chance once in 720**4
        planned = ocdbt_write.plan([arrays.ArrayWrite("x", meta, pieces, True, 6 * n)])
        assert planned is not None
        names.append([f.name for f in planned[1]])
        assert len(names[-1]) == arrays.DATA_FILES_PER_PROCESS
    assert all(ns == sorted(ns) for ns in names)


def test_tensorstore_reads_our_database(tmp_path):
    """Keys, inline and out-of-line values, the manifest: TensorStore lists and reads them."""
    x = np.arange(1000, dtype=np.uint8)
    db = _new_db(tmp_path)
    ocdbt_write.write(db, [_one_leaf("x", x, 100)])
    base = ts.KvStore.open(db.kvstore()).result()
    dumped = ts.ocdbt.dump(base).result()
    assert [v["generation_number"] for v in dumped["versions"]] == [1]
    assert dumped["versions"][0]["root"]["statistics"]["num_keys"] == 11
    kv = ts.KvStore.open(arrays.kvstore_spec(db), context=arrays.new_context()).result()
    keys = [k.decode() for k in kv.list().result()]
    assert keys == sorted([f"x/c/{i}" for i in range(10)] + ["x/zarr.json"])
    for i in range(10):
        value = kv.read(f"x/c/{i}").result().value
        assert value[:100] == x[i * 100 : (i + 1) * 100].tobytes()
    assert len(os.listdir(tmp_path / "db" / "d")) == 1  # 1 KB: one data file, node included


def test_large_chunks_start_on_page_boundaries_small_ones_back_to_back(tmp_path, ts_writes):
    """Chunks of ``layout.SMALL_CHUNK_BYTES`` or more start on page boundaries of their data file
    (zero bytes between), so a restore onto CPU devices can map them; smaller ones stay
    back to back. TensorStore reads every bit, gaps and all."""
    rng = np.random.default_rng(3)
    big = layout.SMALL_CHUNK_BYTES
    tree = {
        "a": random_bits((big // 4 + 3,), np.dtype(np.float32), rng),  # 1 MiB + 12: one chunk
        "b": random_bits((5,), np.dtype(np.float32), rng),  # 20 bytes, after it
        "c": random_bits((big + 5,), np.dtype(np.uint8), rng),
        "d": random_bits((3 * 1024,), np.dtype(jax.numpy.bfloat16), rng),
    }
    jaxckpt.save(tmp_path / "c", tree)
    assert ts_writes.count == 0
    db = arrays.database_dir(location(str(tmp_path / "c")), None)
    base = ts.KvStore.open(db.kvstore()).result()
    where, _ = arrays.btree(base, db)
    chunks = {k: v for k, v in where.items() if "/c/" in k}
    assert len(chunks) == 4
    for key, at in chunks.items():
        if at.stop - at.start >= big:
            assert at.start % layout.ALIGN == 0, (key, at)
    by_file: dict[str, list] = {}
    for at in chunks.values():
        by_file.setdefault(at.file, []).append(at)
    for ats in by_file.values():
        ats.sort(key=lambda a: a.start)
        for prev, nxt in itertools.pairwise(ats):
            gap = nxt.start - prev.stop
            small = nxt.stop - nxt.start < big
            assert (gap == 0) if small else (0 <= gap < layout.ALIGN), (prev, nxt)
    for name, x in tree.items():
        assert_same_bits(_read_with_tensorstore(tmp_path / "c", name), x)
    assert_same_bits(jaxckpt.restore(tmp_path / "c")["a"], tree["a"])


# --- the bits, through a save ------------------------------------------------------------------


def test_every_dtype_random_bits_written_by_us_read_by_tensorstore(tmp_path, ts_writes):
    rng = np.random.default_rng(11)
    tree = {str(d): random_bits((37, 5), d, rng) for d in _dtypes()}
    jaxckpt.save(tmp_path / "c", tree)
    assert ts_writes.count == 0  # bool and sub-byte types too: one byte an element
    for k, v in tree.items():
        assert_same_bits(v, _read_with_tensorstore(tmp_path / "c", k).view(v.dtype), k)
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    for k, v in tree.items():
        assert_same_bits(v, out[k], k)


def test_whole_byte_dtypes_random_bits_each_chunk_layout(tmp_path, ts_writes, mesh42):
    """Sharded, split into row chunks, into strided chunks, edge chunks zarr pads, a scalar,
    an empty array: all written by us, read back by TensorStore alone, bit for bit."""
    rng = np.random.default_rng(12)
    dtypes = [d for d in _dtypes() if bits(d) == d.itemsize * 8 and d.kind != "b"]
    tree = {}
    for d in dtypes:
        tree[f"{d}-sharded"] = sharded(random_bits((64, 24), d, rng), mesh42, ("data", "model"))
        tree[f"{d}-odd"] = random_bits((13, 7, 3), d, rng)
        tree[f"{d}-scalar"] = random_bits((), d, rng)
    tree["empty"] = np.zeros((0, 4), np.float32)
    jaxckpt.save(tmp_path / "c", tree, chunk_bytes=64)  # many chunks, strided and padded ones
    assert ts_writes.count == 0
    for k, v in tree.items():
        if np.asarray(v).size:
            assert_same_bits(
                np.asarray(v),
                _read_with_tensorstore(tmp_path / "c", k).view(np.asarray(v).dtype),
                k,
            )
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    for k, v in tree.items():
        assert_same_bits(np.asarray(v), np.asarray(out[k]), k)


def test_a_corrupt_byte_in_our_file_is_a_checksum_error(tmp_path):
    from conftest import flip_a_chunk_byte

    x = np.random.default_rng(3).standard_normal((256, 64)).astype(np.float32)
    jaxckpt.save(tmp_path / "c", {"x": x})
    flip_a_chunk_byte(tmp_path / "c")
    with pytest.raises(errors.ChecksumError, match="'x'"):
        jaxckpt.restore(tmp_path / "c")


# --- what TensorStore writes instead ---------------------------------------------------------


def test_compressed_leaves_go_to_tensorstore(tmp_path, ts_writes):
    x = np.arange(4096, dtype=np.float32)
    jaxckpt.save(tmp_path / "c", {"x": x}, compression="zstd")
    assert ts_writes.count == 1
    np.testing.assert_array_equal(jaxckpt.restore(tmp_path / "c")["x"], x)


def test_the_switch_and_an_existing_database_go_to_tensorstore(tmp_path, ts_writes, monkeypatch):
    x = np.arange(100, dtype=np.int16)
    write = _one_leaf("x", x, 100)
    db = _new_db(tmp_path)
    ocdbt_write.write(db, [write])
    assert ts_writes.count == 0
    y = arrays.ArrayWrite("y", write.metadata, write.pieces, True, 200)
    ocdbt_write.write(db, [y])  # adds to the database: TensorStore's job
    assert ts_writes.count == 1
    kv = ts.KvStore.open(arrays.kvstore_spec(db), context=arrays.new_context()).result()
    assert {k.decode() for k in kv.list().result()} == {
        "x/c/0",
        "x/zarr.json",
        "y/c/0",
        "y/zarr.json",
    }
    monkeypatch.setenv(linux.DIRECT_WRITE, "0")
    jaxckpt.save(tmp_path / "c", {"x": x})
    assert ts_writes.count == 2


def test_a_failed_read_of_a_piece_commits_nothing(tmp_path):
    def broken():
        raise OSError(5, "Input/output error")

    write = _one_leaf("x", np.zeros(100, np.int16), 100, get=broken)
    db = _new_db(tmp_path)
    with pytest.raises(errors.StorageError, match="Input/output error"):
        ocdbt_write.write(db, [write])
    assert not os.path.exists(tmp_path / "db" / "manifest.ocdbt")


# --- direct_io ----------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["direct_io", "drop_page_cache"])
def test_the_files_stay_out_of_the_page_cache(tmp_path, option):
    """direct_io: only each file's last part block (< 4 KiB) goes through the cache, and is
    dropped; drop_page_cache: every 8 MiB window is dropped once the disk has it. Without
    either the whole step is cached after a save. Measured with mincore."""
    rng = np.random.default_rng(5)
    tree = {
        f"w{i}": rng.standard_normal((1024, 1024)).astype(np.float32) for i in range(6)
    }  # 24 MiB
    saving.commit(saving.prepare(tmp_path / "plain", tree, writes=saving.Writes(direct_io=False)))
    writes = saving.Writes(**{"direct_io": False, option: True})
    saving.commit(saving.prepare(tmp_path / "kept-out", tree, writes=writes))
    data = lambda name: str(tmp_path / name / "arrays" / "d")  # noqa: E731
    if iostats.cached_bytes(data("plain")) < 24 << 20:
        pytest.skip("this filesystem does not keep written pages cached")
    assert iostats.cached_bytes(data("kept-out")) <= 4096 * len(os.listdir(data("kept-out")))
    out = jaxckpt.restore(tmp_path / "kept-out", target=tree)
    for k, v in tree.items():
        assert_same_bits(v, out[k], k)


def test_direct_io_on_a_filesystem_without_it_writes_through_the_cache(tmp_path, monkeypatch):
    real = os.open

    def refuse_direct(path, flags, *rest):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(22, "Invalid argument")
        return real(path, flags, *rest)

    monkeypatch.setattr(os, "open", refuse_direct)
    x = np.random.default_rng(6).standard_normal((300, 77)).astype(np.float32)
    saving.commit(saving.prepare(tmp_path / "c", {"x": x}, writes=saving.Writes(direct_io=True)))
    assert_same_bits(x, jaxckpt.restore(tmp_path / "c")["x"])


def test_the_managers_take_direct_io(tmp_path):
    x = np.random.default_rng(7).standard_normal((64, 33)).astype(np.float32)
    opts = jaxckpt.Options(direct_io=True, async_save=True)
    with jaxckpt.CheckpointManager(tmp_path / "m", opts) as m:
        m.save(1, {"x": x})
        m.wait_until_finished()
        assert_same_bits(x, m.restore(1)["x"])


def test_both_emergency_tiers_write_with_o_direct(tmp_path, mesh42, o_direct_opens):
    opened = o_direct_opens
    x = random_bits((64, 32), np.dtype(np.float32), np.random.default_rng(8))
    tree = {"x": sharded(x, mesh42, ("data", "model"))}
    remote = jaxckpt.Options(save_interval_steps=1, direct_io=True)
    o = jaxckpt.EmergencyOptions(local_interval_steps=1, direct_io=True, remote=remote)
    with jaxckpt.EmergencyCheckpointManager(tmp_path / "l", tmp_path / "r", o) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        assert_same_bits(x, np.asarray(mgr.restore()["x"]))
    if hasattr(os, "O_DIRECT"):
        assert any(p.startswith(str(tmp_path / "l")) for p in opened), opened
        assert any(p.startswith(str(tmp_path / "r")) for p in opened), opened


def test_views_that_are_not_c_contiguous_are_written_in_c_order(tmp_path, ts_writes):
    x = random_bits((48, 20), np.dtype(np.float32), np.random.default_rng(9))
    tree = {"t": x.T, "f": np.asfortranarray(x), "step": x[::2, 3:17]}
    jaxckpt.save(tmp_path / "c", tree)
    assert ts_writes.count == 0
    out = jaxckpt.restore(tmp_path / "c", target=tree)
    for k, v in tree.items():
        assert_same_bits(np.ascontiguousarray(v), out[k], k)
        assert_same_bits(np.ascontiguousarray(v), _read_with_tensorstore(tmp_path / "c", k), k)
