"""The Env API.

An `Env` serves exactly one episode and is then discarded:
    obs = await env.initial_observation()        # prompt messages (or raw prompt text)
    while True:
        result = await env.step(assistant_text)  # StepResult(observation, reward, done, metrics)
        if result.done: break
        # result.observation (tool / user messages) is appended and the policy acts again
An `EnvGroupBuilder` makes the envs of one GRPO group (n attempts at one task) and may
compute group-level rewards. An `Environment` is the family: its tasks, how to build an env
for a task, and a scripted policy for smoke tests and benchmarks.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from flywheel.canonical import canonical
from flywheel.types import Message, Task


def check_split(split: str) -> None:
    """Every Environment has the splits "train" and "test"."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")


def sample_of(items: list, n: int | None, seed: int) -> list:
    """`n` of `items` drawn without replacement by a seeded RNG; all of them, in order, when
    n is None or not smaller than their count."""
    if n is not None and n < len(items):
        return random.Random(seed).sample(items, n)
    return items


@dataclass
class StepResult:
    observation: list[Message]  # messages to append before the policy acts again ([] when done)
    reward: float
    done: bool
    metrics: dict[str, float] = field(default_factory=dict)


class Env(abc.ABC):
    """One episode on one task."""

    task: Task
    tools: list[dict] | None = None  # JSON schemas rendered into the prompt by the chat template

    @abc.abstractmethod
    async def initial_observation(self) -> list[Message] | str:
        """The prompt: chat messages, or raw text for raw-completion tasks."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult:
        """Take the assistant's text for this turn."""


class EnvGroupBuilder:
    """Builds the `n` envs of one group on one task. Subclasses may override
    `group_rewards` to add rewards that depend on the whole group (e.g. ranking)."""

    def __init__(self, make_env: Callable[[Task], Env], task: Task, n: int):
        self.make_env, self.task, self.n = make_env, task, n

    async def make_envs(self) -> list[Env]:
        return [self.make_env(self.task) for _ in range(self.n)]

    async def group_rewards(self, rewards: Sequence[float], transcripts: Sequence[list[Message]]) -> list[float]:
        """Final rewards of the group; by default the per-episode rewards unchanged."""
        return list(rewards)


class Environment(abc.ABC):
    """A family of tasks and the episodes played on them."""

    name: str = "env"
    description: str = ""
    # what a task's `answer` is, and what its grader reads from `metadata` (None: nothing required),
    # in words, for the clients that send tasks to grade (envs/verifier_task.py)
    answer_doc: str = "the reference the verifier grades against (any JSON)"
    metadata_doc: str | None = None

    @abc.abstractmethod
    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        """Tasks of a split ("train" or "test"); `n` caps the count (seeded choice)."""

    @abc.abstractmethod
    def make_env(self, task: Task) -> Env: ...

    def problem_key(self, task: Task) -> str:
        """What makes two tasks one problem, for the held-out checks (envs/splits.py): by
        default the prompt as canonical JSON. An environment whose problems read differently
        (calculator: "12 * 57" is "57 * 12") overrides this."""
        return canonical(task.prompt)

    def group_builder(self, task: Task, n: int) -> EnvGroupBuilder:
        return EnvGroupBuilder(self.make_env, task, n)

    def scripted_policy(self) -> "Policy":
        """A policy without a model (for `flywheel env try` and benchmarks)."""
        raise NotImplementedError(f"environment {self.name!r} has no scripted policy")

    def info(self) -> dict[str, Any]:
        """What `flywheel env show` prints."""
        return {"name": self.name, "description": self.description}

    def example_task(self) -> Task:
        """One real task to show: the first of a seeded test draw."""
        return self.tasks("test", n=1)[0]


class Policy(abc.ABC):
    """Chooses the assistant's next text from the conversation so far (text level; the RL
    rollout works on token ids through the same Env API)."""

    @abc.abstractmethod
    async def act(self, task: Task, history: list[Message] | str, tools: list[dict] | None,
                  episode: int = 0) -> str:
        """`episode` identifies the episode (several may run on one task at once)."""

    async def end_episode(self, episode: int) -> None:
        """Called when an episode ends, so a stateful policy can drop what it kept."""
