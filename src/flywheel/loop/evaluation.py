"""Score a model folder on named suites: greedy accuracy (reward >= 1) over fixed task lists.

A suite is an environment plus the exact tasks to play, so the incumbent and the candidate of
a cycle are measured on the same tasks. Frozen regression suites come from an environment's
test split (`suite_tasks`); the new-failure suite from a cycle's held-out replay records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import Field

from flywheel.config import Config
from flywheel.envs import load_env
from flywheel.types import Task


class SuiteConfig(Config):
    """A frozen regression suite: the first `tasks` tasks of an environment's split."""

    env: str = Field(..., min_length=1, description="environment name, as in an RL config")
    settings: dict[str, Any] = Field(default_factory=dict)
    tasks: int = Field(100, ge=1)
    split: str = "test"
    seed: int = 0
    max_tokens: int = Field(16, ge=1, description="new tokens per assistant turn")


@dataclass(frozen=True)
class Suite:
    name: str
    env: Any  # an Environment
    tasks: list[Task]
    max_tokens: int


@dataclass(frozen=True)
class SuiteScores:
    scores: dict[str, float]  # suite -> greedy accuracy in [0, 1]
    tasks: dict[str, int]
    tokens_generated: int
    seconds: float


def suite_from_config(name: str, cfg: SuiteConfig) -> Suite:
    env = load_env(cfg.env, **cfg.settings)
    return Suite(name, env, env.tasks(cfg.split, n=cfg.tasks, seed=cfg.seed), cfg.max_tokens)


def evaluate_model(model_dir: str | Path, suites: list[Suite], *, seed: int = 0) -> SuiteScores:
    """Greedy accuracy of the model at `model_dir` on each suite (an empty suite is skipped)."""
    # here, not at the top: loop_config imports SuiteConfig and must not load torch
    from flywheel.inference import LocalEngine
    from flywheel.models import ChatRenderer
    from flywheel.rollout.evaluate import evaluate

    t0 = time.perf_counter()
    engine = LocalEngine.from_path(str(model_dir), seed=seed)
    renderer = ChatRenderer(engine.tokenizer) if engine.tokenizer.chat_template else None
    scores, counts, generated = {}, {}, 0
    for suite in suites:
        if not suite.tasks:
            continue
        result = evaluate(engine, suite.env, suite.tasks, max_tokens=suite.max_tokens, renderer=renderer)
        scores[suite.name], counts[suite.name] = result.success, result.episodes
        generated += result.tokens_generated
    return SuiteScores(scores, counts, generated, time.perf_counter() - t0)
