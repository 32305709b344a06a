"""Play a policy on an environment's episodes: the one way episodes are run.

`await play(env, tasks, policy, group_size=G)` plays G episodes per task (a GRPO group; the
env's group builder may rescore a group) and returns them in task order. The policy is
  - a `SamplerPolicy` (a Sampler, its SamplingParams, a ChatRenderer for chat tasks): token in,
    token out. All live episodes advance together, one `generate` call per turn, so a group's
    identical first prompts share a prefill. Returns one TrajectoryGroup per task holding the
    sampled ids as sampled (no advantages yet).
  - a text-level `Policy` (scripted, or envs.model_policy.ModelPolicy): each episode is its own
    asyncio task, at most `concurrency` at once, ended after `timeout_s`; an env or policy error
    ends that episode only. Returns one EpisodeResult per episode, a group's consecutive.
Chat tasks are built as a `Conversation` (sampled ids appended as they are, observations
through the chat template); raw-completion tasks are the prompt's ids then the sampled ids.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Sequence, overload

from flywheel.envs.base import Env, Environment, Policy
from flywheel.inference.sampler import Sampler, SamplingParams
from flywheel.models import ChatRenderer, Conversation
from flywheel.process import cycle_collector_paused
from flywheel.types import Message, Task, Trajectory, TrajectoryGroup


@dataclass(frozen=True)
class SamplerPolicy:
    """A Sampler played token-level: `params` for every turn (n must be 1)."""

    sampler: Sampler
    params: SamplingParams
    renderer: ChatRenderer | None = None  # needed for chat tasks

    @classmethod
    def greedy(cls, sampler: Sampler, max_tokens: int, renderer: ChatRenderer | None = None) -> SamplerPolicy:
        """Temperature 0, at most `max_tokens` new tokens a turn: what evaluations score."""
        return cls(sampler, SamplingParams(temperature=0.0, max_tokens=max_tokens), renderer)


@dataclass
class EpisodeResult:
    """One episode of a text-level policy."""

    task: Task
    transcript: list[Message] | str  # the prompt, then every action and observation
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    duration_s: float = 0.0
    step_latencies_s: list[float] = field(default_factory=list)  # env.step time per step
    error: str | None = None  # "timeout" or the exception that ended it


@overload
async def play(env: Environment, tasks: Sequence[Task], policy: SamplerPolicy, *, group_size: int = 1,
               concurrency: int = 64, timeout_s: float = 300.0) -> list[TrajectoryGroup]: ...


@overload
async def play(env: Environment, tasks: Sequence[Task], policy: Policy, *, group_size: int = 1,
               concurrency: int = 64, timeout_s: float = 300.0) -> list[EpisodeResult]: ...


async def play(env, tasks, policy, *, group_size=1, concurrency=64, timeout_s=300.0):
    """`group_size` episodes per task, in task order. `concurrency` and `timeout_s` bound a
    text-level policy's episodes; a SamplerPolicy advances all of them together.

    The batch runs with the cycle collector paused (process.cycle_collector_paused), as
    EpisodeLoop runs one: its episodes allocate many small containers, each counting toward
    a collection, and a full collection walks every live container of the process, many once
    torch is imported (measured in docs/benchmarks.md, bench/envs.py)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    with cycle_collector_paused():
        if isinstance(policy, SamplerPolicy):
            return await _play_sampler(env, list(tasks), policy, group_size)
        return await _play_text(env, list(tasks), policy, group_size, concurrency, timeout_s)


async def _group_rewards(env: Environment, task: Task, rewards: list[float],
                         transcripts: list[list[Message]]) -> list[float]:
    return await env.group_builder(task, len(rewards)).group_rewards(rewards, transcripts)


# ---------------------------------------------------------------- a Sampler, token level


@dataclass
class _Episode:
    env: Env
    task: Task
    conv: Conversation | None = None  # chat tasks
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
        self.versions += [-1] * pad + (sample.token_versions or [sample.version] * len(sample.token_ids))
        if self.conv is not None:
            self.conv.append_sampled(sample.token_ids, {"role": "assistant", "content": sample.text})
        else:
            self.ids += sample.token_ids

    def trajectory(self) -> Trajectory:
        ids = list(self.conv.ids) if self.conv is not None else list(self.ids)
        pad = len(ids) - len(self.mask)
        return Trajectory(self.task.id, ids, self.mask + [0] * pad, self.logprobs + [0.0] * pad,
                          self.versions + [-1] * pad, self.reward, self.metrics)


