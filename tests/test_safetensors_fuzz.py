"""Fuzzing the safetensors readers (``jaxckpt.safetensors.load`` and ``metadata``).

The rule, for every input: a valid file (or a sharded index and its files) damaged one way
(truncated, garbage bytes, a wrong JSON type, a huge size/length/offset, overlapping or
out-of-file data_offsets, a bad dtype, a shape that does not match the size, an index path
leaving the directory), ``load`` and ``metadata`` either

* load exactly: the names, dtypes, shapes and bytes the reference (the ``safetensors``
  package's ``deserialize``) reads from the same bytes; and only when it reads them; or
* raise a ``jaxckpt.errors.SafetensorsError`` (or a subclass) whose message names the file (the
  ``.safetensors`` file, or the index for what the index says). Never another exception,
  never a partial result, never a read of a file outside the directory (the index's
  ``../secret.safetensors`` exists and is valid, so reading it would load).

A refusal of bytes the reference reads is allowed only for a dtype jaxckpt does not read
(the reference knows more, e.g. ``C64``) or a header naming a key twice (JSON parsers differ
on which one wins; the reference takes the last), and counted. ``pytest -s -k fuzz`` prints how many
inputs were tried and how they ended (``FUZZ ...`` lines); bench/fuzz.py runs these longer.
"""

import collections
import json
import os
import tempfile

import jax
import numpy as np
import pytest
from hostile import random_bits
from hypothesis import event, given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxckpt
from jaxckpt._src.safetensors.format import DTYPES
from jaxckpt.errors import SafetensorsError

safetensors = pytest.importorskip("safetensors")

STRICTER = ["which jaxckpt does not read", "appears twice"]  # refused, though the reference reads

# --- valid inputs -------------------------------------------------------------------------------


@st.composite
def tensors(draw, prefix: str = "t") -> dict:
    count = draw(st.integers(1, 3))
    out = {}
    for k in range(count):
        dtype = DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
        seed = draw(st.integers(0, 2**32 - 1))
        out[f"{prefix}{k}"] = random_bits(shape, dtype, np.random.default_rng(seed))
    return out


