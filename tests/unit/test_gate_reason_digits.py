"""The gate's reasons print enough digits to show why a rule failed (issue 35, point 9): a lower
bound of 5/101 = 4.95 points once read "+5.0 pts < delta 5.0 pts"."""

from __future__ import annotations

from flywheel.loop.gate import GateConfig, decide, telling_digits
from flywheel.loop.paired import Outcomes

CFG = GateConfig(delta=0.05, epsilon=0.02)


def pairs(n: int, gained: int = 0, lost: int = 0, both: int = 0) -> tuple[Outcomes, Outcomes]:
    """(incumbent, candidate) on n tasks: `both` pass for both, `gained` only for the candidate,
    `lost` only for the incumbent."""
    ids = [f"t{i}" for i in range(n)]
    inc = [i < both or both + gained <= i < both + gained + lost for i in range(n)]
    return Outcomes.of(ids, inc), Outcomes.of(ids, [i < both + gained for i in range(n)])


def test_telling_digits_is_the_fewest_that_print_apart():
    assert telling_digits(0.0495, 0.05) == 2  # 4.95 vs 5.00
    assert telling_digits(0.04999, 0.05) == 3  # 4.999 vs 5.000
    assert telling_digits(0.03, 0.05) == 1
    assert telling_digits(0.05, 0.05) == 1  # equal: nothing to tell


def test_a_lower_bound_just_under_delta_reads_below_it():
    # 9 of 101 gained, none lost: the exact paired bootstrap's 95% lower bound is 5/101 = 0.0495
    inc, cand = pairs(101, gained=9)
    d = decide({"new_failures": inc}, {"new_failures": cand}, CFG)
    assert not d.promote and abs(d.bounds["new_failures"] - 5 / 101) < 1e-12
    assert d.reasons == ["new_failures 0.000 -> 0.089 (+8.9 pts, 95% lower bound +4.95 pts; "
                         "9 gained, 0 lost of 101 tasks) < delta 5.00 pts"]


def test_a_drop_just_beyond_epsilon_reads_beyond_it():
    # 5 of 245 lost: -2.04 points, beyond epsilon 2 (with one digit both read 2.0)
    inc, cand = pairs(245, lost=5, both=100)
    d = decide({"new_failures": pairs(40, gained=20)[0], "add": inc},
               {"new_failures": pairs(40, gained=20)[1], "add": cand}, CFG)
    assert not d.promote
    why = next(r for r in d.reasons if r.startswith("add"))
    assert why.startswith("add 0.429 -> 0.408 (-2.04 pts, 95% upper bound ") and \
        why.endswith("0 gained, 5 lost of 245 tasks): drops more than epsilon 2.00 pts"), why


def test_passing_reasons_keep_one_digit():
    inc, cand = pairs(40, gained=10)
    d = decide({"new_failures": inc}, {"new_failures": cand}, CFG)
    assert d.promote and d.reasons[0].endswith(">= delta 5.0 pts") and "+25.0 pts" in d.reasons[0]
