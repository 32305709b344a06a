"""Data types shared across flywheel: the chat message, the tool call, tasks and trajectories.

`Message` is the one definition of an OpenAI-style chat message (system / developer / user /
assistant with `tool_calls` / tool). It is a TypedDict, so a message is a plain dict
everywhere (templates, the trace store, the server); its annotations carry the rules that
pydantic checks where messages arrive from outside (the trace store's `TraceIn`, the
server's request bodies): unknown keys refused, content a string or a list of parts,
tool calls only on assistant messages. `ToolCall` is one call as the policy made it
(arguments decoded); `to_message_part()` gives its `ToolCallPart`, the `tool_calls` entry.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import AfterValidator, ConfigDict, Discriminator, Field, Tag, with_config
from typing_extensions import NotRequired, TypedDict  # pydantic needs typing_extensions' before Python 3.12

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)

# Union branches are picked by the value's JSON type (a callable discriminator), so an
# error reports only the branch that applied. Branch tags start with BRANCH_TAG; error
# reports drop them from field paths.
BRANCH_TAG = "@"
_FORBID = ConfigDict(extra="forbid")


def _json_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return BRANCH_TAG + "str"
    if isinstance(value, list):
        return BRANCH_TAG + "list"
    if isinstance(value, dict):
        return BRANCH_TAG + "dict"
    return None


def _not_null(*keys: str) -> dict[str, Any]:
    """JSON Schema: each of `keys` present and not null."""
    return {"required": list(keys), "properties": {k: {"not": {"type": "null"}} for k in keys}}


# The rules of _text_part_has_text and _fits_role below, for JSON Schema (the OpenAPI document):
# pydantic cannot derive a schema from a validator, and tests/service/test_openapi.py checks
# that what these schemas accept the server accepts.
_TEXT_PART_RULE = {"if": {"properties": {"type": {"const": "text"}}}, "then": _not_null("text")}
_ROLE_RULES = {"allOf": [
    {"if": {"properties": {"role": {"const": "assistant"}}},
     "then": {"anyOf": [_not_null("content"), _not_null("refusal"),
                        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]},
     "else": {**_not_null("content"), "properties": {"content": {"not": {"type": "null"}},
                                                     "tool_calls": {"type": "null"}}}},
    {"if": {"properties": {"role": {"const": "tool"}}}, "else": {"properties": {"tool_call_id": {"type": "null"}}}},
]}


@with_config(ConfigDict(extra="allow", json_schema_extra=_TEXT_PART_RULE))
class ContentPartFields(TypedDict):
    """One part of a multi-part message content (`{"type": "text", "text": ...}`, images, ...).

    The only open shape: OpenAI keeps adding part types, each with its own keys.
    """

    type: Annotated[str, Field(min_length=1)]
    text: NotRequired[str | None]


def _text_part_has_text(part: ContentPartFields) -> ContentPartFields:
    if part["type"] == "text" and part.get("text") is None:
        raise ValueError("a text part needs 'text'")
    return part


ContentPart = Annotated[ContentPartFields, AfterValidator(_text_part_has_text)]

Content = Annotated[
    Union[Annotated[str, Tag(BRANCH_TAG + "str")], Annotated[list[ContentPart], Tag(BRANCH_TAG + "list")]],
    Discriminator(_json_kind, custom_error_type="content_type",
                  custom_error_message="must be a string, a list of content parts or null"),
]

Arguments = Annotated[
    Union[Annotated[str, Tag(BRANCH_TAG + "str")], Annotated[dict[str, Any], Tag(BRANCH_TAG + "dict")]],
    Discriminator(_json_kind, custom_error_type="tool_arguments_type",
                  custom_error_message="must be a JSON string or an object"),
]


@with_config(_FORBID)
class FunctionCall(TypedDict):
    name: Annotated[str, Field(min_length=1)]
    arguments: Arguments  # OpenAI sends a JSON string; Hermes parsers produce an object


@with_config(_FORBID)
class ToolCallPart(TypedDict):
    """One entry of an assistant message's `tool_calls`."""

    id: NotRequired[str | None]
    type: NotRequired[Literal["function"]]
    function: FunctionCall


@with_config(ConfigDict(extra="forbid", json_schema_extra=_ROLE_RULES))
class MessageFields(TypedDict):
    role: Role
    content: NotRequired[Content | None]
    name: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCallPart] | None]
    tool_call_id: NotRequired[str | None]
    refusal: NotRequired[str | None]
    reasoning_content: NotRequired[str | None]  # what reasoning models served through vLLM return


def _fits_role(message: MessageFields) -> MessageFields:
    role = message["role"]
    if message.get("tool_calls") is not None and role != "assistant":
        raise ValueError(f"only assistant messages carry tool_calls, not {role}")
    if message.get("tool_call_id") is not None and role != "tool":
        raise ValueError(f"only tool messages carry tool_call_id, not {role}")
    if role == "assistant":
        if message.get("content") is None and not message.get("tool_calls") and message.get("refusal") is None:
            raise ValueError("an assistant message needs content, tool_calls or refusal")
    elif message.get("content") is None:
        raise ValueError(f"a {role} message needs content")
    return message


Message = Annotated[MessageFields, AfterValidator(_fits_role)]


@dataclass
class ToolCall:
    """One tool call as parsed from the policy's text: the tool's name and decoded arguments."""

    name: str
    arguments: dict[str, Any]
    id: str | None = None

    def to_message_part(self) -> ToolCallPart:
        """The OpenAI `tool_calls` entry for this call."""
        part: ToolCallPart = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if self.id:
            part["id"] = self.id
        return part


PromptFormat = Literal["chat", "completion"]  # how a model is called: /v1/chat/completions or /v1/completions


def prompt_format(prompt: list[Message] | str) -> PromptFormat:
    """A prompt's format: chat (a message list, through the chat template) or completion (raw text)."""
    return "completion" if isinstance(prompt, str) else "chat"


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
