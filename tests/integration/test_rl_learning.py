"""RL learns: held-out greedy accuracy on the shared `ab+cd=` task rises by >= 10 points in 40
steps from conftest's `arith_warm_start` (a model taught to forget carries most of the time:
~0.4 greedy), with rollouts one step off-policy (seeds: $FLYWHEEL_TEST_SEEDS, else 0); measured
across seeds and CPU settings in docs/benchmarks.md ("The arithmetic warm start on a plateau")."""

import pytest

from flywheel.config import RLConfig, validate
from flywheel.train.rl import run_rl


@pytest.mark.slow  # a learning outcome: make test-all
def test_async_grpo_raises_heldout_accuracy_by_ten_points(arith_warm_start, learning_seed, tmp_path):
    cfg = validate(dict(
        model=str(arith_warm_start), output_dir=str(tmp_path / "rl"), env={"name": "arithmetic"},
        train={"steps": 40, "groups_per_step": 8, "group_size": 8, "seed": learning_seed},
        sampling={"temperature": 1.0, "max_tokens": 6}, optim={"lr": 1e-4},
        eval={"tasks": 200}, log={"progress": False}, threads=2, max_off_policy_steps=1), RLConfig)
    result = run_rl(cfg, log=lambda m: None)
    before, after = result.evals[0]["eval/greedy_accuracy"], result.evals[-1]["eval/greedy_accuracy"]
    assert 0.05 < before < 0.8, f"the warm start is off its ~0.4: {before}"
    assert after >= before + 0.10, (before, after)
