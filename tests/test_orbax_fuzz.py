"""Orbax's files as untrusted input: the golden checkpoints (tests/golden/orbax), damaged.

The rule. Whatever is done to one of an Orbax checkpoint's files (``_METADATA``,
``_sharding``, ``_CHECKPOINT_METADATA``, a leaf's ``.zarray``/``zarr.json``, in OCDBT or on
disk, or the msgpack ``checkpoint`` file): truncated, replaced by garbage, a JSON value
swapped for one of another type or deleted, a number made huge or negative, a key or a
symbolic link that leaves the directory; ``jaxckpt.restore`` and ``jaxckpt.metadata``
either give exactly what Orbax saved, or raise a jaxckpt error (``CheckpointError``) whose
message names the damaged file (for zarr metadata: it, or the chunk it failed to decode). Never a bare KeyError/ValueError/TypeError, never a partial
or empty tree, never a read outside the checkpoint directory (a link out of it is refused,
though its target holds the right bytes; an audit hook sees every file Python opens).

Not fuzzed: the chunks' bytes and OCDBT's binary files (Orbax keeps no checksums: changed
data bytes read as other values) and self-consistent forgeries (a dtype string swapped for
another of the same width, a leaf's entry deleted from ``_METADATA``), which describe
another checkpoint rather than a damaged one.

The counts (``event``s, and a line per example with ``-s``) are what docs/ORBAX.md quotes:
``JAXCKPT_HYPOTHESIS_PROFILE=fuzz python -m pytest -q -s tests/test_orbax_fuzz.py
--hypothesis-show-statistics``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from collections import Counter

import msgpack
import numpy as np
import pytest
import tensorstore as ts
from hypothesis import event, given
from hypothesis import strategies as st
from test_orbax_golden import CASES, GOLDEN, assert_bits, expected, flat

import jaxckpt
from jaxckpt.errors import CheckpointError

_WATCH: dict = {"root": None, "inside": None, "escaped": []}


def _audit(name: str, args: tuple) -> None:
    """Records each file Python opens or lists under the example's directory but outside the
    checkpoint (TensorStore's own reads are C++: the checks before them keep them inside)."""
    if _WATCH["root"] is None or name not in ("open", "os.listdir", "os.scandir") or not args:
        return
    if not isinstance(args[0], (str, bytes, os.PathLike)):
        return
    path = os.path.realpath(os.fsdecode(args[0]))
    inside = _WATCH["inside"]
    if path.startswith(_WATCH["root"]) and not (path == inside or path.startswith(inside + "/")):
        _WATCH["escaped"].append((name, path))


sys.addaudithook(_audit)

COUNTS: Counter = Counter()
BY_FILE: Counter = Counter()
ESCAPES = ["..", "../..", "../outside", "/etc/passwd", "a/../../b", "\\..\\x", "", "."]
CLASHES = ["params", "layers", "0", "1", "step", "dense"]  # another leaf's or node's key
OTHER_TYPES = [None, True, 0, -1, 1.5, "x", [], {}, [1, 2], {"a": 1}, [[4, 2]]]


def _item(root: str, style: str) -> tuple[str, str]:
    """(the path a user passes, the item directory)."""
    if style == "maxtext":
        return os.path.join(root, "3"), os.path.join(root, "3", "items")
    return root, root


def _files(path: str, item: str, ocdbt: bool) -> list[tuple[str, str | None]]:
    """The files to damage: (where, OCDBT key or None for a file on disk)."""
    out = [
        (os.path.join(d, n), None)
        for d in sorted({path, item})
        for n in ("_METADATA", "_sharding", "_CHECKPOINT_METADATA", "checkpoint")
        if os.path.isfile(os.path.join(d, n))
    ]
    if ocdbt:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{item}/"}).result()
        keys = sorted(k.decode() for k in kv.list().result())
        out += [(item, k) for k in keys if k.endswith((".zarray", "zarr.json"))]
    else:
        for d, _, names in sorted(os.walk(item)):
            out += [
                (os.path.join(d, n), None) for n in sorted(names) if n in (".zarray", "zarr.json")
            ]
    return out


def _nodes(doc, parent=None, key=None, depth=0):
    """Every (parent, key) in a JSON document, below the top."""
    if parent is not None:
        yield parent, key, depth
    items = (
        doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else []
    )
    for k, v in list(items):
        yield from _nodes(v, doc, k, depth + 1)


def _mutate_json(doc, data) -> tuple[object, str]:
    nodes = [(p, k, d) for p, k, d in _nodes(doc) if p is not doc.get("tree_metadata", 0) or d > 2]
    how = data.draw(st.sampled_from(["type", "delete", "huge", "escape"]), label="json")
    if how == "escape" and isinstance(doc, dict) and isinstance(doc.get("tree_metadata"), dict):
        entries = list(doc["tree_metadata"].values())
        entry = data.draw(st.sampled_from(entries))
        keys = entry["key_metadata"]
        i = data.draw(st.integers(0, len(keys) - 1))
        keys[i]["key"] = data.draw(st.sampled_from(ESCAPES + CLASHES))
        return doc, "escape"
    ints = [(p, k) for p, k, _ in nodes if isinstance(p[k], int) and not isinstance(p[k], bool)]
    if how == "huge" and ints:
        p, k = data.draw(st.sampled_from(ints))
        p[k] = data.draw(st.one_of(st.integers(2**45, 2**64), st.integers(-(2**63), -1)))
        return doc, "huge"
    if not nodes:
        return data.draw(st.sampled_from(OTHER_TYPES)), "type"
    p, k, _ = data.draw(st.sampled_from(nodes))
    if how == "delete" and isinstance(p, dict):
        del p[k]
        return doc, "delete"
    others = [v for v in OTHER_TYPES if type(v) is not type(p[k])]
    p[k] = data.draw(st.sampled_from(others))
    return doc, "type"


def _mutate_msgpack(raw: bytes, data) -> bytes:
    doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    nodes = list(_nodes(doc))
    p, k, _ = data.draw(st.sampled_from(nodes))
    bad_array = msgpack.packb([[2**40], "float32", b""])
    choices = [
        "PLACEHOLDER://x",
        7,
        None,
        [],
        msgpack.ExtType(1, b"\xc1garbage"),
        msgpack.ExtType(1, bad_array),
        msgpack.ExtType(1, msgpack.packb([[2], "object", b"12345678"])),
        msgpack.ExtType(9, b""),
        {"__msgpack_chunked_array__": True, "shape": {"0": 3}, "chunks": {}},
    ]
    if data.draw(st.booleans()) and isinstance(p, dict):
        del p[k]
    else:
        others = [c for c in choices if type(c) is not type(p[k])]  # a number for a number
        p[k] = data.draw(st.sampled_from(others))  # is changed data, like a chunk's bytes
    return msgpack.packb(doc, use_bin_type=True)


def _damage(target: tuple[str, str | None], outside: str, data) -> str:
    """Damages one file; returns how (for the counts)."""
    where, key = target
    if key is None:
        with open(where, "rb") as f:
            raw = f.read()
    else:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{where}/"}).result()
        raw = bytes(kv.read(key).result().value)
    how = data.draw(st.sampled_from(["truncate", "garbage", "structure", "link"]), label="how")
    if how == "link" and key is None:
        copy = os.path.join(outside, os.path.basename(where))
        shutil.copyfile(where, copy)
        os.remove(where)
        os.symlink(copy, where)
        return "link"
    if how == "truncate":
        new = raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "garbage":
        new = data.draw(st.binary(max_size=64))
    elif os.path.basename(key or where) == "checkpoint":
        new, how = _mutate_msgpack(raw, data), "msgpack"
    else:
        doc, how = _mutate_json(json.loads(raw), data)
        new = json.dumps(doc).encode()
    if key is None:
        with open(where, "wb") as f:
            f.write(new)
    else:
        kv.write(key, new).result()
    return how


def _check(path, item, name, want) -> str:
    """Restore and metadata: exact, or a jaxckpt error naming the file. Returns the outcome."""
    outcomes = []
    for call in (jaxckpt.restore, jaxckpt.metadata):
        try:
            out = flat(call(path))
        except CheckpointError as e:
            names = [name]
            if name.endswith((".zarray", "zarr.json")):  # or a chunk of its leaf, read by it
                names.append(name.rsplit("/", 1)[0] + "/")
            assert any(n in str(e) for n in names), f"{type(e).__name__} names no {names}: {e}"
            outcomes.append("raised")
            continue
        if call is jaxckpt.restore:
            assert_bits(out, want)
        else:
            assert sorted(out) == sorted(want)
            for n, w in want.items():
                if n != "step":
                    assert tuple(out[n].shape) == w.shape and np.dtype(out[n].dtype) == w.dtype
        outcomes.append("loaded")
    return "raised" if "raised" in outcomes else "loaded"


@pytest.mark.property
@given(case=st.sampled_from(CASES + [("0.5.10", "flax")] * 4), data=st.data())  # + msgpack
def test_damaged_orbax_files_restore_exactly_or_raise_naming_the_file(case, data):
    version, style = case
    _, want = expected(version)
    tmp = tempfile.mkdtemp(prefix="orbax-fuzz-")
    try:
        root, outside = os.path.join(tmp, "ckpt"), os.path.join(tmp, "outside")
        os.makedirs(outside)
        shutil.copytree(os.path.join(GOLDEN, version, style), root)
        path, item = _item(root, style)
        ocdbt = os.path.exists(os.path.join(item, "manifest.ocdbt"))
        target = data.draw(st.sampled_from(_files(path, item, ocdbt)), label="file")
        name = target[1] or os.path.relpath(target[0], item)
        if name.startswith(".."):  # the step's _CHECKPOINT_METADATA
            name = os.path.basename(target[0])
        how = _damage(target, outside, data)
        real = os.path.realpath(tmp)
        _WATCH.update(root=real, inside=os.path.join(real, "ckpt"), escaped=[])
        try:
            outcome = _check(path, item, name, want)
        finally:
            _WATCH["root"] = None
        assert not _WATCH["escaped"], f"read outside the directory: {_WATCH['escaped']}"
    finally:
        shutil.rmtree(tmp)
    COUNTS["tried"] += 1
    COUNTS[outcome] += 1
    kind = os.path.basename(name)
    BY_FILE[f"{kind} {outcome}"] += 1
    event(f"{outcome}: {kind} {how}")
    print(f"orbax fuzz: {dict(COUNTS)}")
    print(f"orbax fuzz by file: {dict(sorted(BY_FILE.items()))}")