async def _play_sampler(env_spec: Environment, tasks: list[Task], policy: SamplerPolicy,
                        group_size: int) -> list[TrajectoryGroup]:
    sampler, params, renderer = policy.sampler, policy.params, policy.renderer
    if params.n != 1:
        raise ValueError("play samples one continuation per episode per turn; set n=1")
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
        # on this thread, not an executor's: the thread that built the engine runs its forwards,
        # so the process's parallel torch work stays on one thread (inference/decoder.py THREADS)
        samples = sampler.generate([ep.prompt() for ep in live], params)
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
        rewards = await _group_rewards(env_spec, task, [ep.reward for ep in members], [[] for _ in members])
        trajs = [ep.trajectory() for ep in members]
        for t, r in zip(trajs, rewards):
            t.reward = r
        groups.append(TrajectoryGroup(task.id, trajs))
    return groups


# ---------------------------------------------------------------- a text-level Policy

_next_episode = itertools.count()  # episode ids a stateful Policy keys its state by


async def _play_episode(env_spec: Environment, task: Task, policy: Policy, timeout_s: float) -> EpisodeResult:
    env = env_spec.make_env(task)
    episode = next(_next_episode)
    result = EpisodeResult(task=task, transcript=[])
    t0 = time.perf_counter()

    async def run() -> None:
        obs = await env.initial_observation()
        history: list[Message] | str = list(obs) if isinstance(obs, list) else obs
        while True:
            action = await policy.act(task, history, env.tools, episode)
            s0 = time.perf_counter()
            step = await env.step(action)
            result.step_latencies_s.append(time.perf_counter() - s0)
            result.steps += 1
            if isinstance(history, str):
                history = history + action
            else:
                history = [*history, {"role": "assistant", "content": action}, *step.observation]
            result.transcript = history
            if step.done:
                result.reward, result.metrics = step.reward, step.metrics
                return

    try:
        await asyncio.wait_for(run(), timeout_s)
    except asyncio.TimeoutError:
        result.error = "timeout"
    except Exception as e:  # an env or policy bug ends this episode, not the run
        result.error = f"{type(e).__name__}: {e}"
    finally:
        await policy.end_episode(episode)
    result.duration_s = time.perf_counter() - t0
    return result


async def _play_text(env_spec: Environment, tasks: list[Task], policy: Policy, group_size: int,
                     concurrency: int, timeout_s: float) -> list[EpisodeResult]:
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> EpisodeResult:
        async with gate:
            return await _play_episode(env_spec, task, policy, timeout_s)

    results = list(await asyncio.gather(*(one(t) for t in tasks for _ in range(group_size))))
    for i, task in enumerate(tasks):
        members = results[i * group_size:(i + 1) * group_size]
        transcripts = [r.transcript if isinstance(r.transcript, list) else [] for r in members]
        rewards = await _group_rewards(env_spec, task, [r.reward for r in members], transcripts)
        for r, reward in zip(members, rewards):
            r.reward = reward
    return results


class EpisodeLoop:
    """One event loop kept for every batch a rollout source plays: `asyncio.run` per batch
    would make a new loop, a new executor thread for `to_thread` and, on the main thread, a
    SIGINT handler each time, a cost of the order of a short step (docs/benchmarks.md).

    A batch runs with the cycle collector paused (process.cycle_collector_paused): its
    episodes hold their tokens in plain lists (ids, masks, logprobs, versions: about five per
    episode, each as long as the episode) and their messages in dicts, all acyclic, and while
    they grow they would set off full collections that walk every element of every live list:
    ~40% of the batch's CPU at 10,000 episodes in flight (bench/scale_sim.py)."""

    def __init__(self):
        self._loop = asyncio.new_event_loop()

    def run(self, coro):
        with cycle_collector_paused():
            return self._loop.run_until_complete(coro)

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._loop.shutdown_default_executor())
            self._loop.close()
