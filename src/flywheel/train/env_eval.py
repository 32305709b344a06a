"""SFT evaluators that play an environment: `run_sft(cfg, evaluator=...)` calls one as
fn(model, tokenizer) -> {metric: value} at every evaluation, and `eval.stop_at` can stop the
run once a metric reaches a target (e.g. a warm start trained until it succeeds often enough
for RL to have a signal)."""

from __future__ import annotations

import copy
from typing import Callable

from flywheel.envs.base import Environment


def heldout_success(env: Environment, tasks: int = 100, max_tokens: int = 128, split: str = "test",
                    seed: int = 0) -> Callable[[object, object], dict]:
    """An evaluator: greedy success (reward >= 1) of the model on the first `tasks` tasks of
    `env`'s `split`, reported as "success", plus the mean of every episode metric as
    "episode/<name>". It plays on a snapshot of the model (the engine fuses weights in place)."""
    chosen = env.tasks(split, n=tasks, seed=seed)
    if not chosen:
        raise ValueError(f"environment {env.name!r} has no {split!r} tasks to evaluate on")

    def evaluate(model, tokenizer) -> dict:
        from flywheel.inference import LocalEngine
        from flywheel.models import ChatRenderer
        from flywheel.rollout.episodes import episode_metric_means, play_greedy, success_rate

        engine = LocalEngine(copy.deepcopy(model), tokenizer)
        renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
        played = play_greedy(env, chosen, engine, max_tokens, renderer)
        return {"success": success_rate(played),
                **{f"episode/{k}": v for k, v in episode_metric_means(played).items()}}

    return evaluate
