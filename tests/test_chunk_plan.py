"""Which slices the direct read path reads (``chunk_plan``): chunks whole and contiguous
in a slice, the parts of chunks a slice cuts through, and each leaf's layout read from its
``zarr.json`` as the B-tree walk finds it, checked against TensorStore's own."""

import json

import jax
import ml_dtypes
import numpy as np
from hostile import DTYPES, direct_dtype, random_bits

import jaxckpt
from jaxckpt._src.io import arrays, chunk_plan
from jaxckpt._src.storage import location


def test_which_slices_are_whole_contiguous_chunks():
    """A slice is read directly when every chunk in it is whole and contiguous in its
    buffer: whole chunks, runs of whole rows; not a strided chunk, a chunk the slice cuts,
    nor an edge chunk zarr padded beyond the array (jaxckpt's own chunks divide the shards,
    an Orbax checkpoint's need not)."""
    lay = chunk_plan.Layout((4, 8), np.dtype(np.float32), "/")
    assert chunk_plan.chunks_in(((4, 8), (0, 8)), lay) == [((1, 0), 0)]
    assert chunk_plan.chunks_in(((0, 12), (8, 16)), lay) == [
        ((0, 1), 0),
        ((1, 1), 128),
        ((2, 1), 256),
    ]
    assert chunk_plan.chunks_in(((0, 4), (0, 16)), lay) is None  # strided: rows of 8 in 16
    assert chunk_plan.chunks_in(((0, 2), (0, 8)), lay) is None  # half a chunk
    assert chunk_plan.chunks_in(((8, 10), (0, 8)), lay) is None  # an edge chunk (array of 10)
    rows = chunk_plan.Layout((1, 1, 6), np.dtype(np.int8), ".")
    assert chunk_plan.chunks_in(((0, 2), (3, 5), (0, 6)), rows) == [
        ((0, 3, 0), 0), ((0, 4, 0), 6), ((1, 3, 0), 12), ((1, 4, 0), 18)
    ]  # fmt: skip
    assert chunk_plan.chunk_key("a/b", (1, 3, 0), ".") == "a/b/c.1.3.0"
    assert chunk_plan.chunk_key("s", (), "/") == "s/c"


def test_chunk_parts_tile_the_slice():
    """Every element of a slice comes from exactly one chunk, from inside that chunk's
    stored box, edge chunks (padded beyond the array) included."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        rank = int(rng.integers(1, 4))
        chunks = tuple(int(c) for c in rng.integers(1, 6, rank))
        shape = tuple(int(n) for n in rng.integers(1, 20, rank))
        lo = [int(rng.integers(0, n)) for n in shape]
        index = tuple((a, int(rng.integers(a + 1, n + 1))) for a, n in zip(lo, shape, strict=True))
        lay = chunk_plan.Layout(chunks, np.dtype(np.int32), "/")
        covered = np.zeros([b - a for a, b in index], np.int32)
        for g, chunk, part in chunk_plan.chunk_parts(index, lay):
            assert chunk == tuple((i * c, (i + 1) * c) for i, c in zip(g, chunks, strict=True))
            assert all(c0 <= p0 < p1 <= c1 for (c0, c1), (p0, p1) in zip(chunk, part, strict=True))
            covered[
                tuple(slice(p0 - a, p1 - a) for (p0, p1), (a, _) in zip(part, index, strict=True))
            ] += 1
        assert (covered == 1).all(), (chunks, index)


def test_the_layout_read_from_zarr_json_is_tensorstores(x64, mesh42, tmp_path):
    """For every dtype, ``stored_layout`` of the inline ``zarr.json`` is ``layout`` of the
    leaf opened with TensorStore (None for those the direct path leaves to it)."""
    rng = np.random.default_rng(13)
    tree = {d.name: random_bits((6, 10), d, rng) for d in DTYPES}
    jaxckpt.save(tmp_path / "c", tree, chunk_bytes=64)
    db = arrays.database_dir(location(str(tmp_path / "c")), None)
    _, inline = chunk_plan.index(db)
    ctx = arrays.new_context()
    for d in DTYPES:
        store = arrays.open_leaf(db, d.name, ctx).result()
        got = chunk_plan.stored_layout(inline[f"{d.name}/zarr.json"], (6, 10), d)
        assert got == chunk_plan.layout(store), d
        assert (got is not None) == direct_dtype(d), d


def test_zarr_json_that_is_not_the_leafs_or_not_raw_gives_no_layout():
    """Metadata the direct path must not trust gives None (TensorStore reads the leaf)."""
    good = {
        "zarr_format": 3, "node_type": "array", "shape": [8, 4], "data_type": "bfloat16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 4]}},
        "chunk_key_encoding": {"name": "default"},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
        "fill_value": 0,
    }  # fmt: skip
    bf16 = np.dtype(jax.numpy.bfloat16)
    lay = chunk_plan.stored_layout(json.dumps(good).encode(), (8, 4), bf16)
    assert lay == chunk_plan.Layout((4, 4), bf16, "/")
    carrier = json.dumps({**good, "data_type": "uint8"}).encode()  # float8_e4m3's bytes
    f8 = np.dtype(ml_dtypes.float8_e4m3)
    assert chunk_plan.stored_layout(carrier, (8, 4), f8) == chunk_plan.Layout(
        (4, 4), np.dtype("u1"), "/"
    )
    assert chunk_plan.stored_layout(carrier, (8, 4), np.dtype(np.int8)) is None  # not a carrier
    bad = [
        b"not json",
        b"[]",
        json.dumps({**good, "shape": [4, 8]}).encode(),  # another shape than the manifest's
        json.dumps({**good, "data_type": "float16"}).encode(),  # another dtype, same size
        json.dumps({**good, "data_type": "float32"}).encode(),
        json.dumps({**good, "data_type": "finfo"}).encode(),  # not a dtype
        json.dumps({**good, "data_type": 7}).encode(),
        json.dumps({k: v for k, v in good.items() if k != "data_type"}).encode(),
        json.dumps({**good, "codecs": [{"name": "bytes"}, {"name": "zstd"}]}).encode(),
        json.dumps({**good, "codecs": [
            {"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]}).encode(),
        json.dumps({**good, "chunk_grid": {"name": "regular",
                    "configuration": {"chunk_shape": [4, 0]}}}).encode(),
        json.dumps({**good, "chunk_grid": {"name": "rectilinear"}}).encode(),
    ]  # fmt: skip
    for b in bad:
        assert chunk_plan.stored_layout(b, (8, 4), bf16) is None, b
