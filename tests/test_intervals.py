"""The save-interval math and the "auto" chooser (jaxckpt/_src/goodput/intervals.py), and the options
that ask for it: closed forms against hand-computed values, the exact optimum against Daly's
and Young's approximations, the chooser's bounds, the rolling measurements."""

import dataclasses
import json
import math

import numpy as np
import pytest

import jaxckpt
from jaxckpt._src.goodput import intervals
from jaxckpt._src.goodput.intervals import Costs, Measurements
from jaxckpt._src.options import is_auto
from jaxckpt.errors import OptionsError

# --- closed forms ------------------------------------------------------------------------


def test_young_daly_with_restart_by_hand():
    # δ = 60 s, M = 3600 s: sqrt(2·60·3600) = sqrt(432000)
    assert intervals.young(60, 3600) == pytest.approx(657.2670690, rel=1e-9)
    # r = δ/2M = 1/120: 657.267·(1 + sqrt(r)/3 + r/9) − 60
    assert intervals.daly(60, 3600) == pytest.approx(617.8756496, rel=1e-9)
    assert intervals.daly(7200, 3600) == 3600  # δ >= 2M: M
    # 60 + sqrt(2·(3600 + 300)·60 + 60²) = 60 + sqrt(471600)
    assert intervals.with_restart(60, 3600, 300) == pytest.approx(746.7314, rel=1e-6)
    assert intervals.with_restart(60, 3600, 0) > intervals.young(60, 3600)
    assert intervals.young(0, 3600) == intervals.daly(0, 3600) == 0


def test_ettr_is_dalys_complete_model():
    tau, delta, m, r = 600.0, 60.0, 3600.0, 300.0
    by_hand = tau / (m * math.exp(r / m) * (math.exp((tau + delta) / m) - 1))
    assert intervals.ettr(tau, delta, m, r) == pytest.approx(by_hand, rel=1e-12)
    # no failures: the save is the only loss
    assert intervals.ettr(100, 10, 1e300, 0) == pytest.approx(100 / 110, rel=1e-12)
    assert intervals.ettr(100, 10, 1e12, 1e3) == pytest.approx(100 / 110, rel=1e-6)
    assert intervals.ettr(100, 0, 1e300, 0) == 1.0
    # segments far longer than the MTBF, or restarts far longer: ~0, no OverflowError
    assert 0 <= intervals.ettr(1e6, 60, 1, 0) < 1e-300
    assert 0 <= intervals.ettr(10, 1, 1, 1e6) < 1e-300
    assert 0 < intervals.ettr(1e-300, 0, 1e300, 0) <= 1
    # more restart time, less ETTR; more save time, less ETTR
    assert intervals.ettr(600, 60, 3600, 600) < intervals.ettr(600, 60, 3600, 0)
    assert intervals.ettr(600, 120, 3600, 0) < intervals.ettr(600, 60, 3600, 0)


@pytest.mark.parametrize(
    "save_s, mtbf_s", [(60, 3600), (10, 86400), (1, 1e9), (0.01, 600), (300, 3600), (3600, 60)]
)
def test_best_interval_is_the_maximum(save_s, mtbf_s):
    best = intervals.best_interval_s(save_s, mtbf_s, 120)
    assert 0 < best < mtbf_s
    top = intervals.ettr(best, save_s, mtbf_s, 120)
    for f in (0.5, 0.9, 0.99, 1.01, 1.1, 2.0):
        assert top >= intervals.ettr(f * best, save_s, mtbf_s, 120), f
    # it solves (1 − u)·e^u = e^{−δ/M}, u = τ/M (1 − u is below float precision past δ/M ≈ 36)
    u = best / mtbf_s
    if save_s / mtbf_s < 30:
        assert math.log1p(-u) + u + save_s / mtbf_s == pytest.approx(0, abs=1e-12)
    # the restart time scales ETTR but does not move the optimum
    assert intervals.best_interval_s(save_s, mtbf_s, 0) == best


