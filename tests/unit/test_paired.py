"""The exact paired bootstrap (loop/paired.py) against hand-worked distributions, a brute-force
multinomial sum, and the normal approximation at large n; and the one-bit-per-task record."""

import math

import pytest

from flywheel.loop.paired import Outcomes, bootstrap_pmf, lower_bound, pair, task_digest, upper_bound


def _brute(gained: int, lost: int, n: int) -> list[float]:
    """P(S* = s), s = -n..n, summing the multinomial over every (#+1, #-1) resample: O(n^2)."""
    a, b, c = gained / n, (n - gained - lost) / n, lost / n
    out = [0.0] * (2 * n + 1)
    for p in range(n + 1):
        for m in range(n + 1 - p):
            out[p - m + n] += math.comb(n, p) * math.comb(n - p, m) * a ** p * c ** m * b ** (n - p - m)
    return out


def test_three_tasks_one_gained_one_lost_is_three_uniform_draws():
    # S* is the sum of 3 draws from {-1, 0, 1}: its 27 outcomes give counts 1 3 6 7 6 3 1 for S* = -3..3
    assert [round(27 * p, 9) for p in bootstrap_pmf(1, 1, 3)] == [1, 3, 6, 7, 6, 3, 1]
    # P(S* <= -3) = 1/27 = 0.037 < 0.05 <= P(S* <= -2) = 4/27 = 0.148
    assert lower_bound(1, 1, 3, 0.95) == pytest.approx(-2 / 3)
    assert upper_bound(1, 1, 3, 0.95) == pytest.approx(2 / 3)
    # at 80%: P(S* <= -2) = 4/27 < 0.2 <= P(S* <= -1) = 10/27
    assert lower_bound(1, 1, 3, 0.8) == pytest.approx(-1 / 3)


def test_seven_tasks_three_gained_is_binomial():
    # S* ~ Binomial(7, 3/7): P(0) = (4/7)^7 = 0.0199, P(<= 1) = 0.0199 + 7 (3/7) (4/7)^6 = 0.1244
    pmf = bootstrap_pmf(3, 0, 7)
    assert pmf[7] == pytest.approx((4 / 7) ** 7) and pmf[8] == pytest.approx(3 * (4 / 7) ** 6)
    assert sum(pmf[:7]) == 0.0  # no resample can lose a task
    assert lower_bound(3, 0, 7, 0.95) == pytest.approx(1 / 7)  # +14.3 pts, while the point gain is 3/7
    assert lower_bound(3, 0, 7, 0.5) == pytest.approx(3 / 7)  # the median: P(<= 2) = 0.359 < 0.5 <= P(<= 3) = 0.653
    assert upper_bound(3, 0, 7, 0.95) == pytest.approx(5 / 7)  # P(>= 6) = 0.0274 < 0.05 <= P(>= 5) = 0.1266


def test_two_tasks_at_an_exact_tie():
    # d = (+1, -1): S* = -2, 0, 2 with 1/4, 1/2, 1/4; at 75% the 0.25 quantile is reached exactly at -2
    assert bootstrap_pmf(1, 1, 2) == pytest.approx([0.25, 0, 0.5, 0, 0.25])
    assert lower_bound(1, 1, 2, 0.75) == -1.0
    assert lower_bound(1, 1, 2, 0.7) == 0.0


@pytest.mark.parametrize("gained, lost, n", [(0, 0, 5), (5, 0, 5), (0, 5, 5), (5, 3, 20), (0, 4, 10),
                                             (7, 13, 20), (10, 10, 20), (3, 2, 50), (20, 1, 40)])
def test_the_recurrence_matches_the_multinomial_sum(gained, lost, n):
    got, want = bootstrap_pmf(gained, lost, n), _brute(gained, lost, n)
    assert max(abs(x - y) for x, y in zip(got, want)) < 1e-12
    assert sum(got) == pytest.approx(1.0, abs=1e-12)


def test_no_difference_and_all_gained_are_certain():
    assert lower_bound(0, 0, 30, 0.95) == upper_bound(0, 0, 30, 0.95) == 0.0
    assert lower_bound(30, 0, 30, 0.95) == 1.0 and upper_bound(0, 30, 30, 0.95) == -1.0


@pytest.mark.parametrize("gained, lost, n", [(40, 10, 200), (100, 50, 1000), (300, 280, 5000)])
def test_large_n_agrees_with_the_normal_approximation(gained, lost, n):
    # the mean of d has variance (E[d^2] - mean^2) / n; its 5% quantile is mean - 1.645 sd
    mean = (gained - lost) / n
    sd = math.sqrt(((gained + lost) / n - mean ** 2) / n)
    assert lower_bound(gained, lost, n, 0.95) == pytest.approx(mean - 1.645 * sd, abs=max(2 / n, 0.1 * sd))
    assert upper_bound(gained, lost, n, 0.95) == pytest.approx(mean + 1.645 * sd, abs=max(2 / n, 0.1 * sd))


def test_a_very_large_suite_stays_normalised():
    assert sum(bootstrap_pmf(30_000, 10_000, 100_000)) == pytest.approx(1.0, abs=1e-6)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError):
        bootstrap_pmf(3, 3, 5)
    with pytest.raises(ValueError):
        lower_bound(1, 0, 5, 1.0)


def test_outcomes_pair_task_by_task_and_record_one_bit_per_task():
    ids = ["t1", "t2", "t3", "t4", "t5"]
    inc = Outcomes.of(ids, [True, True, False, False, True])
    cand = Outcomes.of(ids, [True, False, True, True, True])
    p = pair(inc, cand)
    assert (p.n, p.gained, p.lost, p.mean) == (5, 2, 1, pytest.approx(0.2))
    assert p.mean == pytest.approx(cand.accuracy - inc.accuracy)
    # 1 1 0 0 1 (+ 3 zero bits) = 1100 1000 = "c8"
    assert inc.record() == {"tasks": task_digest(ids), "n": 5, "passed": "c8"}
    assert Outcomes.from_record(inc.record()) == inc
    with pytest.raises(ValueError, match="not the same tasks"):
        pair(inc, Outcomes.of(["t1", "t2", "t3", "t5", "t4"], cand.passed))  # the order is part of the task list
    with pytest.raises(ValueError, match="hex digits"):
        Outcomes.from_record({"tasks": "x", "n": 9, "passed": "c8"})
