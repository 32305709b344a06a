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
import dataclasses
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


@dataclass(frozen=True)
class TaskField:
    """One field of a verifier's `task` (feedback `verifier: {"env", "task"}`)."""

    name: str
    required: bool
    text: str


_ANY_ANSWER = "the reference the verifier grades against (any JSON)"
TASK_FIELDS = (
    TaskField("answer", True, _ANY_ANSWER),
    TaskField("prompt", False, "a record only: the replay plays the trace's own prompt as it was served (a chat "
                               "trace's messages through the last user message, a raw completion's text); "
                               "if given, chat messages or a non-empty string, kept as `verifier_prompt`"),
    TaskField("id", False, "a non-empty string; absent: the trace's id"),
    TaskField("tools", False, "ignored on replay: the tools the trace offered are the ones replayed"),
    TaskField("metadata", False, "an object: what the environment reads besides (its grader, its scripted policy)"),
    TaskField("split", False, "a string; ignored on replay: curation assigns the train / held-out split"),
)


class Environment(abc.ABC):
    """A family of tasks and the episodes played on them."""

    name: str = "env"
    description: str = ""
    answer_doc: str = _ANY_ANSWER  # what `answer` is for this environment (verifier_task_fields)

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

    def verifier_task_fields(self) -> list[TaskField]:
        """What a client sends as the `task` of feedback `verifier: {"env": NAME, "task": {...}}`
        to have a failed trace replayed and graded here: `TASK_FIELDS`, `answer` told by
        `answer_doc`. An environment whose grader reads more (metadata) overrides this."""
        return [dataclasses.replace(f, text=self.answer_doc) if f.name == "answer" else f for f in TASK_FIELDS]

    def example_task(self) -> Task:
        """One real task to show: the first of a seeded test draw."""
        return self.tasks("test", n=1)[0]

    def verifier_task_example(self) -> dict[str, Any]:
        """One real task of this environment (`example_task`) as a verifier's
        task: its fields as JSON values, without `id` and `split` (curation sets both), `prompt`
        and `tools` (the trace's own are replayed) and fields left empty (no metadata)."""
        task = self.example_task()
        out = {k: v for k, v in dataclasses.asdict(task).items() if k not in ("id", "split", "prompt", "tools")}
        return {k: v for k, v in out.items() if v is not None and v != {}}


class Policy(abc.ABC):
    """Chooses the assistant's next text from the conversation so far (text level; the RL
    rollout works on token ids through the same Env API)."""

    @abc.abstractmethod
    async def act(self, task: Task, history: list[Message] | str, tools: list[dict] | None,
                  episode: int = 0) -> str:
        """`episode` identifies the episode (several may run on one task at once)."""

    async def end_episode(self, episode: int) -> None:
        """Called when an episode ends, so a stateful policy can drop what it kept."""
