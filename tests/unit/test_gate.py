"""The eval gate on hand-made per-task outcomes and scores (delta 0.05, epsilon 0.02, 95%
confidence, min_new_failures 20 unless stated). The bounds' own arithmetic is test_paired.py's."""

import math

import pytest

from flywheel.config import ConfigError, validate
from flywheel.loop.gate import Best, GateConfig, decide
from flywheel.loop.paired import Outcomes, upper_bound

CFG = GateConfig(delta=0.05, epsilon=0.02)


def pairs(n: int, both: int = 0, gained: int = 0, lost: int = 0, name: str = "t") -> tuple[Outcomes, Outcomes]:
    """(incumbent, candidate) on tasks name0..: `both` pass for both, then `gained` only for the
    candidate, then `lost` only for the incumbent; the rest fail for both."""
    ids = [f"{name}{i}" for i in range(n)]
    inc = [i < both or both + gained <= i < both + gained + lost for i in range(n)]
    cand = [i < both + gained for i in range(n)]
    return Outcomes.of(ids, inc), Outcomes.of(ids, cand)


def drop(inc: Outcomes, k: int) -> Outcomes:
    """`inc` with its first `k` passed tasks failed."""
    flip = [i for i, p in enumerate(inc.passed) if p][:k]
    return Outcomes(inc.tasks, tuple(p and i not in flip for i, p in enumerate(inc.passed)))


NEW_INC, NEW_CAND = pairs(40, both=4, gained=10)  # 0.100 -> 0.350: a clear gain on 40 new failures


def test_a_gain_with_confidence_and_no_regression_promotes():
    d = decide({"new_failures": NEW_INC, "arith": 0.80, "calc": 0.60},
               {"new_failures": NEW_CAND, "arith": 0.79, "calc": 0.60}, CFG)
    assert d.promote
    assert d.gain == pytest.approx(0.25)
    assert d.deltas == pytest.approx({"new_failures": 0.25, "arith": -0.01, "calc": 0.0})
    assert d.reasons[0].startswith("new_failures 0.100 -> 0.350 (+25.0 pts, 95% lower bound +")  # new failures first
    assert d.reasons[0].endswith("; 10 gained, 0 lost of 40 tasks) >= delta 5.0 pts")
    assert 0.05 <= d.bounds["new_failures"] < 0.25
    assert d.summary().startswith("promote: new_failures")


def test_the_reason_states_the_bound_three_of_seven():
    # S* ~ Binomial(7, 3/7): P(S* = 0) = (4/7)^7 = 0.020 < 0.05 <= P(S* <= 1) = 0.124, so LB = 1/7
    inc, cand = pairs(7, gained=3)
    d = decide({"new_failures": inc}, {"new_failures": cand}, GateConfig(min_new_failures=7))
    assert d.promote and d.bounds["new_failures"] == pytest.approx(1 / 7)
    assert d.reasons == ["new_failures 0.000 -> 0.429 (+42.9 pts, 95% lower bound +14.3 pts; "
                         "3 gained, 0 lost of 7 tasks) >= delta 5.0 pts"]


def test_a_point_gain_above_delta_without_confidence_rejects():
    # 2 of 20 gained is +10 points, but P(S* = 0) = 0.9^20 = 0.122 >= 0.05: the lower bound is 0
    d = decide({"new_failures": pairs(20, gained=2)[0]}, {"new_failures": pairs(20, gained=2)[1]}, CFG)
    assert not d.promote and d.bounds["new_failures"] == 0.0
    assert d.reasons[0] == ("new_failures 0.000 -> 0.100 (+10.0 pts, 95% lower bound +0.0 pts; "
                            "2 gained, 0 lost of 20 tasks) < delta 5.0 pts")
    # 3 of 20: P(S* = 0) = 0.85^20 = 0.039 < 0.05, so LB = 1/20 = delta exactly, which passes
    inc, cand = pairs(20, gained=3)
    assert decide({"new_failures": inc}, {"new_failures": cand}, CFG).promote
    # at 99% it does not: P(S* = 0) = 0.039 >= 0.01
    assert not decide({"new_failures": inc}, {"new_failures": cand}, GateConfig(confidence=0.99)).promote


