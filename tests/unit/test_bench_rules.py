"""The benchmarks' measuring rules (bench/common.py), worked by hand."""

import math
import sys
from pathlib import Path

import pytest

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
                         "simple_points_lost": 5.0, "simple_gained": 3.0, "simple_net_points_lost": -10.0})
    got = parse_demo_line(f"{line}\ndemo: cycles=7\n")
    assert got == {"cycles": 7.0, "general_kl": 0.0123, "simple_lost": 5.0, "simple_net_lost": -10.0}
    # a run of before the net figure: its line ends at the one-sided points
    old = line[:line.index("points lost)") + len("points lost)")]
    assert parse_demo_line(f"{old}\ndemo: cycles=7\n") == {"cycles": 7.0, "general_kl": 0.0123, "simple_lost": 5.0}


def test_paired_points_is_the_mean_difference_with_a_normal_interval():
    from general_probe import paired_points

    # differences 50, 0, 0, 50 points: mean 25, sample sd 50/sqrt(3), half-width 1.96 x sd / 2
    mean, low, high = paired_points([1.0, 0.5, 0.0, 1.0], [0.5, 0.5, 0.0, 0.5])
    half = 1.96 * (50 / 3 ** 0.5) / 2
    assert mean == pytest.approx(25) and low == pytest.approx(25 - half) and high == pytest.approx(25 + half)


def test_the_no_content_control_adds_scaled_noise_to_weight_matrices_only(tmp_path):
    import torch

    from general_probe import noisy_copy

    from flywheel.models import TinySpec, build_tiny_model, load

    base = build_tiny_model(tmp_path / "base", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    copy, _ = load(noisy_copy(base, 0.1, 0, tmp_path / "noisy"))
    original, _ = load(base)
    ref = original.state_dict()
    for name, w in copy.state_dict().items():
        if w.ndim == 2:  # the tied embeddings take the head's noise: one tensor, two names
            rel = (w - ref[name]).pow(2).mean().sqrt() / ref[name].pow(2).mean().sqrt()
            assert 0.08 < float(rel) < 0.12, name  # sigma x the matrix's RMS
        else:
            assert torch.equal(w, ref[name]), name  # norms and biases untouched
    assert torch.equal(copy.state_dict()["lm_head.weight"], copy.state_dict()["model.embed_tokens.weight"])
