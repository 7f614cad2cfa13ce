"""The emergency restore's planner as pure logic, table-driven: which step can be assembled,
who sends which slice to whom, in which ppermute rounds, and how a slice is cut out of the
saved ones. (The multi-process runs are in tests/test_emergency.py.)"""

import numpy as np
import pytest

from jaxckpt._src.boxes import from_text, intersect
from jaxckpt._src.emergency.planner import (
    BadCopy,
    Holdings,
    SliceKey,
    StepHolding,
    StepPlan,
    StepUnusable,
    by_sender,
    candidates,
    plan_sends,
    shift_rounds,
    uncovered,
)
from jaxckpt._src.emergency.recovery import fill

S = 7  # the step


def key(text: str, leaf: str = "w") -> SliceKey:
    """Slice ``text`` ("0:2") of ``leaf``."""
    return SliceKey(leaf, from_text(text))


def keys(texts: list[str]) -> frozenset[SliceKey]:
    return frozenset(map(key, texts))


def view(held: dict[str, list[str]], need=None, digest="d") -> Holdings:
    """What a process publishes it holds of step S (as restore.publish_holdings)."""
    holding = StepHolding(
        digest, need or {"w": 4}, frozenset(key(k, n) for n, ks in held.items() for k in ks)
    )
    return Holdings((), {S: holding})


ALL = ["0:2", "2:4", "4:6", "6:8"]


@pytest.mark.parametrize(
    "views, why",
    [
        ([view({"w": ALL[:2]}), view({"w": ALL[2:]})], None),  # together: complete
        ([view({"w": ALL[:2]}), view({"w": ALL[1:3]})], "1 of 4 slices of leaf 'w'"),
        ([view({"w": ALL}), view({"w": ALL}, digest="other")], "different trees"),
        ([view({"w": ALL})], None),  # fewer processes than at save time: one holds it all
    ],
)
def test_uncovered(views, why):
    got = uncovered(S, views)
    assert got is None if why is None else why in got


@pytest.mark.parametrize(
    "held, needs, bad, sends",
    [
        # process 1 lost its disk: process 0 (its peer copy) sends it everything it needs
        ([ALL, []], [ALL[:2], ALL[2:]], set(), {(0, 1): keys(ALL[2:])}),
        # both hold copies: the lowest holder sends, nobody sends what the receiver has
        ([ALL, ALL[:2], ALL], [[], ALL, []], set(), {(0, 1): keys(ALL[2:])}),
        # process 0's copy of 4:6 is bad: the next holder (2) sends that one
        (
            [ALL, [], ALL],
            [[], ["2:4", "4:6"], []],
            {(0, "4:6")},
            {(0, 1): keys(["2:4"]), (2, 1): keys(["4:6"])},
        ),
        # permuted process ids: only what is held counts, not who saved it
        ([[], ALL], [ALL[:1], []], set(), {(1, 0): keys(["0:2"])}),
    ],
)
def test_plan_sends(held, needs, bad, sends):
    """``needs`` and ``bad`` name slices of leaf w by their text."""
    views = [view({"w": h}) for h in held]
    holders = [p for p, h in enumerate(held) if h]
    bad = {(p, key(k)): BadCopy(p, "w", k, "crc") for p, k in bad}
    assert plan_sends(S, views, holders, [[key(k) for k in n] for n in needs], bad) == sends


def test_plan_sends_matches_the_lowest_verified_holder_rule_on_random_holdings():
    """The indexed plan against the rule written out (every holder scanned per slice)."""
    rng = np.random.default_rng(3)
    slices = [f"{i}:{i + 1}" for i in range(12)]
    for _ in range(30):
        count = int(rng.integers(2, 7))
        held = [[k for k in slices if rng.random() < 0.4] for _ in range(count)]
        held[0] = slices  # every slice has a holder
        views = [view({"w": h}) for h in held]
        holders = [p for p, h in enumerate(held) if h]
        needs = [[key(k) for k in slices if rng.random() < 0.3] for _ in range(count)]
        bad = {(p, key(k)): BadCopy(p, "w", k, "crc") for p in range(1, count) for k in held[p][:1]}
        want: dict = {}
        for q, need in enumerate(needs):
            for k in need:
                if not (views[q].holds(S, k) and (q, k) not in bad):
                    ok = [p for p in holders if views[p].holds(S, k) and (p, k) not in bad]
                    want.setdefault((ok[0], q), set()).add(k)
        assert plan_sends(S, views, holders, needs, bad) == want


