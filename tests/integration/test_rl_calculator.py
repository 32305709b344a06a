"""Multi-turn tool-use RL: a policy that answers multiplications from memory learns to call
its calculator. The warm start (a module fixture, ~70 s on 2 cores) is two SFT stages of a
64-hidden, 2-layer, 4-head tiny model on bare calculator episodes ("What is 12 times 57?",
1-2-digit numbers): first on scripted tool episodes until 80 % of held-out episodes succeed
(the digit copying into the call and out of the result emerges abruptly, after ~400-550
steps), then 40 steps on demos of which 70 % answer without the tool, after which greedy
decoding answers directly and fails. GRPO at temperature 1 samples the tool in ~30 % of
episodes, those succeed, and the first-turn decision flips: measured (seed 0, 2026-12-01)
greedy success 0.00 -> 0.77 after 10 steps, 0.83 after 30, the tool used in 99-100 %."""

from __future__ import annotations

import json
import random

import pytest

from flywheel.config import RLConfig, SFTConfig, validate
from flywheel.envs import load_env
from flywheel.envs.demos import make_demos
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.env_eval import heldout_success
from flywheel.train.rl import run_rl
from flywheel.train.sft import run_sft

SETTINGS = {"chain_prob": 0.0, "bare_prompt": True, "max_turns": 3, "operator": "*",
            "template": "What is {a} times {b}?", "max_digits": 2}


def sft(model, rows_file, out, steps: int, lr: float, warmup: int, min_lr_ratio: float,
        evaluation: dict | None = None, evaluator=None):
    return run_sft(validate(dict(
        model=str(model), output_dir=str(out), data={"train": [str(rows_file)], "format": "chat"},
        train={"steps": steps, "batch_size": 16, "micro_batch_size": 16},
        optim={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": min_lr_ratio, "weight_decay": 0.01},
        eval=evaluation or {}, log={"progress": False}, threads=2), SFTConfig), evaluator=evaluator, log=lambda m: None)


@pytest.fixture(scope="module")
def answers_from_memory(tmp_path_factory):
    """(model folder, held-out success of the tool path after stage 1)."""
    root = tmp_path_factory.mktemp("calc-warm")
    env = load_env("calculator", **SETTINGS)
    tiny = build_tiny_model(root / "tiny", TinySpec(hidden=64, layers=2, heads=4, ffn=256, seed=0))
    tool_rows, _ = make_demos(env, 3000, out=root / "tool.jsonl")
    copying = sft(tiny, root / "tool.jsonl", root / "stage1", 1000, 3e-3, 30, 0.1,
                  evaluation={"every": 50, "stop_at": {"eval/success": 0.8}}, evaluator=heldout_success(env, tasks=20))
    rng = random.Random(0)
    with open(root / "mixed.jsonl", "w", encoding="utf-8") as f:
        for row in tool_rows[:1000]:
            if rng.random() < 0.7:  # the same question answered from memory: "The answer is 684."
                question, answer = row["messages"][0], row["messages"][2]["content"]
                row = {"messages": [question, {"role": "assistant", "content": f"The answer is {answer}."}],
                       "tools": []}
            f.write(json.dumps(row) + "\n")
    mixed = sft(copying.final_model, root / "mixed.jsonl", root / "stage2", 40, 1e-3, 5, 1.0)
    return mixed.final_model, copying.last["eval/success"]


def test_grpo_teaches_a_policy_that_answers_from_memory_to_call_its_calculator(answers_from_memory, tmp_path):
    model, copying = answers_from_memory
    assert copying >= 0.8, f"stage 1 did not learn to copy numbers through the tool: held-out success {copying}"
    cfg = validate(dict(
        model=str(model), output_dir=str(tmp_path / "rl"), env={"name": "calculator", "settings": SETTINGS},
        train={"steps": 12, "groups_per_step": 4, "group_size": 8, "seed": 0},
        sampling={"temperature": 1.0, "max_tokens": 128}, optim={"lr": 1e-4},
        eval={"tasks": 50, "every": 12}, log={"progress": False}, threads=2), RLConfig)
    result = run_rl(cfg, log=lambda m: None)
    before, after = result.evals[0], result.evals[-1]
    assert before["eval/reward/used_tool"] < 0.1 and before["eval/greedy_accuracy"] < 0.1, before
    assert after["eval/reward/used_tool"] >= 0.9, after
    assert after["eval/greedy_accuracy"] >= before["eval/greedy_accuracy"] + 0.4, (before, after)
