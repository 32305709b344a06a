"""Warm starts built from nothing on a CPU: a tiny model taught a task's format by SFT, so that
RL (or a demo) has a policy that is imperfect but not hopeless. Each function is cached by
its output folder: a complete `final/` is returned as it is."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

CALCULATOR = {"chain_prob": 0.0}  # "a * b" with 3-4-digit numbers, as configs/calculator_grpo.yaml
COPY_TARGET = 0.8  # stage 1 stops once this share of held-out bare episodes succeed


def calculator_bare_success(model, tokenizer) -> dict:
    """SFT evaluator (`eval.evaluator: flywheel.train.warm_starts:calculator_bare_success`):
    greedy success on 50 held-out bare calculator episodes (no system prompt or tool block)."""
    from flywheel.envs import load_env
    from flywheel.train.env_eval import heldout_success

    return heldout_success(load_env("calculator", **CALCULATOR, bare_prompt=True), tasks=50)(model, tokenizer)


def calculator_warm_start(out: str | Path, demos: int = 4000, log: Callable[[str], None] = lambda m: None) -> Path:
    """configs/sft_calculator.yaml's recipe for the `calculator` env with chain_prob=0: a
    64-hidden, 2-layer, 4-head tiny model, SFT first on bare scripted demos (~180 tokens a row
    instead of ~1,000), where copying digits into the call and out of the result is learnt, until
    COPY_TARGET of held-out bare episodes succeed (checked every 50 steps, at most 1,500 steps),
    then 200 steps on full demos. The copying emerges abruptly: for 1-2-digit products after
    400-550 steps (tests/integration/test_rl_calculator.py), but for these 3-4-digit ones a
    build on 2026-12-01 was still at 0 % after 1,500 steps (another, with 2 heads, reached 58 %
    after 1,000): it logs a warning when stage 1 ends below the target."""
    from flywheel.config import SFTConfig, validate
    from flywheel.envs import load_env
    from flywheel.envs.demos import make_demos
    from flywheel.models import TinySpec, build_tiny_model
    from flywheel.train.sft import run_sft

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
