"""Play many episodes concurrently: asyncio tasks, a concurrency limit, per-episode timeouts.

This is the text-level runner behind `flywheel env try` and the env benchmark; the RL
rollout (token ids, logprobs) drives the same Env API.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from flywheel.envs.base import Environment, Policy
from flywheel.types import Message, Task


@dataclass
class EpisodeResult:
    task: Task
    transcript: list[Message] | str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    steps: int = 0
    duration_s: float = 0.0
    step_latencies_s: list[float] = field(default_factory=list)  # env.step time per step
    error: str | None = None  # "timeout" or the exception that ended it


_next_episode = itertools.count()


async def play_episode(env_spec: Environment, task: Task, policy: Policy, timeout_s: float = 300.0) -> EpisodeResult:
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


async def play_many(env_spec: Environment, tasks: list[Task], policy: Policy, concurrency: int = 64,
                    timeout_s: float = 300.0) -> list[EpisodeResult]:
    """One episode per task, at most `concurrency` at once; results in task order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(task: Task) -> EpisodeResult:
        async with gate:
            return await play_episode(env_spec, task, policy, timeout_s)

    return list(await asyncio.gather(*(one(t) for t in tasks)))