def test_approximations_agree_with_the_optimum_when_saves_are_cheap():
    save_s, mtbf_s = 10.0, 86400.0  # δ ≪ M
    best = intervals.best_interval_s(save_s, mtbf_s, 0)
    assert intervals.daly(save_s, mtbf_s) == pytest.approx(best, rel=1e-4)
    assert intervals.young(save_s, mtbf_s) == pytest.approx(best, rel=0.02)
    assert intervals.with_restart(save_s, mtbf_s, 0) == pytest.approx(best, rel=0.02)
    # Daly's approximation stays close further out; Young's drifts as δ/M grows
    assert intervals.daly(300, 3600) == pytest.approx(
        intervals.best_interval_s(300, 3600, 0), rel=0.01
    )
    assert intervals.young(300, 3600) > 1.1 * intervals.best_interval_s(300, 3600, 0)
    assert intervals.best_interval_s(0, 3600, 10) == 0.0  # a free save: as often as allowed


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: intervals.young(-1, 3600), "save_s"),
        (lambda: intervals.daly(60, 0), "mtbf_s"),
        (lambda: intervals.with_restart(60, 3600, -1), "restart_s"),
        (lambda: intervals.ettr(0, 60, 3600, 0), "interval_s"),
        (lambda: intervals.ettr(10, 60, math.nan, 0), "mtbf_s"),
        (lambda: intervals.best_interval_s(60, -3600, 0), "mtbf_s"),
        (lambda: Costs(0, 60, 0, 3600), "step_s"),
        (lambda: Costs(1, -60, 0, 3600), "save_s"),
        (lambda: Costs(1, 60, 0, math.inf), "mtbf_s"),
        (lambda: intervals.job_mtbf_s(0, 8), "mtbf_hours_per_host"),
        (lambda: intervals.job_mtbf_s(1000, 0), "processes"),
        (lambda: intervals.learned_mtbf_s(0, 10, 1), "prior_s"),
        (lambda: intervals.learned_mtbf_s(3600, -1, 1), "uptime_s"),
        (lambda: intervals.learned_mtbf_s(3600, 10, -1), "failures"),
        (lambda: intervals.learned_mtbf_s(3600, 10, 1, prior_weight=0), "prior_weight"),
        (lambda: intervals.choose(Costs(1, 60, 0, 3600), 0, 10), "min_steps"),
        (lambda: intervals.choose(Costs(1, 60, 0, 3600), 10, 5), "max_steps"),
        (lambda: Measurements(window=0), "window"),
        (lambda: Measurements().save(-0.5), "blocking_s"),
        (lambda: Measurements().restore(-2), "seconds"),
    ],
)
def test_bad_inputs_are_named(call, name):
    with pytest.raises(ValueError, match=name):  # OptionsError is a ValueError
        call()


# --- the chooser -------------------------------------------------------------------------


def test_choose_rounds_the_optimum_into_steps():
    costs = Costs(step_s=0.5, save_s=60, restart_s=300, mtbf_s=3600)
    choice = intervals.choose(costs, 1, 10_000)
    best = intervals.best_interval_s(60, 3600, 300)
    assert choice.steps == math.floor(best / 0.5 + 0.5) == 1236
    assert choice.costs == costs
    assert choice.predicted_ettr == intervals.ettr(choice.steps * 0.5, 60, 3600, 300)
    # the rounded interval loses next to nothing against the continuous optimum
    assert choice.predicted_ettr == pytest.approx(intervals.ettr(best, 60, 3600, 300), rel=1e-6)


def test_choose_clamps():
    costs = Costs(step_s=1, save_s=60, restart_s=0, mtbf_s=3600)  # best ≈ 618 steps
    assert intervals.choose(costs, 1, 100).steps == 100
    assert intervals.choose(costs, 1000, 2000).steps == 1000
    low = intervals.choose(costs, 1000, 2000)
    assert low.predicted_ettr == intervals.ettr(1000, 60, 3600, 0)
    assert intervals.choose(costs, 618, 618).steps == 618
    # tiny steps: the huge optimum is held at max_steps, no overflow
    assert intervals.choose(Costs(1e-300, 60, 0, 3600), 1, 5000).steps == 5000


def test_choose_when_the_mtbf_is_below_the_save_cost():
    costs = Costs(step_s=10, save_s=600, restart_s=60, mtbf_s=60)
    choice = intervals.choose(costs, 1, 10_000)
    assert 1 <= choice.steps <= 6  # never past the MTBF
    assert 0 < choice.predicted_ettr < 1e-3 and math.isfinite(choice.predicted_ettr)
    held = intervals.choose(costs, 50, 10_000)
    assert held.steps == 50 and 0 <= held.predicted_ettr < choice.predicted_ettr


def test_job_and_learned_mtbf():
    assert intervals.job_mtbf_s(1000, 8) == 450_000
    assert intervals.job_mtbf_s(2.5, 1) == 9000
    # no failures yet: the prior (grown by the uptime survived)
    assert intervals.learned_mtbf_s(3600, 0, 0) == 3600
    assert intervals.learned_mtbf_s(3600, 100, 0) == 3700
    # many failures: what was observed
    assert intervals.learned_mtbf_s(3600, 1e6, 100) == pytest.approx(1e4, rel=0.01)
    assert intervals.learned_mtbf_s(3600, 1e6, 100, prior_weight=1e-9) == pytest.approx(1e4)
    # a heavy prior holds out against few failures
    assert intervals.learned_mtbf_s(3600, 600, 1, prior_weight=100) == pytest.approx(
        3570.3, rel=1e-4
    )