def encode(header: dict, data: bytes, pad: bytes = b" ") -> bytes:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += pad * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def layout(arrays: dict, metadata: dict | None = None) -> tuple[dict, bytes]:
    """The header and data of a file holding ``arrays`` (what ``safetensors`` writes)."""
    names = {v: k for k, v in DTYPES.items()}
    header: dict = {"__metadata__": metadata} if metadata is not None else {}
    data, pos = b"", 0
    for name, a in arrays.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {
            "dtype": names[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [pos, pos + len(raw)],
        }
        data += raw
        pos += len(raw)
    return header, data


# --- damage -------------------------------------------------------------------------------------

DEEP = object()  # an index nested deeper than a JSON parser recurses
HUGE = [2**31, 2**32 + 8, 2**53 + 1, 2**63, 2**64 - 1, 2**64, 10**30]
BAD_VALUES = [None, True, 1.5, -1, "x", "", [], {}, [1, 2, 3], *HUGE]


@st.composite
def damaged(draw, header: dict, data: bytes) -> tuple[str, bytes]:
    """One way to damage a file, and its bytes."""
    raw = encode(header, data)
    names = [k for k in header if k != "__metadata__"]
    kind = draw(
        st.sampled_from(
            [
                "none",
                "truncate",
                "garbage",
                "length",
                "dtype",
                "shape",
                "offsets",
                "entry",
                "overlap",
                "json",
                "metadata",
                "padding",
                "trailing",
            ]
        )  # fmt: skip
    )
    if kind == "truncate":
        return kind, raw[: draw(st.integers(0, len(raw) - 1))]
    if kind == "garbage":
        out = bytearray(raw)
        for _ in range(draw(st.integers(1, 8))):
            out[draw(st.integers(0, len(out) - 1))] = draw(st.integers(0, 255))
        return kind, bytes(out)
    if kind == "length":
        n = int.from_bytes(raw[:8], "little")
        new = draw(st.sampled_from([0, 1, 2, n - 8, n - 1, n + 1, n + 8, len(raw), *HUGE]))
        return kind, (new % 2**64).to_bytes(8, "little") + raw[8:]
    if kind == "trailing":
        return kind, raw + draw(st.binary(min_size=1, max_size=16))
    if kind == "padding":
        return kind, encode(header, data, pad=draw(st.sampled_from([b"\0", b"x", b"}", b"\n"])))
    h = json.loads(json.dumps(header))
    name = draw(st.sampled_from(names))
    entry = h[name]
    if kind == "dtype":
        entry["dtype"] = draw(
            st.sampled_from(
                [
                    "F8_E8M0",
                    "C64",
                    "F4",
                    "X",
                    "",
                    "f32",
                    "bf16",
                    7,
                    None,
                    [],
                    "I32",
                    "U32",
                    "F32",
                    "F16",
                    "BF16",
                    "I64",
                    "F64",
                    "U8",
                    "BOOL",
                ]
            )  # fmt: skip
        )
    elif kind == "shape":
        shape = entry["shape"]
        entry["shape"] = draw(
            st.sampled_from(
                [
                    [],
                    [-1],
                    [2**64],
                    [2**40, 2**40],
                    ["2"],
                    [1.5],
                    None,
                    "x",
                    [True],
                    [*shape, 1],
                    [*shape, 2],
                    shape[:-1],
                    [d + 1 for d in shape],
                    [0],
                ]
            )  # fmt: skip
        )
    elif kind == "offsets":
        b, e = entry["data_offsets"]
        entry["data_offsets"] = draw(
            st.sampled_from(
                [
                    [0, 0],
                    [b, e + 1],
                    [e, b],
                    [-1, e],
                    [b + 1, e + 1],
                    [b, len(data) + 8],
                    [2**64, 2**64 + e - b],
                    [2**63, 2**63],
                    "x",
                    [b],
                    [b, e, e],
                    [1.5, 2],
                    None,
                    [str(b), str(e)],
                    [b - 1, e - 1],
                ]
            )  # fmt: skip
        )
    elif kind == "entry":
        h[name] = draw(st.sampled_from(["x", [], None, {}, 7, {**entry, "extra": 1}]))
    elif kind == "overlap":  # one tensor's offsets given to another
        other = draw(st.sampled_from(names))
        entry["data_offsets"] = list(h[other]["data_offsets"])
        entry["shape"], entry["dtype"] = h[other]["shape"], h[other]["dtype"]
    elif kind == "json":
        text = draw(
            st.sampled_from(
                [
                    b"[]",
                    b"{",
                    b"null",
                    b'"x"',
                    b"{}" + b"x",
                    b"\xff\xfe{}",
                    b'{"a":' * 20000 + b"1" + b"}" * 20000,
                    '{"a":1}'.encode("utf-16"),
                    b'{"' + name.encode() + b'":NaN}',
                    json.dumps(h)[:-1].encode()
                    + b',"'
                    + name.encode()
                    + b'":'
                    + json.dumps(entry).encode()
                    + b"}",
                ]
            )  # fmt: skip
        )
        text += b" " * (-len(text) % 8)
        return kind, len(text).to_bytes(8, "little") + text + data
    elif kind == "metadata":
        h["__metadata__"] = draw(st.sampled_from([{"a": 1}, [], "x", {"a": None}, 3]))
    return kind, encode(h, data)


# --- the rule -----------------------------------------------------------------------------------


def reference(raw: bytes) -> dict | None:
    try:
        return {n: t for n, t in safetensors.deserialize(raw)}
    except Exception:  # noqa: BLE001 -- the reference refuses it, whatever the exception
        return None


def target_of(ref: dict, sharded: bool):
    """A target for the tensors ``ref`` names: NumPy arrays, or (``sharded``) leaves split
    over two devices where they can be, for ranged reads."""
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    out = {}
    for name, t in ref.items():
        dtype = DTYPES.get(t["dtype"])
        if dtype is None:
            continue
        shape = tuple(t["shape"])
        if sharded and shape and shape[0] % 2 == 0 and dtype.itemsize < 8:  # x64 is off
            out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("x")))
        else:
            out[name] = np.zeros(shape, dtype)
    return out


def expected(ref: dict) -> dict:
    return {
        n: np.frombuffer(bytes(t["data"]), DTYPES[t["dtype"]]).reshape(t["shape"])
        for n, t in ref.items()
        if t["dtype"] in DTYPES
    }


def check(counts, what: str, path, ref: dict | None, target: dict, files: list[str]) -> None:
    """``metadata`` and ``load`` of ``path`` against the reference's reading ``ref`` (None:
    it refuses). ``files``: the paths an error may name."""
    for op in ("metadata", "load"):
        try:
            if op == "metadata":
                got = jaxckpt.safetensors.metadata(path)
            else:
                got = jaxckpt.safetensors.load(path, target)
        except SafetensorsError as e:
            msg = str(e)
            assert any(f in msg for f in files), f"{what}: {op} error names no file: {msg}"
            if ref is not None:  # the reference reads it: only a dtype jaxckpt lacks
                assert any(k in msg for k in STRICTER), f"{what}: {op} refused: {msg}"
                outcome = "refused what the reference reads (a dtype, a key twice)"
            else:
                outcome = "raised a jaxckpt error naming the file"
        else:
            assert ref is not None, f"{what}: {op} read what the reference refuses"
            exp = expected(ref)
            if op == "metadata":
                assert {n: (t.dtype, t.shape) for n, t in got.items()} == {
                    n: (a.dtype, a.shape) for n, a in exp.items()
                }, what
            else:
                assert got.keys() == target.keys(), what
                for n, a in got.items():
                    a = np.asarray(a)
                    assert a.dtype == exp[n].dtype and a.shape == exp[n].shape, (what, n)
                    assert a.tobytes() == exp[n].tobytes(), (what, n)
            outcome = "loaded exactly"
        counts[f"{op} {outcome}"] += 1
        event(f"{op}: {outcome}")


