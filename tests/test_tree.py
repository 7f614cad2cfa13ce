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
