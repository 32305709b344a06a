"""SFT evaluators that play an environment: `run_sft(cfg, evaluator=...)` calls one as
fn(model, tokenizer) -> {metric: value} at every evaluation (or `eval.evaluator:
flywheel.train.env_eval:<name>` names one of the ready-made ones below), and `eval.stop_at` can
stop the run once a metric reaches a target (e.g. a warm start trained until it succeeds often
enough for RL to have a signal). Each plays greedy episodes (rollout/evaluate.py) on a
snapshot of the model: the engine fuses weights in place."""

from __future__ import annotations

import copy
from typing import Callable

from flywheel.envs import load_env
from flywheel.envs.arithmetic import N_HELDOUT
from flywheel.envs.base import Environment
from flywheel.inference import LocalEngine
from flywheel.models import ChatRenderer
from flywheel.rollout.evaluate import evaluate


def heldout_success(env: Environment, tasks: int = 100, max_tokens: int = 128, split: str = "test",
                    seed: int = 0) -> Callable[[object, object], dict]:
    """An evaluator: greedy success (reward >= 1) of the model on the first `tasks` tasks of
    `env`'s `split` as "success", plus the mean of every episode metric as "episode/<name>"."""
    chosen = env.tasks(split, n=tasks, seed=seed)
    if not chosen:
        raise ValueError(f"environment {env.name!r} has no {split!r} tasks to evaluate on")

    def evaluator(model, tokenizer) -> dict:
        engine = LocalEngine(copy.deepcopy(model), tokenizer)
        renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
        result = evaluate(engine, env, chosen, max_tokens=max_tokens, renderer=renderer)
        return {"success": result.success, **{f"episode/{k}": v for k, v in result.metrics.items()}}

    return evaluator


def arithmetic_heldout_accuracy(model, tokenizer) -> dict:
    """`eval.evaluator: flywheel.train.env_eval:arithmetic_heldout_accuracy`: greedy accuracy
    on the 200 held-out pairs of the shared `ab+cd=` task (6 new tokens), as "heldout_accuracy"."""
    played = heldout_success(load_env("arithmetic"), tasks=N_HELDOUT, max_tokens=6)(model, tokenizer)
    return {"heldout_accuracy": played["success"]}


def calculator_bare_success(model, tokenizer) -> dict:
    """`eval.evaluator: flywheel.train.env_eval:calculator_bare_success`: greedy success on 50
    held-out bare calculator episodes ("a * b", no system prompt or tool block), as
    configs/sft_calculator.yaml's first stage checks it."""
    return heldout_success(load_env("calculator", chain_prob=0.0, bare_prompt=True), tasks=50)(model, tokenizer)
