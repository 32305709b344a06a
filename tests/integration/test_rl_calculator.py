"""Multi-turn tool-use RL: a policy that answers multiplications from memory learns to call
its calculator. The warm start is warm_starts.calculator_from_memory_warm_start (~2 min on 2
cores): a tiny model taught to copy numbers into a calc call and out of its result, then
nudged to answer without the tool, so greedy decoding fails while sampling still calls the
tool in some episodes. GRPO at temperature 1 rewards those and the first-turn decision flips.
Where the flip lands varies with float rounding across CPU families, so the test gives it 20
steps and a second seed; the measured runs are in docs/benchmarks.md."""

from __future__ import annotations

import pytest

from warm_starts import CALCULATOR_FROM_MEMORY, calculator_from_memory_warm_start

from flywheel.config import RLConfig, validate
from flywheel.train.rl import run_rl


@pytest.fixture(scope="module")
def answers_from_memory(tmp_path_factory):
    return calculator_from_memory_warm_start(tmp_path_factory.mktemp("calc-warm"))


@pytest.mark.slow  # a learning outcome: make test-all
def test_grpo_teaches_a_policy_that_answers_from_memory_to_call_its_calculator(answers_from_memory, tmp_path):
    """Rule: the flip lands within 20 steps for seed 0 or, failing that, seed 1 (where it lands
    varies with float rounding across CPU families; a second seed is tried only when the first
    misses, so a healthy run costs one)."""
    model, copying = answers_from_memory
    assert copying >= 0.8, f"stage 1 did not learn to copy numbers through the tool: held-out success {copying}"
    outcomes = []
    for seed in (0, 1):
        cfg = validate(dict(
            model=str(model), output_dir=str(tmp_path / f"rl-{seed}"),
            env={"name": "calculator", "settings": CALCULATOR_FROM_MEMORY},
            train={"steps": 20, "groups_per_step": 4, "group_size": 8, "seed": seed},
            sampling={"temperature": 1.0, "max_tokens": 128}, optim={"lr": 1e-4},
            eval={"tasks": 50, "every": 20}, log={"progress": False}, threads=2), RLConfig)
        result = run_rl(cfg, log=lambda m: None)
        before, after = result.evals[0], result.evals[-1]
        assert before["eval/reward/used_tool"] < 0.1 and before["eval/greedy_accuracy"] < 0.1, before
        outcomes.append((seed, before, after))
        if after["eval/reward/used_tool"] >= 0.9 and \
                after["eval/greedy_accuracy"] >= before["eval/greedy_accuracy"] + 0.3:
            return
    pytest.fail(f"no seed flipped the policy to its calculator within 20 steps: {outcomes}")
