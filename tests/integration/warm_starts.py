"""Warm starts built from nothing on a CPU, fixtures of the calculator RL test and of
bench/async.py (which puts this folder on its path): a tiny model taught a task's format by
SFT, so that RL has a policy that is imperfect but not hopeless. Each function is cached by its
output folder: a complete `final/` is returned as it is."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from flywheel.config import SFTConfig, validate
from flywheel.envs import load_env
from flywheel.models import TinySpec, build_tiny_model
from flywheel.rollout.demos import make_demos
from flywheel.train.env_eval import calculator_bare_success, heldout_success
from flywheel.train.metrics import read_metrics
from flywheel.train.sft import run_sft

CALCULATOR = {"chain_prob": 0.0}  # "a * b" with 3-4-digit numbers, as configs/calculator_grpo.yaml
COPY_TARGET = 0.8  # stage 1 stops once this share of held-out bare episodes succeed


def calculator_warm_start(out: str | Path, demos: int = 4000, log: Callable[[str], None] = lambda m: None) -> Path:
    """configs/sft_calculator.yaml's recipe for the `calculator` env with chain_prob=0: a
    64-hidden, 2-layer, 4-head tiny model, SFT first on bare scripted demos (~180 tokens a row
    instead of ~1,000), where copying digits into the call and out of the result is learnt, until
    COPY_TARGET of held-out bare episodes succeed (checked every 50 steps, at most 1,500 steps),
    then 200 steps on full demos. The copying emerges abruptly and, for these 3-4-digit
    products, not in every build within the budget: it logs a warning when stage 1 ends below
    the target (docs/benchmarks.md, "Measurements behind choices in the code")."""
    root = Path(out)
    final = root / "sft" / "final"
    if (final / "config.json").exists():
        return final
    env = load_env("calculator", **CALCULATOR)
    model = root / "tiny"
    if not (model / "config.json").exists():
        build_tiny_model(model, TinySpec(hidden=64, layers=2, heads=4, ffn=256))
    bare, full = root / "demos_bare.jsonl", root / "demos.jsonl"
    make_demos(env, demos, out=bare, bare=True)
    make_demos(env, demos, out=full)
    until_copying = {"every": 50, "stop_at": {"eval/success": COPY_TARGET}}
    stages = [(model, bare, root / "sft-bare", 1500, 16, 3e-3, 30, until_copying, calculator_bare_success),
              (root / "sft-bare" / "final", full, root / "sft", 200, 8, 1e-3, 10, {}, None)]
    for start, data, stage_out, steps, batch, lr, warmup, evaluation, evaluator in stages:
        log(f"calculator warm start: SFT {stage_out.name} (up to {steps} steps)")
        result = run_sft(validate(dict(model=str(start), output_dir=str(stage_out), resume=True,
                                       data={"train": [str(data)], "format": "chat"},
                                       train={"steps": steps, "batch_size": batch, "micro_batch_size": batch},
                                       optim={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": 0.1,
                                              "weight_decay": 0.01},
                                       eval=evaluation, log={"progress": False}, threads=1), SFTConfig),
                         evaluator=evaluator, log=log)
        if evaluator is not None and result.last.get("eval/success", 0.0) < COPY_TARGET:
            log(f"warning: {stage_out.name} ended at held-out bare success {result.last.get('eval/success')}, "
                f"below {COPY_TARGET}: the copying did not emerge in {steps} steps")
    return final


# "What is 12 times 57?" with 1-2-digit numbers, no system prompt or tool block
CALCULATOR_FROM_MEMORY = {"chain_prob": 0.0, "bare_prompt": True, "max_turns": 3, "operator": "*",
                          "template": "What is {a} times {b}?", "max_digits": 2}


def calculator_from_memory_warm_start(out: str | Path, direct_share: float = 0.7, seed: int = 0,
                                      log: Callable[[str], None] = lambda m: None) -> tuple[Path, float]:
    """A policy that can use its calculator but answers multiplications from memory: RL's job
    is to make it call the tool (env `calculator` with CALCULATOR_FROM_MEMORY). Returns (model,
    held-out success of the tool path after stage 1).

    A 64-hidden, 2-layer, 4-head tiny model; stage 1: SFT on 3,000 scripted tool episodes until
    80 % of 20 held-out episodes succeed (checked every 50 steps, at most 1,500: the copying
    into the call and out of the result emerges abruptly, at a step that varies by machine);
    then 200 more steps at lr 1e-3, because copying that just emerged holds under greedy
    decoding but not under sampling at temperature 1, and RL needs sampled successes to
    reward; stage 2: 80 steps on 1,000 demos of which `direct_share` answer at once ("The
    answer is 684."), after which greedy decoding answers directly and fails while sampling
    still calls the tool in some episodes. The measurements behind these choices are in
    docs/benchmarks.md ("Measurements behind choices in the code")."""
    root = Path(out)
    final = root / "stage2" / "final"

    def copying() -> float:
        evals = [r["eval/success"] for r in read_metrics(root / "stage1" / "metrics.jsonl") if "eval/success" in r]
        return evals[-1] if evals else 0.0

    if (final / "config.json").exists():
        return final, copying()
    env = load_env("calculator", **CALCULATOR_FROM_MEMORY)
    tiny = root / "tiny"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny, TinySpec(hidden=64, layers=2, heads=4, ffn=256, seed=seed))
    rows, _ = make_demos(env, 3000, out=root / "tool.jsonl")
    rng = random.Random(seed)
    with open(root / "mixed.jsonl", "w", encoding="utf-8") as f:
        for row in rows[:1000]:
            if rng.random() < direct_share:  # the same question answered from memory
                question, result = row["messages"][0], row["messages"][2]["content"]
                row = {"messages": [question, {"role": "assistant", "content": f"The answer is {result}."}],
                       "tools": []}
            f.write(json.dumps(row) + "\n")

    def sft(start: Path, data: str, stage: str, steps: int, lr: float, warmup: int, min_lr_ratio: float,
            evaluation: dict, evaluator=None) -> None:
        log(f"calculator-from-memory warm start: SFT {stage} (up to {steps} steps)")
        return run_sft(validate(dict(
            model=str(start), output_dir=str(root / stage), resume=True,
            data={"train": [str(root / data)], "format": "chat"},
            train={"steps": steps, "batch_size": 16, "micro_batch_size": 16, "seed": seed},
            optim={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": min_lr_ratio, "weight_decay": 0.01},
            eval=evaluation, log={"progress": False}), SFTConfig), evaluator=evaluator, log=log)

    stage1 = root / "stage1" / "final"
    if not (stage1 / "config.json").exists():  # else resuming would train on past its stop
        sft(tiny, "tool.jsonl", "stage1", 1500, 3e-3, 30, 0.1,
            {"every": 50, "stop_at": {"eval/success": 0.8}}, heldout_success(env, tasks=20))
    consolidated = root / "stage1b" / "final"
    if not (consolidated / "config.json").exists():
        sft(stage1, "tool.jsonl", "stage1b", 200, 1e-3, 5, 0.1, {})
    sft(consolidated, "mixed.jsonl", "stage2", 80, 1e-3, 5, 1.0, {})
    return final, copying()