def test_step_plan_replans_around_a_failed_copy_and_tells_only_what_is_new():
    views = [view({"w": ALL}), view({"w": []}), view({"w": ALL})]
    plan = StepPlan.start(S, views, [[], [key("2:4"), key("4:6")], []])
    assert by_sender(plan.sends) == {0: {1: keys(["2:4", "4:6"])}}
    assert plan.replan([[], [], []]) == [set(), set(), set()]  # nothing failed: final
    unread = plan.replan([[(key("4:6"), "crc")], [], []])  # process 0's copy of 4:6 is bad
    assert unread == [set(), set(), {key("4:6")}]  # process 2 now reads it, nobody else more
    assert by_sender(plan.sends) == {0: {1: keys(["2:4"])}, 2: {1: keys(["4:6"])}}
    assert list(plan.bad.values()) == [BadCopy(0, "w", "4:6", "crc")]
    assert plan.replan([[], [], []]) == [set(), set(), set()]


def test_record_holders_are_the_lowest_holder_of_each_record():
    def holding(per_process):
        return Holdings((), {S: StepHolding("d", {"w": 4}, keys(ALL), per_process)})

    views = [Holdings((), {}), holding((1, 2)), holding((2, 0))]
    plan = StepPlan.start(S, views, [[], [], []])
    assert plan.record_holders() == {1: 1, 2: 1, 0: 2}


def test_emergency_restore_publishes_through_process_zero_alone():
    """One process: ``share_holdings`` decides on its own value, and keeps the views."""
    from jaxckpt._src.emergency.restore import share_holdings

    mine = Holdings((3,), {S: StepHolding("d", {"w": 4}, keys(ALL))})
    got = share_holdings(mine, tag="t", timeout_s=5)
    assert (got.tries, got.rejected, got.remote, got.count) == ((S,), (), (3,), 1)
    assert got.views == (mine,)
    assert share_holdings(mine, tag="t2", timeout_s=5, step=9).tries == ()


def test_candidates_newest_coverable_first_and_why_the_others_are_not():
    def views(remote, **steps):  # steps: name -> held slices, as step "s<n>"
        out = [Holdings(tuple(remote), {}), Holdings(tuple(remote), {})]
        for name, (held0, held1) in steps.items():
            for v, held in zip(out, (held0, held1), strict=True):
                v.steps[int(name[1:])] = StepHolding("d", {"w": 4}, keys(held))
        return out

    both = (ALL[:2], ALL[2:])
    half = (ALL[:2], [])
    tries, rejected = candidates(views([], s9=half, s8=both, s7=both))
    assert tries == [8, 7] and [(r.step, "held by none" in r.why) for r in rejected] == [(9, True)]
    tries, rejected = candidates(views([8], s9=both, s7=both))  # remote 8 is newer than 7
    assert tries == [9] and rejected == [(7, "the remote tier has a newer step 8")]
    tries, _ = candidates(views([8], s9=both, s7=both), step=7)  # asked for: tried anyway
    assert tries == [7]


def test_a_slice_nobody_holds_verified_makes_the_step_unusable():
    views = [view({"w": ALL}), view({"w": []})]
    bad = {(0, key("6:8")): BadCopy(0, "w", "6:8", "crc")}
    with pytest.raises(StepUnusable, match=r"no verified copy of w\[6:8\]"):
        plan_sends(S, views, [0], [[], [key("6:8")]], bad)


def test_holdings_travel_as_json_unchanged():
    h = Holdings((3, 5), {S: StepHolding("d", {"w": 4}, keys(ALL[:2]), (0, 1))})
    assert Holdings.from_json(h.to_json()) == h
    assert h.holds(S, key("0:2")) and not h.holds(S, key("4:6")) and not h.holds(8, key("0:2"))


def test_shift_rounds_are_partial_permutations_in_order():
    sends = {(0, 1): {("w", "a")}, (2, 3): {("w", "b")}, (3, 1): {("w", "c")}, (1, 0): set()}
    rounds = shift_rounds(sends, 4)
    assert rounds == [(1, ((0, 1), (2, 3))), (2, ((3, 1),))]
    for _, pairs in rounds:  # each process sends and receives at most once a round
        assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})


def test_the_planner_imports_no_jax():
    import ast
    import os

    import jaxckpt

    path = os.path.join(os.path.dirname(jaxckpt.__file__), "_src", "emergency", "planner.py")
    with open(path) as f:
        tree = ast.parse(f.read())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert not imported & {"jax", "jaxlib", "numpy", "tensorstore"}, imported


def test_fill_cuts_a_region_out_of_the_saved_slices():
    a = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    saved = [((0, 4), (0, 4)), ((4, 8), (0, 4))]
    data = {("w", s): a[s[0][0] : s[0][1], s[1][0] : s[1][1]] for s in saved}
    assert intersect(((0, 4), (0, 4)), ((2, 6), (1, 3))) == ((2, 4), (1, 3))
    assert intersect(((0, 4),), ((4, 8),)) is None
    region = ((2, 6), (1, 3))  # straddles both saved slices
    np.testing.assert_array_equal(fill(region, saved, data, "w", np.float32), a[2:6, 1:3])
    assert fill(saved[1], saved, data, "w", np.float32) is data[("w", saved[1])]  # no copy
