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
