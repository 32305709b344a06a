"""What a trace and its feedback look like on the way in, and why a record was refused.

A trace is one served request/response or one imported agent episode, in the OpenAI chat
format: `messages` (system / developer / user / assistant with `tool_calls` / tool), the
`tools` offered, the final assistant `response`, `usage`, latency and free metadata.
Feedback arrives later, many per trace: a score, a label, a corrected response, free text,
or a verifier (an environment name + the task payload it replays).

Every model forbids unknown keys. `describe(error)` turns pydantic's errors into one line
that names the field path the way a person writes it: `messages[1].role: unknown role
'robot' (valid: ...)`. Free-form JSON (metadata, tool parameters, tool-call arguments, the
verifier's task) is typed `dict[str, Any]`; the store serialises each record on its own
(see trace_encoding.py), so a Python object hidden in one record refuses that record only.
The store keeps a record as sent, not as re-dumped from the model: fields where lax
coercion would let a different JSON value pass (token counts, `strict`) are strict.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Union, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)

# Union branches are picked by the value's JSON type (a callable discriminator), so an
# error reports only the branch that applied. Branch tags start with "@" and are dropped
# from error paths by describe().
_TAG = "@"


def _json_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return _TAG + "str"
    if isinstance(value, list):
        return _TAG + "list"
    if isinstance(value, dict):
        return _TAG + "dict"
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(BaseModel):
    """One part of a multi-part message content (`{"type": "text", "text": ...}`, images, ...).

    The only open model: OpenAI keeps adding part types, each with its own keys.
    """

    model_config = ConfigDict(extra="allow")
    type: str = Field(min_length=1)
    text: str | None = None

    @model_validator(mode="after")
    def _text_part_has_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs 'text'")
        return self


Content = Annotated[
    Union[Annotated[str, Tag(_TAG + "str")], Annotated[list[ContentPart], Tag(_TAG + "list")]],
    Discriminator(_json_kind, custom_error_type="content_type",
                  custom_error_message="must be a string, a list of content parts or null"),
]

Arguments = Annotated[
    Union[Annotated[str, Tag(_TAG + "str")], Annotated[dict[str, Any], Tag(_TAG + "dict")]],
    Discriminator(_json_kind, custom_error_type="tool_arguments_type",
                  custom_error_message="must be a JSON string or an object"),
]


class FunctionCall(_Strict):
    name: str = Field(min_length=1)
    arguments: Arguments  # OpenAI sends a JSON string; Hermes parsers produce an object


class ToolCall(_Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Role
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # what reasoning models served through vLLM return

    @model_validator(mode="after")
    def _fits_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool_calls, not {self.role}")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"only tool messages carry tool_call_id, not {self.role}")
        if self.role == "assistant":
            if self.content is None and not self.tool_calls and self.refusal is None:
                raise ValueError("an assistant message needs content, tool_calls or refusal")
        elif self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        return self


class FunctionDef(_Strict):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(_Strict):
    """One entry of the OpenAI `tools` list."""

    type: Literal["function"] = "function"
    function: FunctionDef


class Usage(_Strict):
    # strict: stored as sent, so "12" must not pass as 12
    prompt_tokens: StrictInt = Field(ge=0)
    completion_tokens: StrictInt = Field(ge=0)
    total_tokens: StrictInt | None = Field(default=None, ge=0)
    prompt_tokens_details: dict[str, Any] | None = None
    completion_tokens_details: dict[str, Any] | None = None


def _assistant(message: ChatMessage | None, what: str) -> ChatMessage | None:
    if message is not None and message.role != "assistant":
        raise ValueError(f"{what} must be an assistant message, not {message.role}")
    return message


class TraceIn(_Strict):
    """One trace as a client sends it. Only `messages` is required.

    id: the client's id, or a UUID is generated. idempotency_key: a retry with the same key
    and the same content is a no-op that returns the stored id; the same key with other
    content is a conflict. Without a key the id serves as key. created_at: when the request
    happened (naive = UTC); the store's clock when absent. source: who produced the trace
    ("serve", "import:<file>", an agent stack's name); the store's default when absent.
    """

    id: str | None = Field(default=None, min_length=1, max_length=128)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)
    created_at: datetime | None = None
    source: str | None = Field(default=None, min_length=1, max_length=200)
    model: str | None = Field(default=None, max_length=200)
    model_version: str | None = Field(default=None, max_length=200)
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    response: ChatMessage | None = None
    usage: Usage | None = None
    latency_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    metadata: dict[str, Any] | None = None

    @field_validator("response")
    @classmethod
    def _response_is_assistant(cls, message: ChatMessage | None) -> ChatMessage | None:
        return _assistant(message, "the response")


class Verifier(_Strict):
    """An environment that can replay the trace's task and grade an answer."""

    env: str = Field(min_length=1, max_length=200)
    task: dict[str, Any]


class FeedbackIn(_Strict):
    """One outcome for a stored trace; at least one of score, label, correction, text, verifier."""

    score: float | None = Field(default=None, allow_inf_nan=False)
    label: str | None = Field(default=None, min_length=1, max_length=200)
    correction: ChatMessage | None = None
    text: str | None = None
    verifier: Verifier | None = None
    created_at: datetime | None = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)

    @field_validator("correction")
    @classmethod
    def _correction_is_assistant(cls, message: ChatMessage | None) -> ChatMessage | None:
        return _assistant(message, "a correction")

    @model_validator(mode="after")
    def _says_something(self) -> FeedbackIn:
        if all(v is None for v in (self.score, self.label, self.correction, self.text, self.verifier)):
            raise ValueError("feedback needs at least one of score, label, correction, text, verifier")
        return self


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith(_TAG):
            continue
        else:
            out += f".{part}" if out else str(part)
    return out


def _message(err: dict) -> str:
    kind = err["type"]
    if kind == "literal_error" and err["loc"][-1:] == ("role",):
        return f"unknown role {err['input']!r} (valid: {', '.join(ROLES)})"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind == "missing":
        return "required"
    if kind in ("model_type", "dict_type"):
        return "expected a JSON object"
    msg = err["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            return msg[len(prefix):]
    return msg[:1].lower() + msg[1:]


def describe(error: ValidationError) -> str:
    """One line for a refused record: `path: reason; path: reason`."""
    seen: list[str] = []
    for err in error.errors(include_url=False, include_context=False):
        where = _path(err["loc"])
        line = f"{where}: {_message(err)}" if where else _message(err)
        if line not in seen:
            seen.append(line)
    return "; ".join(seen)
