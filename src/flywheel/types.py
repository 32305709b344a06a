"""Plain data types shared across flywheel. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Message = dict[str, Any]  # an OpenAI-style chat message: {"role": ..., "content": ..., "tool_calls": [...]}


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None

    def to_message_part(self) -> dict:
        """The OpenAI `tool_calls` entry for this call."""
        part = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id:
            part["id"] = self.id
        return part


@dataclass
class Task:
    """One problem of an environment.

    prompt: chat messages, or a plain string for raw-completion tasks (no chat template,
    e.g. the shared `ab+cd=` task). tools: JSON schemas offered to the model (OpenAI
    `tools` format). answer: the reference the verifier checks against.
    """

    id: str
    prompt: list[Message] | str
    answer: Any = None
    tools: list[dict] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    split: str = "train"


@dataclass
class Trajectory:
    """One episode as the policy saw and produced it, token by token.

    ids: every token of the episode (prompt, sampled turns, tool / env turns), never
    re-tokenized. loss_mask[i] = 1 where token i was sampled by the policy (trained on).
    behavior_logprobs[i]: the sampler's logprob of token i (0.0 where not sampled).
    versions[i]: the policy version that sampled token i (-1 where not sampled).
    """

    task_id: str
    ids: list[int]
    loss_mask: list[int]
    behavior_logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def oldest_version(self) -> int:
        sampled = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(sampled) if sampled else -1


@dataclass
class TrajectoryGroup:
    """The G attempts at one task that share a baseline (a GRPO group)."""

    task_id: str
    trajectories: list[Trajectory]
    advantages: list[float] = field(default_factory=list)
    task_index: int = -1  # the task's position in its split, when the rollout feeder knows it

    @property
    def oldest_version(self) -> int:
        return min(t.oldest_version for t in self.trajectories)