def report(counts, what: str) -> None:
    tried = counts.pop("inputs", 0)
    print(
        f"\nFUZZ {what}: {tried} inputs: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))
    )


# --- the properties -----------------------------------------------------------------------------


COUNTS = {"one file": collections.Counter(), "an index and its files": collections.Counter()}


@pytest.fixture(scope="module", autouse=True)
def _print_counts():
    """Prints each property's figures once its examples have all run."""
    yield
    for what, counts in COUNTS.items():
        if counts:
            report(counts, what)


@pytest.mark.property
@given(st.data(), tensors(), st.booleans())
def test_fuzz_one_file_loads_exactly_or_raises_naming_it(data, arrays, sharded):
    counts = COUNTS["one file"]
    header, blob = layout(arrays, data.draw(st.sampled_from([None, {"format": "pt"}])))
    kind, raw = data.draw(damaged(header, blob))
    event(f"damage: {kind}")
    counts["inputs"] += 1
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "model.safetensors")
        with open(path, "wb") as f:
            f.write(raw)
        ref = reference(raw)
        target = target_of(ref if ref is not None else layout_ref(header, blob), sharded)
        check(counts, kind, path, ref, target, [path])


def layout_ref(header: dict, data: bytes) -> dict:
    """The undamaged file as the reference reads it (the target of a damaged one)."""
    return reference(encode(header, data))


OUTSIDE = ["../secret.safetensors", "/SECRET", "sub/../../secret.safetensors",
           "./a.safetensors", "a.safetensors/../../secret.safetensors", "",
           "..\\secret.safetensors", 7, None, "missing.safetensors",
           "model.safetensors.index.json"]  # fmt: skip


@pytest.mark.property
@given(st.data(), tensors("a"), tensors("b"))
def test_fuzz_index_and_its_files_load_exactly_or_raise_naming_a_file(data, first, second):
    counts, outside = COUNTS["an index and its files"], OUTSIDE
    files = {"a.safetensors": layout(first), "b.safetensors": layout(second)}
    weight_map = {n: "a.safetensors" for n in first} | {n: "b.safetensors" for n in second}
    index: object = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    kind = data.draw(st.sampled_from(["none", "path", "weight_map", "index", "file", "dup"]))
    raw = {f: encode(*hd) for f, hd in files.items()}
    if kind == "path":
        bad = data.draw(st.sampled_from(outside))
        weight_map[data.draw(st.sampled_from(sorted(weight_map)))] = bad
    elif kind == "weight_map":
        index["weight_map"] = data.draw(st.sampled_from([[], "x", None, {}, 3]))
    elif kind == "index":
        index = data.draw(st.sampled_from([[], "x", None, {}, {"weight_map": None}, DEEP]))
    elif kind == "file":
        f = data.draw(st.sampled_from(sorted(files)))
        raw[f] = data.draw(damaged(*files[f]))[1]
    elif kind == "dup":  # the same tensor in both files
        raw["b.safetensors"] = encode(*layout({**second, **first}))
    event(f"damage: {kind}")
    counts["inputs"] += 1
    with tempfile.TemporaryDirectory() as root:
        d = os.path.join(root, "model")
        os.makedirs(os.path.join(d, "sub"))
        secret = os.path.join(root, "secret.safetensors")
        with open(secret, "wb") as fh:  # valid, and what an escaping path would load
            fh.write(raw["a.safetensors"] if kind != "file" else encode(*files["a.safetensors"]))
        for f, b in raw.items():
            with open(os.path.join(d, f), "wb") as fh:
                fh.write(b)
        index_path = os.path.join(d, "model.safetensors.index.json")
        with open(index_path, "w") as fh:
            fh.write("[" * 100_000 + "]" * 100_000 if index is DEEP else json.dumps(index))
        named = weight_map if isinstance(weight_map, dict) and index is not None else {}
        inside = (
            all(isinstance(f, str) and f in raw for f in named.values())
            and kind not in ("weight_map", "index")
            and kind != "dup"
        )
        ref = None
        if inside and named:
            refs = [reference(raw[f]) for f in sorted(set(named.values()))]
            if all(r is not None for r in refs):
                ref = {n: t for r in refs for n, t in r.items()}
        want = {**layout_ref(*files["a.safetensors"]), **layout_ref(*files["b.safetensors"])}
        target = target_of(ref if ref is not None else want, False)
        names = [os.path.join(d, f) for f in raw] + [index_path]
        names += [os.path.join(d, f) for f in named.values() if isinstance(f, str) and f]
        check(counts, kind, d, ref, target, names)
