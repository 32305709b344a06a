"""What a trace and its feedback look like on the way in, and why a record was refused.

A trace is one served request/response or one imported agent episode, in the OpenAI chat
format: `messages` (system / developer / user / assistant with `tool_calls` / tool), the
`tools` offered, the final assistant `response`, `usage`, latency and free metadata.
Feedback arrives later, many per trace: a score, a label, a corrected response, free text,
or a verifier (an environment name + the task payload it replays).

A trace's shapes are TypedDicts, validated by `TRACE_IN` (pydantic): plain dicts in, plain
dicts out. Model instances would cost more to build than the checks themselves, and
ingestion validates every record of every batch. Feedback (one at a time) is a model, `FeedbackIn`.

Every shape forbids unknown keys. `describe(error)` turns pydantic's errors into one line
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
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    Tag,
    TypeAdapter,
    ValidationError,
    model_validator,
    with_config,
)
from typing_extensions import NotRequired, TypedDict  # pydantic needs typing_extensions' before Python 3.12

Role = Literal["system", "developer", "user", "assistant", "tool"]
ROLES: tuple[str, ...] = get_args(Role)

# Union branches are picked by the value's JSON type (a callable discriminator), so an
# error reports only the branch that applied. Branch tags start with "@" and are dropped
# from error paths by describe().
_TAG = "@"
_FORBID = ConfigDict(extra="forbid")


def _json_kind(value: Any) -> str | None:
    if isinstance(value, str):
        return _TAG + "str"
    if isinstance(value, list):
        return _TAG + "list"
    if isinstance(value, dict):
        return _TAG + "dict"
    return None


@with_config(ConfigDict(extra="allow"))
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
    Union[Annotated[str, Tag(_TAG + "str")], Annotated[list[ContentPart], Tag(_TAG + "list")]],
    Discriminator(_json_kind, custom_error_type="content_type",
                  custom_error_message="must be a string, a list of content parts or null"),
]

Arguments = Annotated[
    Union[Annotated[str, Tag(_TAG + "str")], Annotated[dict[str, Any], Tag(_TAG + "dict")]],
    Discriminator(_json_kind, custom_error_type="tool_arguments_type",
                  custom_error_message="must be a JSON string or an object"),
]


@with_config(_FORBID)
class FunctionCall(TypedDict):
    name: Annotated[str, Field(min_length=1)]
    arguments: Arguments  # OpenAI sends a JSON string; Hermes parsers produce an object


@with_config(_FORBID)
class ToolCall(TypedDict):
    id: NotRequired[str | None]
    type: NotRequired[Literal["function"]]
    function: FunctionCall


@with_config(_FORBID)
class ChatMessageFields(TypedDict):
    role: Role
    content: NotRequired[Content | None]
    name: NotRequired[str | None]
    tool_calls: NotRequired[list[ToolCall] | None]
    tool_call_id: NotRequired[str | None]
    refusal: NotRequired[str | None]
    reasoning_content: NotRequired[str | None]  # what reasoning models served through vLLM return


def _fits_role(message: ChatMessageFields) -> ChatMessageFields:
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


ChatMessage = Annotated[ChatMessageFields, AfterValidator(_fits_role)]


@with_config(_FORBID)
class FunctionDef(TypedDict):
    name: Annotated[str, Field(min_length=1)]
    description: NotRequired[str | None]
    parameters: NotRequired[dict[str, Any] | None]
    strict: NotRequired[StrictBool | None]


@with_config(_FORBID)
class ToolDef(TypedDict):
    """One entry of the OpenAI `tools` list."""

    type: NotRequired[Literal["function"]]
    function: FunctionDef


@with_config(_FORBID)
class Usage(TypedDict):
    # strict: stored as sent, so "12" must not pass as 12
    prompt_tokens: Annotated[StrictInt, Field(ge=0)]
    completion_tokens: Annotated[StrictInt, Field(ge=0)]
    total_tokens: NotRequired[Annotated[StrictInt, Field(ge=0)] | None]
    prompt_tokens_details: NotRequired[dict[str, Any] | None]
    completion_tokens_details: NotRequired[dict[str, Any] | None]


def _assistant(what: str):
    def check(message: ChatMessageFields | None) -> ChatMessageFields | None:
        if message is not None and message["role"] != "assistant":
            raise ValueError(f"{what} must be an assistant message, not {message['role']}")
        return message
    return AfterValidator(check)


@with_config(_FORBID)
class TraceIn(TypedDict):
    """One trace as a client sends it. Only `messages` is required.

    id: the client's id, or a UUID is generated. idempotency_key: a retry with the same key
    and the same content is a no-op that returns the stored id; the same key with other
    content is a conflict. Without a key the id serves as key. created_at: when the request
    happened (naive = UTC); the store's clock when absent. source: who produced the trace
    ("serve", "import:<file>", an agent stack's name); the store's default when absent.
    """

    id: NotRequired[Annotated[str, Field(min_length=1, max_length=128)] | None]
    idempotency_key: NotRequired[Annotated[str, Field(min_length=1, max_length=255)] | None]
    created_at: NotRequired[datetime | None]
    source: NotRequired[Annotated[str, Field(min_length=1, max_length=200)] | None]
    model: NotRequired[Annotated[str, Field(max_length=200)] | None]
    model_version: NotRequired[Annotated[str, Field(max_length=200)] | None]
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: NotRequired[list[ToolDef] | None]
    response: NotRequired[Annotated[ChatMessage | None, _assistant("the response")]]
    usage: NotRequired[Usage | None]
    latency_ms: NotRequired[Annotated[float, Field(ge=0, allow_inf_nan=False)] | None]
    metadata: NotRequired[dict[str, Any] | None]


TRACE_IN = TypeAdapter(TraceIn)  # TRACE_IN.validate_python(record) -> the record as a validated dict


class _Strict(BaseModel):
    model_config = _FORBID


class Verifier(_Strict):
    """An environment that can replay the trace's task and grade an answer."""

    env: str = Field(min_length=1, max_length=200)
    task: dict[str, Any]


class FeedbackIn(_Strict):
    """One outcome for a stored trace; at least one of score, label, correction, text, verifier."""

    score: float | None = Field(default=None, allow_inf_nan=False)
    label: str | None = Field(default=None, min_length=1, max_length=200)
    correction: Annotated[ChatMessage | None, _assistant("a correction")] = None
    text: str | None = None
    verifier: Verifier | None = None
    created_at: datetime | None = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)

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