# --- measurements ------------------------------------------------------------------------


def test_measurements_need_two_step_times_and_a_save():
    m = Measurements()
    assert m.costs(3600) is None
    m.step(0, 100.0)
    m.step(1, 101.0)
    m.save(0.5)
    assert m.costs(3600) is None  # one step time
    m.step(3, 104.0)  # 3.0 s over 2 steps, of which 0.5 s was the save: 1.25 s a step
    assert list(m.step_s) == [1.0, 1.25]
    costs = m.costs(3600)
    assert costs == Costs(step_s=1.125, save_s=0.5, restart_s=0.0, mtbf_s=3600)
    m.restore(30)
    m.restore(10)
    m.restore(20)
    assert m.costs(7200) == Costs(1.125, 0.5, 20, 7200)
    assert Measurements().costs(1) is None


def test_a_warm_up_save_is_no_save_time_but_no_step_time_either():
    m = Measurements()
    m.step(0, 100.0)
    m.save(2.0, warmup=True)  # a job's first save: compiling
    m.step(1, 103.0)  # 3 s, of which 2 s was that save
    assert list(m.step_s) == [1.0] and not m.save_s
    m.save(0.5)
    m.step(2, 104.5)
    assert list(m.step_s) == [1.0, 1.0] and list(m.save_s) == [0.5]


def test_measurements_start_afresh_when_the_step_goes_back():
    m = Measurements()
    m.step(10, 0.0)
    m.step(20, 10.0)
    m.step(20, 11.0)  # the same step again: no step time
    m.step(5, 500.0)  # a restore went back: no step time, measured from here
    m.step(15, 520.0)
    m.step(16, 519.0)  # the clock went back: ignored
    assert list(m.step_s) == [1.0, 2.0]
    m.save(0.0)  # a save too quick to see
    assert m.costs(3600) == Costs(1.5, 0.0, 0.0, 3600)


def test_the_choice_follows_a_new_step_time():
    m = Measurements(window=8)
    m.step(0, 0.0)
    m.save(10)  # blocks between step 0 and step 1: not part of a step time
    for s in range(1, 9):
        m.step(s, 10.0 + s)
    assert list(m.step_s) == [1.0] * 8
    before = intervals.choose(m.costs(3600), 1, 10_000)
    t = 18.0
    for s in range(9, 13):  # half the window at 2 s a step: the median moves halfway
        t += 2.0
        m.step(s, t)
    assert m.costs(3600).step_s == 1.5
    for s in range(13, 17):
        t += 2.0
        m.step(s, t)
    after = intervals.choose(m.costs(3600), 1, 10_000)
    assert m.costs(3600).step_s == 2.0 and len(m.step_s) == 8
    assert after.steps == math.floor(intervals.best_interval_s(10, 3600, 0) / 2 + 0.5)
    assert after.steps == pytest.approx(before.steps / 2, abs=1)


def test_contention_is_the_write_time_times_the_slowdown():
    m = Measurements()
    m.step(0, 0.0)
    for s, t in enumerate([1.0, 2.0, 4.0, 6.0], start=1):  # 1 s idle, 2 s with a write
        m.step(s, t, busy=s > 2)
    assert list(m.idle_step_s) == [1.0, 1.0] and list(m.busy_step_s) == [2.0, 2.0]
    # a 10 s write makes 5 steps of 2 s instead of 1 s: 5 s lost
    assert m.contention_s(10.0) == pytest.approx(5.0)
    m.save(0.25)
    costs = m.costs(3600, m.contention_s(10.0))
    assert costs == Costs(step_s=1.0, save_s=5.25, restart_s=0.0, mtbf_s=3600)
    # contention lengthens the best interval (a dearer save is made less often)
    cheap = intervals.choose(Costs(1.0, 0.25, 0.0, 3600), 1, 10_000)
    assert intervals.choose(costs, 1, 10_000).steps > cheap.steps


def test_contention_needs_both_kinds_of_steps_and_a_slowdown():
    m = Measurements()
    m.step(0, 0.0)
    for s in range(1, 5):
        m.step(s, float(s), busy=True)  # every step overlaps a write: no idle time known
    assert m.contention_s(10.0) == 0.0
    m.save(0.5)
    assert m.costs(3600) == Costs(1.0, 0.5, 0.0, 3600)  # all steps, blocking only
    for s in range(5, 8):
        m.step(s, float(s) + 0.5 * (s - 4), busy=False)  # idle steps are the slower ones
    assert m.contention_s(10.0) == 0.0  # noise, not contention
    unknown = Measurements()
    unknown.step(0, 0.0)
    unknown.step(1, 1.0)  # busy=None: counted in step_s only
    assert list(unknown.step_s) == [1.0] and not unknown.idle_step_s
    with pytest.raises(OptionsError, match="write_s"):
        m.contention_s(-1.0)


