"""The eval gate on hand-made scores (delta 0.05, epsilon 0.02 unless stated)."""

import math

import pytest

from flywheel.config import ConfigError, validate
from flywheel.loop.gate import GateConfig, decide

CFG = GateConfig(delta=0.05, epsilon=0.02)


def test_gain_without_regression_promotes():
    d = decide({"new_failures": 0.10, "arith": 0.80, "calc": 0.60},
               {"new_failures": 0.30, "arith": 0.79, "calc": 0.60}, CFG)
    assert d.promote
    assert d.gain == pytest.approx(0.20)
    assert d.deltas == pytest.approx({"new_failures": 0.20, "arith": -0.01, "calc": 0.0})
    assert d.reasons[0] == "new_failures 0.100 -> 0.300 (+20.0 pts) >= delta 5.0 pts"  # new failures first
    assert d.summary().startswith("promote: new_failures")


def test_gain_below_delta_rejects():
    d = decide({"new_failures": 0.10, "arith": 0.8}, {"new_failures": 0.14, "arith": 0.9}, CFG)
    assert not d.promote
    assert "(+4.0 pts) < delta 5.0 pts" in d.reasons[0]


def test_gain_exactly_delta_promotes():
    # 0.15 - 0.10 is 0.04999999999999999 in floats: the rule holds at equality
    assert decide({"new_failures": 0.10}, {"new_failures": 0.15}, CFG).promote


def test_regression_beyond_epsilon_rejects_and_names_the_suite():
    d = decide({"new_failures": 0.1, "arith": 0.80, "calc": 0.60},
               {"new_failures": 0.9, "arith": 0.77, "calc": 0.59}, CFG)
    assert not d.promote
    assert "arith 0.800 -> 0.770 (-3.0 pts): drops more than epsilon 2.0 pts" in d.reasons
    assert "calc 0.600 -> 0.590 (-1.0 pts)" in d.reasons  # within epsilon: stated, not blamed


def test_drop_exactly_epsilon_is_allowed():
    assert decide({"new_failures": 0.0, "arith": 0.50}, {"new_failures": 0.5, "arith": 0.48}, CFG).promote


@pytest.mark.parametrize("inc, cand, why", [
    ({"arith": 0.5}, {"arith": 0.6}, "no 'new_failures' suite was measured"),
    ({"new_failures": 0.1, "arith": 0.5}, {"new_failures": 0.5}, "arith: no score for the candidate"),
    ({"new_failures": 0.1}, {"new_failures": math.nan}, "new_failures: non-finite score (incumbent 0.1, candidate nan)"),
])
def test_unmeasured_rejects(inc, cand, why):
    d = decide(inc, cand, CFG)
    assert not d.promote and why in d.reasons


def test_custom_suite_name_and_config_errors():
    cfg = GateConfig(delta=0.0, epsilon=0.0, new_failures="week3")
    assert decide({"week3": 0.2, "old": 0.5}, {"week3": 0.2, "old": 0.5}, cfg).promote
    with pytest.raises(ConfigError, match="delta"):
        validate({"delta": -0.1}, GateConfig)
