"""Pytrees as flat lists of (key path, leaf), and back.

A key path is stored in JSON as a list of ``[kind, key]`` pairs: ``"k"`` a dict key,
``"a"`` an attribute (dataclasses, namedtuples, Flax structs), ``"i"`` a sequence index,
``"f"`` a flattened index (custom nodes without keys). The leaf's *name* is the same path
as a ``/``-joined string, percent-escaped, and doubles as the array's key in storage.
"""

from __future__ import annotations

import functools
from typing import Any
from urllib.parse import quote

import jax

PathJson = list[list[Any]]

_SAFE = "_.-+=@,~"


def _is_none(x: Any) -> bool:
    return x is None


def path_to_json(path: tuple) -> PathJson:
    return [_key_json(k) for k in path]


def _key_json(k: Any) -> list[Any]:
    if isinstance(k, jax.tree_util.DictKey):
        return ["k", k.key if isinstance(k.key, (str, int)) else str(k.key)]
    if isinstance(k, jax.tree_util.GetAttrKey):
        return ["a", k.name]
    if isinstance(k, jax.tree_util.SequenceKey):
        return ["i", k.idx]
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return ["f", k.key]
    return ["k", str(k)]  # an unknown key type from a custom node


def path_name(path: PathJson) -> str:
    """``[["k","params"],["a","w"]]`` -> ``"params/w"``; the root leaf is ``"_root"``."""
    if not path:
        return "_root"
    return "/".join(_quoted(str(key)) for _, key in path)


def _quoted(key: str) -> str:
    """``key`` percent-quoted ("%" for ""); ASCII names and numbers, which need no quoting,
    skip ``quote`` (a save names every leaf, on the calling thread of an async one)."""
    if key.isascii() and (key.isidentifier() or key.isdigit()):
        return key
    # surrogatepass: a str key may hold a lone surrogate, which UTF-8 proper refuses
    return quote(key, safe=_SAFE, errors="surrogatepass") or "%"


def leaves(tree: Any) -> list[Any]:
    """The leaves of ``tree`` in ``flatten`` order, without their paths (cheaper)."""
    return jax.tree_util.tree_leaves(tree, is_leaf=_is_none)


def flatten(tree: Any) -> list[tuple[PathJson, Any]]:
    """Flattens ``tree`` into ``[(path, leaf)]``; ``None`` counts as a leaf. The paths are
    shared between calls (read them, never change them)."""
    return [(path, leaf) for path, _, leaf in flatten_named(tree)]


def flatten_named(tree: Any) -> list[tuple[PathJson, str, Any]]:
    """``flatten`` with each leaf's name: ``[(path, name, leaf)]``. Both are cached by key
    path, since a save converts and names every leaf on its calling thread, and a training
    loop saves the same structure each time (docs/MEASURED.md)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_none)
    return [(*_path_and_name(p), leaf) for p, leaf in flat]


def _path_and_name(path: tuple) -> tuple[PathJson, str]:
    try:
        return _cached_path_and_name(path)
    except TypeError:  # a custom node's key that cannot be hashed
        as_json = path_to_json(path)
        return as_json, path_name(as_json)


@functools.lru_cache(maxsize=1 << 16)
def _cached_path_and_name(path: tuple) -> tuple[PathJson, str]:
    as_json = path_to_json(path)
    return as_json, path_name(as_json)


def unflatten_like(target: Any, leaves: list[Any]) -> Any:
    """Puts ``leaves`` (in flatten order) into the structure of ``target``."""
    treedef = jax.tree_util.tree_structure(target, is_leaf=_is_none)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def unflatten_paths(items: list[tuple[PathJson, Any]]) -> Any:
    """Rebuilds nested dicts (keys, attributes) and lists (indices) from paths.

    Used when restoring without a target: custom classes come back as dicts, and an empty
    container (which has no leaves, so no path) inside a list as ``{}``, so that every other
    element keeps its index.
    """
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    root: dict = {}
    for path, leaf in items:
        node = root
        for slot in path[:-1]:
            node = node.setdefault(tuple(slot), {})  # slot: (kind, key)
        node[tuple(path[-1])] = leaf
    return _materialize(root)


def _materialize(node: Any) -> Any:
    if not isinstance(node, dict) or not node or not isinstance(next(iter(node)), tuple):
        return node
    kinds = {kind for kind, _ in node}
    if kinds <= {"i", "f"}:  # positions left by empty containers (no leaves) come back as {}
        at = {i: v for (_, i), v in node.items()}
        return [_materialize(at[i]) if i in at else {} for i in range(max(at) + 1)]
    return {key: _materialize(v) for (_, key), v in node.items()}
