"""The benchmarks' measuring rules (bench/common.py), worked by hand."""

import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import median_range, sustained_at  # noqa: E402


def test_touching_the_target_and_falling_back_does_not_count():
    assert sustained_at([0.5, 0.9, 0.7, 0.9, 0.95], 0.9) == 3


def test_sustained_from_the_first_evaluation_and_never_reached():
    assert sustained_at([0.9, 0.91, 0.9], 0.9) == 0
    assert sustained_at([0.9, 0.95, 0.89], 0.9) is None
    assert sustained_at([], 0.9) is None


def test_median_range_counts_runs_that_missed_the_target_as_slowest():
    assert median_range([3.0, 1.0, 2.0]) == "2.00 (1.00-3.00, n=3)"
    assert median_range([3.0, math.inf, 1.0]) == "3.00 (1.00-3.00, n=3, 1 not reached)"
    assert median_range([math.inf, math.inf, 1.0]).startswith("not reached (1.00-1.00")


def test_the_demo_line_is_read_from_the_last_demo_line_only():
    from demo import parse_demo_line

    out = "demo took 11 min\ndemo: new_family_before=0.00 old_delta=+1.0 cycles=7\ndemo: new_family_after=0.97 " \
          "old_delta=-2.5 final_old_delta=nan cycles=6\n"
    got = parse_demo_line(out)
    assert got["new_family_after"] == 0.97 and got["old_delta"] == -2.5 and got["cycles"] == 6
    assert math.isnan(got["final_old_delta"]) and "new_family_before" not in got
    assert "general_kl" not in got  # a tiny base prints no general-ability line


def test_a_pretrained_base_adds_its_general_ability_figures():
    from demo import parse_demo_line

    from flywheel.demo.summary import general_line

    line = general_line({"general_kl": 0.0123, "simple_right_before": 20.0, "simple_kept": 19.0,
                         "simple_points_lost": 5.0})
    got = parse_demo_line(f"{line}\ndemo: cycles=7\n")
    assert got == {"cycles": 7.0, "general_kl": 0.0123, "simple_lost": 5.0}
