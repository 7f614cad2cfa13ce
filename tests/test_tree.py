"""Key paths of pytrees: the leaf names that manifests, local steps and safetensors use."""

from urllib.parse import quote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxckpt._src import tree as tree_lib

SAFE = tree_lib._SAFE


def _reference(path: list) -> str:  # the rule, written the slow way
    parts = [quote(str(k), safe=SAFE, errors="surrogatepass") or "%" for _, k in path]
    return "/".join(parts) or "_root"


@pytest.mark.property
@given(
    st.lists(
        st.tuples(
            st.sampled_from("kaif"),
            st.one_of(st.text(), st.integers(-(10**6), 10**6), st.from_regex(r"[A-Za-z_]\w*")),
        ),
        max_size=4,
    )
)
def test_path_name_quotes_like_the_rule(path):
    assert tree_lib.path_name([list(p) for p in path]) == _reference(path)


def test_path_name_examples():
    assert tree_lib.path_name([]) == "_root"
    assert tree_lib.path_name([["k", "params"], ["a", "w"]]) == "params/w"
    assert tree_lib.path_name([["k", "a/b"], ["i", 0], ["k", ""], ["k", "é"]]) == "a%2Fb/0/%/%C3%A9"


class _Unhashable:
    """A custom node whose key cannot be hashed: names are worked out, not cached."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, key: list) -> None:
        self.key = key

    def __str__(self) -> str:
        return "/".join(self.key)


def test_flatten_named_matches_the_uncached_names():
    import jax

    @jax.tree_util.register_pytree_with_keys_class
    class Box:
        def __init__(self, x):
            self.x = x

        def tree_flatten_with_keys(self):
            return [(_Unhashable(["odd", "key"]), self.x)], None

        def tree_flatten(self):
            return [self.x], None

        @classmethod
        def tree_unflatten(cls, aux, children):
            return cls(*children)

    tree = {"a": [1.0, None], "b/c": {"é": 2}, "box": Box(3)}
    for _ in range(2):  # the second time from the cache
        named = tree_lib.flatten_named(tree)
        want = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
        assert [leaf for _, _, leaf in named] == [leaf for _, leaf in want]
        for (path, name, _), (keys, _) in zip(named, want, strict=True):
            assert path == tree_lib.path_to_json(keys)
            assert name == tree_lib.path_name(path)
    assert [n for _, n, _ in named] == ["a/0", "a/1", "b%2Fc/%C3%A9", "box/odd%2Fkey"]
    assert tree_lib.flatten(tree) == [(p, leaf) for p, _, leaf in named]