def test_losses_on_new_failures_count_against_the_gain():
    inc, cand = pairs(40, gained=10, lost=6)  # +10 points net, but the differences spread wide
    d = decide({"new_failures": inc}, {"new_failures": cand}, CFG)
    assert d.gain == pytest.approx(0.1) and not d.promote and d.bounds["new_failures"] < 0.05
    assert "; 10 gained, 6 lost of 40 tasks) < delta 5.0 pts" in d.reasons[0]


def test_too_few_new_failures_to_decide():
    inc, cand = pairs(7, gained=3)
    d = decide({"new_failures": inc}, {"new_failures": cand}, CFG)
    assert not d.promote
    assert d.reasons == ["too few new failures to decide: 7 < 20 (new_failures 0.000 -> 0.429)"]


def test_new_failures_need_per_task_outcomes_on_the_same_tasks():
    d = decide({"new_failures": 0.1}, {"new_failures": 0.5}, CFG)
    assert not d.promote
    assert d.reasons == ["new_failures: no per-task outcomes; the gain's confidence bound needs them"]
    other = Outcomes.of([f"x{i}" for i in range(40)], NEW_CAND.passed)
    d = decide({"new_failures": NEW_INC}, {"new_failures": other}, CFG)
    assert not d.promote and "not scored on the same tasks" in d.reasons[0]


def test_regression_beyond_epsilon_rejects_and_names_the_suite():
    d = decide({"new_failures": NEW_INC, "arith": 0.80, "calc": 0.60},
               {"new_failures": NEW_CAND, "arith": 0.77, "calc": 0.59}, CFG)
    assert not d.promote
    assert "arith 0.800 -> 0.770 (-3.0 pts): drops more than epsilon 2.0 pts" in d.reasons
    assert "calc 0.600 -> 0.590 (-1.0 pts)" in d.reasons  # within epsilon: stated, not blamed


def test_drop_exactly_epsilon_is_allowed():
    assert decide({"new_failures": NEW_INC, "arith": 0.50}, {"new_failures": NEW_CAND, "arith": 0.48}, CFG).promote


def test_a_paired_regression_reports_its_upper_bound():
    inc, cand = pairs(200, both=150, gained=1, lost=5, name="a")  # 0.775 -> 0.755: -2.0 pts, the edge
    d = decide({"new_failures": NEW_INC, "add": inc}, {"new_failures": NEW_CAND, "add": cand}, CFG)
    ub = upper_bound(1, 5, 200, 0.95)
    assert d.promote and d.bounds["add"] == ub and -0.02 < ub <= 0.0
    assert f"add 0.775 -> 0.755 (-2.0 pts, 95% upper bound {100 * ub:+.1f} pts; 1 gained, 5 lost of 200 tasks)" \
        in d.reasons
    inc, cand = pairs(200, both=150, gained=1, lost=6, name="a")  # -2.5 pts
    d = decide({"new_failures": NEW_INC, "add": inc}, {"new_failures": NEW_CAND, "add": cand}, CFG)
    assert not d.promote and d.reasons[-1].endswith("1 gained, 6 lost of 200 tasks): drops more than epsilon 2.0 pts")


def test_a_significant_drop_beyond_epsilon_rejects_at_large_n():
    # 2000 tasks, 100 lost and 20 gained: -4.0 points, its 95% upper bound about -3.0: significant
    inc, cand = pairs(2000, both=1500, gained=20, lost=100, name="a")
    d = decide({"new_failures": NEW_INC, "add": inc}, {"new_failures": NEW_CAND, "add": cand}, CFG)
    assert not d.promote and d.bounds["add"] < -0.02 and d.deltas["add"] == pytest.approx(-0.04)


def _chain(steps: list[int], best_rule: bool, paired: bool = True) -> list[tuple[str, bool, float]]:
    """Candidates each losing steps[i] of 200 'add' tasks against the incumbent (the production
    version then), each promoted iff the gate says so; the base passes 160 (0.800). Returns
    (candidate, promoted, its accuracy)."""
    base = Outcomes.of([f"a{i}" for i in range(200)], [i < 160 for i in range(200)])
    production, best = base, Best("v1", base if paired else base.accuracy)
    out = []
    for i, k in enumerate(steps):
        cand = drop(production, k)
        d = decide({"new_failures": NEW_INC, "add": production}, {"new_failures": NEW_CAND, "add": cand}, CFG,
                   best={"add": best} if best_rule else None)
        out.append((f"c{i + 1}", d.promote, cand.accuracy))
        if d.promote:
            production = cand
            if cand.accuracy > (best.score.accuracy if paired else best.score):
                best = Best(f"v{i + 2}", cand if paired else cand.accuracy)
    return out


