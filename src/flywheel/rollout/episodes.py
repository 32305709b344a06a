"""Play episodes with a Sampler, token in, token out, and return trajectory groups.

All live episodes of a batch advance together: each turn their prompts go to the sampler in
one `generate` call (so a GRPO group's identical first prompts share one prefill), then
their envs step concurrently. Chat tasks are built as a `Conversation` (the sampled ids are
appended as they are, observations are appended through the chat template); raw-completion
tasks are the prompt's ids followed by the sampled ids.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from flywheel.envs.base import Env, Environment
from flywheel.inference.sampler import SamplingParams
from flywheel.types import Task, Trajectory, TrajectoryGroup


@dataclass
class _Episode:
    env: Env
    task: Task
    conv: object | None = None  # Conversation for chat tasks
    ids: list[int] = field(default_factory=list)  # raw tasks
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    done: bool = False

    def prompt(self) -> list[int]:
        return self.conv.add_generation_prompt() if self.conv is not None else list(self.ids)

    def add_sample(self, sample) -> None:
        n_before = len(self.conv.ids) if self.conv is not None else len(self.ids)
        pad = n_before - len(self.mask)  # tokens added since the last sample (prompt, observations)
        self.mask += [0] * pad + [1] * len(sample.token_ids)
        self.logprobs += [0.0] * pad + list(sample.logprobs)
        self.versions += [-1] * pad + [sample.version] * len(sample.token_ids)
        if self.conv is not None:
            self.conv.append_sampled(sample.token_ids, {"role": "assistant", "content": sample.text})
        else:
            self.ids += sample.token_ids

    def trajectory(self) -> Trajectory:
        ids = list(self.conv.ids) if self.conv is not None else list(self.ids)
        pad = len(ids) - len(self.mask)
        return Trajectory(self.task.id, ids, self.mask + [0] * pad, self.logprobs + [0.0] * pad,
                          self.versions + [-1] * pad, self.reward, self.metrics)


async def play_groups(env_spec: Environment, tasks: list[Task], group_size: int, sampler,
                      params: SamplingParams, renderer=None) -> list[TrajectoryGroup]:
    """`group_size` episodes per task; returns one TrajectoryGroup per task (no advantages yet).
    `renderer` (a ChatRenderer) is needed for chat tasks."""
    if params.n != 1:
        raise ValueError("play_groups samples one continuation per episode per turn; set n=1")
    episodes: list[_Episode] = []
    for task in tasks:
        builder = env_spec.group_builder(task, group_size)
        for env in await builder.make_envs():
            ep = _Episode(env=env, task=task)
            obs = await env.initial_observation()
            if isinstance(obs, str):
                ep.ids = sampler.encode(obs)
            else:
                if renderer is None:
                    raise ValueError(f"task {task.id} is a chat task: pass a ChatRenderer")
                ep.conv = renderer.start(obs, env.tools)
            episodes.append(ep)
    while live := [ep for ep in episodes if not ep.done]:
        samples = await asyncio.to_thread(sampler.generate, [ep.prompt() for ep in live], params)
        for ep, (sample,) in zip(live, samples):
            ep.add_sample(sample)
        results = await asyncio.gather(*(ep.env.step(s[0].text) for ep, s in zip(live, samples)))
        for ep, result in zip(live, results):
            if result.done:
                ep.done, ep.reward, ep.metrics = True, result.reward, result.metrics
            elif ep.conv is not None:
                ep.conv.append_messages(result.observation)
            else:
                raise RuntimeError(f"raw-completion env for task {ep.task.id} did not finish in one turn")
    groups = []
    for i, task in enumerate(tasks):
        members = episodes[i * group_size:(i + 1) * group_size]
        builder = env_spec.group_builder(task, group_size)
        rewards = await builder.group_rewards([ep.reward for ep in members], [[] for _ in members])
        trajs = [ep.trajectory() for ep in members]
        for t, r in zip(trajs, rewards):
            t.reward = r
        groups.append(TrajectoryGroup(task.id, trajs))
    return groups


class EpisodeLoop:
    """One event loop kept for every batch a rollout source plays. `asyncio.run` per batch
    costs ~7 ms (a new loop, a new executor thread for `to_thread`, and on the main thread a
    SIGINT handler whose installation formats the running task's repr), ~10 % of a
    one-turn arithmetic step on the tiny model."""

    def __init__(self):
        self._loop = asyncio.new_event_loop()

    def run(self, coro):
        return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()


def play_greedy(env_spec: Environment, tasks: list[Task], sampler, max_tokens: int,
                renderer=None) -> list[Trajectory]:
    """One greedy (temperature 0) episode per task, in task order: what evaluations score."""
    groups = asyncio.run(play_groups(env_spec, tasks, 1, sampler,
                                     SamplingParams(temperature=0.0, max_tokens=max_tokens), renderer))
    return [g.trajectories[0] for g in groups]


def success_rate(trajectories: list[Trajectory]) -> float:
    """The share of episodes that fully succeeded (reward >= 1); 0.0 for none."""
    return sum(t.reward >= 1.0 for t in trajectories) / len(trajectories) if trajectories else 0.0


def episode_metric_means(trajectories: list[Trajectory]) -> dict[str, float]:
    """The mean of every metric the environment reported, over all episodes (0 where one lacks it)."""
    names = sorted({k for t in trajectories for k in t.metrics})
    return {k: sum(t.metrics.get(k, 0.0) for t in trajectories) / len(trajectories) for k in names}