# --- options -----------------------------------------------------------------------------


def test_auto_needs_an_mtbf():
    with pytest.raises(OptionsError, match=r"save_interval_steps='auto' needs mtbf_hours"):
        jaxckpt.Options(save_interval_steps="auto")
    with pytest.raises(OptionsError, match=r"local_interval_steps='auto' needs mtbf_hours"):
        jaxckpt.EmergencyOptions(local_interval_steps="auto")
    o = jaxckpt.Options(save_interval_steps="auto", mtbf_hours=1000)
    assert is_auto(o.save_interval_steps) and (o.min_interval_steps, o.max_interval_steps) == (
        1,
        10_000,
    )
    e = jaxckpt.EmergencyOptions(
        local_interval_steps="auto", mtbf_hours=5, remote=dataclasses.replace(o, mtbf_hours=5)
    )
    assert is_auto(e.local_interval_steps) and is_auto(e.remote.save_interval_steps)
    default = jaxckpt.EmergencyOptions().remote  # the remote tier's "auto" reaches further
    assert (default.min_interval_steps, default.max_interval_steps) == (1, 100_000)
    assert o.run_log and e.run_log and not is_auto(10) and not is_auto("Auto")
    # an mtbf without "auto" is fine (the goodput report can use it)
    assert jaxckpt.Options(mtbf_hours=2.5, save_interval_steps=np.int64(5)).mtbf_hours == 2.5


@pytest.mark.parametrize(
    "cls, kw, name",
    [
        (jaxckpt.Options, {"save_interval_steps": "sometimes"}, "save_interval_steps"),
        (jaxckpt.Options, {"save_interval_steps": 2.5}, "save_interval_steps"),
        (jaxckpt.Options, {"save_interval_steps": True}, "save_interval_steps"),
        (jaxckpt.Options, {"save_interval_steps": 0}, "save_interval_steps"),
        (jaxckpt.Options, {"mtbf_hours": 0}, "mtbf_hours"),
        (jaxckpt.Options, {"mtbf_hours": "1000"}, "mtbf_hours"),
        (jaxckpt.Options, {"mtbf_hours": math.inf}, "mtbf_hours"),
        (jaxckpt.Options, {"min_interval_steps": 0}, "min_interval_steps"),
        (
            jaxckpt.Options,
            {"min_interval_steps": 20, "max_interval_steps": 10},
            "max_interval_steps",
        ),
        (jaxckpt.EmergencyOptions, {"local_interval_steps": "never"}, "local_interval_steps"),
        (jaxckpt.EmergencyOptions, {"mtbf_hours": -1.0}, "mtbf_hours"),
        (jaxckpt.EmergencyOptions, {"max_interval_steps": 0}, "max_interval_steps"),
    ],
)
def test_bad_interval_options_are_named(cls, kw, name):
    with pytest.raises(OptionsError, match=name):
        cls(**kw)


def _toml(values: dict) -> str:
    """A TOML table of scalars, and a dict value as a table of its own (None left out: TOML
    has no null)."""
    lines, tables = [], []
    for k, v in values.items():
        if isinstance(v, dict):
            tables.append(f"[{k}]\n" + _toml({n: x for n, x in v.items() if n != "best_fn"}))
        elif v is not None:
            lines.append(f"{k} = {json.dumps(v)}")  # JSON scalars are TOML scalars here
    return "\n".join(lines) + "\n" + "".join(tables)


def test_auto_in_toml_files_round_trips(tmp_path):
    path = tmp_path / "auto.toml"
    cases = [
        jaxckpt.Options(
            save_interval_steps="auto", mtbf_hours=2000.0, min_interval_steps=50,
            max_interval_steps=5000, run_log=False, max_to_keep=3,
        ),
        jaxckpt.EmergencyOptions(
            local_interval_steps="auto", mtbf_hours=1000.0, min_interval_steps=5,
            run_log=False,
            remote=jaxckpt.Options(
                save_interval_steps="auto", mtbf_hours=1000.0, min_interval_steps=500,
                max_to_keep=3, chunk_bytes=1 << 20,
            ),
        ),
    ]  # fmt: skip
    for opts in cases:
        values = dataclasses.asdict(opts)
        values.pop("best_fn", None)
        path.write_text(_toml(values))
        assert type(opts).from_file(path) == opts
    path.write_text('save_interval_steps = "auto"\n')
    with pytest.raises(OptionsError, match="mtbf_hours"):
        jaxckpt.Options.from_file(path)
    path.write_text('local_interval_steps = "auto"\n')
    with pytest.raises(OptionsError, match="mtbf_hours"):
        jaxckpt.EmergencyOptions.from_file(path)