def test_drift_cannot_accumulate_three_candidates_each_minus_1_5_points():
    # each candidate is -1.5 pts (3 of 200 tasks) against its incumbent, within epsilon 2 pts
    assert _chain([3, 3, 3], best_rule=False) == [("c1", True, 0.785), ("c2", True, 0.77), ("c3", True, 0.755)]
    # against the best promoted score (the base's 0.800): c1 is -1.5, c2 and c3 (from c1, the
    # production version still) are -3.0: rejected; production stays within epsilon of its best
    assert _chain([3, 3, 3], best_rule=True) == [("c1", True, 0.785), ("c2", False, 0.77), ("c3", False, 0.77)]
    assert _chain([3, 3, 3], best_rule=True, paired=False) == _chain([3, 3, 3], best_rule=True)


def test_drift_the_third_minus_1_point_step_is_rejected():
    # -1, -2 (epsilon exactly: allowed), -3 below the best: the third is rejected
    assert _chain([2, 2, 2], best_rule=True) == [("c1", True, 0.79), ("c2", True, 0.78), ("c3", False, 0.77)]


def test_the_best_rule_says_what_it_compared():
    base = Outcomes.of([f"a{i}" for i in range(200)], [i < 160 for i in range(200)])
    inc = drop(base, 3)
    cand = drop(inc, 3)
    paired = decide({"new_failures": NEW_INC, "add": inc}, {"new_failures": NEW_CAND, "add": cand}, CFG,
                    best={"add": Best("v1", base)})
    assert not paired.promote and paired.below_best == {"add": pytest.approx(-0.03)}
    ub = upper_bound(0, 6, 200, 0.95)
    assert paired.reasons[-1] == (f"add best 0.800 (v1) -> 0.770 (-3.0 pts, 95% upper bound {100 * ub:+.1f} pts; "
                                  "0 gained, 6 lost of 200 tasks): drops more than epsilon 2.0 pts below the best "
                                  "promoted score")
    other_tasks = Outcomes.of([f"b{i}" for i in range(200)], base.passed)  # no pairing: accuracies only
    point = decide({"new_failures": NEW_INC, "add": inc}, {"new_failures": NEW_CAND, "add": cand}, CFG,
                   best={"add": Best("v1", other_tasks)})
    assert point.reasons[-1] == ("add best 0.800 (v1) -> 0.770 (-3.0 pts, point estimate): drops more than "
                                 "epsilon 2.0 pts below the best promoted score")
    # a best at or below the incumbent adds no rule (the incumbent's is the stricter)
    quiet = decide({"new_failures": NEW_INC, "add": inc}, {"new_failures": NEW_CAND, "add": cand}, CFG,
                   best={"add": Best("v1", 0.70)})
    assert quiet.promote and quiet.below_best == {} and len(quiet.reasons) == 2


@pytest.mark.parametrize("inc, cand, why", [
    ({"arith": 0.5}, {"arith": 0.6}, "no 'new_failures' suite was measured"),
    ({"new_failures": NEW_INC, "arith": 0.5}, {"new_failures": NEW_CAND}, "arith: no score for the candidate"),
    ({"new_failures": 0.1}, {"new_failures": math.nan},
     "new_failures: non-finite score (incumbent 0.1, candidate nan)"),
])
def test_unmeasured_rejects(inc, cand, why):
    d = decide(inc, cand, CFG)
    assert not d.promote and why in d.reasons


def test_custom_suite_name_and_config_errors():
    cfg = GateConfig(delta=0.0, epsilon=0.0, new_failures="week3")
    inc, cand = pairs(20, both=4)
    assert decide({"week3": inc, "old": 0.5}, {"week3": cand, "old": 0.5}, cfg).promote
    with pytest.raises(ConfigError, match="delta"):
        validate({"delta": -0.1}, GateConfig)
    with pytest.raises(ConfigError, match="confidence"):
        validate({"confidence": 1.0}, GateConfig)
    with pytest.raises(ConfigError, match="min_new_failures"):
        validate({"min_new_failures": 0}, GateConfig)


def test_a_loop_that_could_never_decide_is_a_config_error():
    from flywheel.loop.loop_config import LoopConfig

    with pytest.raises(ConfigError, match="new_failures_max 10 < gate.min_new_failures 20"):
        validate({"eval": {"new_failures_max": 10}}, LoopConfig)
