"""Score a sampler on an environment's tasks: the one evaluator.

`evaluate(sampler, env, tasks, max_tokens=...)` plays one greedy (temperature 0) episode per
task (rollout/play.py) and returns the share that fully succeeded (reward >= 1) and which
tasks did (`passed`, in task order), the mean of every metric the environment reports (0 for
an episode that lacks it), and the tokens sampled. With `pass_k` > 1 it then plays k episodes
per task with `sampling` and adds pass@k: the share of tasks where at least one succeeded.
No tasks: success 0.0 and no metrics.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

from flywheel.envs.base import Environment
from flywheel.inference.sampler import Sampler, SamplingParams
from flywheel.models import ChatRenderer
from flywheel.rollout.play import SamplerPolicy, play
from flywheel.types import Task, Trajectory


@dataclass(frozen=True)
class Evaluation:
    success: float  # share of greedy episodes with reward >= 1, in [0, 1]
    metrics: dict[str, float]  # env metric name -> mean over the greedy episodes
    episodes: int
    tokens_generated: int  # sampled tokens of the greedy episodes
    pass_at_k: float | None = None  # with pass_k > 1
    passed: tuple[bool, ...] = ()  # per task, in task order: its greedy episode succeeded (reward >= 1)


def evaluate(sampler: Sampler, env: Environment, tasks: Sequence[Task], *, max_tokens: int,
             renderer: ChatRenderer | None = None, pass_k: int = 1,
             sampling: SamplingParams | None = None) -> Evaluation:
    """`max_tokens`: new tokens per assistant turn of the greedy episodes; `renderer` is needed
    for chat tasks; `sampling` (required when pass_k > 1) samples the pass@k episodes."""
    if pass_k > 1 and sampling is None:
        raise ValueError("pass@k needs the sampling params of its k episodes")
    tasks = list(tasks)
    greedy = [g.trajectories[0] for g in
              asyncio.run(play(env, tasks, SamplerPolicy.greedy(sampler, max_tokens, renderer)))]
    pass_at_k = None
    if pass_k > 1:
        groups = asyncio.run(play(env, tasks, SamplerPolicy(sampler, sampling, renderer), group_size=pass_k))
        pass_at_k = sum(any(t.reward >= 1.0 for t in g.trajectories) for g in groups) / len(tasks) if tasks else 0.0
    return Evaluation(_success_rate(greedy), _episode_metric_means(greedy), len(greedy),
                      sum(sum(t.loss_mask) for t in greedy), pass_at_k, tuple(t.reward >= 1.0 for t in greedy))


def _success_rate(trajectories: list[Trajectory]) -> float:
    """The share of episodes that fully succeeded (reward >= 1); 0.0 for none."""
    return sum(t.reward >= 1.0 for t in trajectories) / len(trajectories) if trajectories else 0.0


def _episode_metric_means(trajectories: list[Trajectory]) -> dict[str, float]:
    """The mean of every metric the environment reported, over all episodes (0 where one lacks it)."""
    names = sorted({k for t in trajectories for k in t.metrics})
    return {k: sum(t.metrics.get(k, 0.0) for t in trajectories) / len(trajectories) for k in names}
