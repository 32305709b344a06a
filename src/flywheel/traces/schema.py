"""What a trace and its feedback look like on the way in, and why a record was refused.

A trace is one served request/response or one imported agent episode: a chat trace in the
OpenAI chat format, `messages` (system / developer / user / assistant with `tool_calls` /
tool) and the `tools` offered; a raw-completion trace (`/v1/completions`) its `prompt`, the
text as served with no chat template. Either has the final assistant `response` (for a
completion, its text as the content), `usage`, latency and free metadata.
Feedback arrives later, many per trace: a score, a label, a corrected response, free text,
or a verifier (an environment name + the task payload it replays), each with its `source`:
"user" (what clients send) or "judge" (flywheel's judge model, for traces no verifier grades).

A trace's shapes are TypedDicts, validated by `TRACE_IN` (pydantic): plain dicts in, plain
dicts out. Model instances would cost more to build than the checks themselves, and
ingestion validates every record of every batch. Feedback (one at a time) is a model, `FeedbackIn`.
A message is `flywheel.types.Message`, the one message type of flywheel, validated here as is.

Every shape forbids unknown keys. `describe(error)` turns pydantic's errors into one line
that names the field path the way a person writes it: `messages[1].role: unknown role
'robot' (valid: ...)`. Free-form JSON (metadata, tool parameters, tool-call arguments, the
verifier's task) is typed `dict[str, Any]`; the store serialises each record on its own
(see encoding.py), so a Python object hidden in one record refuses that record only.
The store keeps a record as sent, not as re-dumped from the model: fields where lax
coercion would let a different JSON value pass (token counts, `strict`) are strict.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    TypeAdapter,
    ValidationError,
    model_validator,
    with_config,
)
from typing_extensions import NotRequired, TypedDict  # pydantic needs typing_extensions' before Python 3.12

from flywheel.types import BRANCH_TAG, ROLES, Message, MessageFields

_FORBID = ConfigDict(extra="forbid")


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


ASSISTANT_ONLY = Field(json_schema_extra={"properties": {"role": {"const": "assistant"}}})  # _assistant's rule


def _assistant(what: str):
    def check(message: MessageFields | None) -> MessageFields | None:
        if message is not None and message["role"] != "assistant":
            raise ValueError(f"{what} must be an assistant message, not {message['role']}")
        return message
    return AfterValidator(check)


# _one_prompt's rule, for the JSON Schema: exactly one of messages (chat) and prompt (raw completion)
_ONE_PROMPT = {"oneOf": [{"required": ["messages"]}, {"required": ["prompt"]}]}


@with_config(ConfigDict(extra="forbid", json_schema_extra=_ONE_PROMPT))
class TraceIn(TypedDict):
    """One trace as a client sends it: `messages` (a chat trace) or `prompt` (a raw-completion
    trace), exactly one; everything else is optional.

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
    messages: NotRequired[Annotated[list[Message], Field(min_length=1)]]
    prompt: NotRequired[Annotated[str, Field(min_length=1)]]  # a raw completion: the text as served
    tools: NotRequired[list[ToolDef] | None]
    response: NotRequired[Annotated[Message | None, _assistant("the response"), ASSISTANT_ONLY]]
    usage: NotRequired[Usage | None]
    latency_ms: NotRequired[Annotated[float, Field(ge=0, allow_inf_nan=False)] | None]
    metadata: NotRequired[dict[str, Any] | None]


def _one_prompt(trace: TraceIn) -> TraceIn:
    if ("messages" in trace) == ("prompt" in trace):
        raise ValueError("a trace needs exactly one of 'messages' (a chat trace) and 'prompt' "
                         "(a raw completion)" + (", not both" if "prompt" in trace else ""))
    return trace


# TRACE_IN.validate_python(record) -> the record as a validated dict
TRACE_IN = TypeAdapter(Annotated[TraceIn, AfterValidator(_one_prompt)])


class _Strict(BaseModel):
    model_config = _FORBID


class Verifier(_Strict):
    """An environment that can replay the trace's task and grade an answer."""

    env: str = Field(min_length=1, max_length=200)
    task: dict[str, Any]


FeedbackSource = Literal["user", "judge"]
FEEDBACK_SOURCES = ("user", "judge")
_SAYS = ("score", "label", "correction", "text", "verifier")  # feedback needs one of them, not null


class FeedbackIn(_Strict):
    """One outcome for a stored trace; at least one of score, label, correction, text, verifier."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": [k], "properties": {k: {"not": {"type": "null"}}}} for k in _SAYS]})

    score: float | None = Field(default=None, allow_inf_nan=False)
    label: str | None = Field(default=None, min_length=1, max_length=200)
    correction: Annotated[Message | None, _assistant("a correction"), ASSISTANT_ONLY] = None
    text: str | None = None
    verifier: Verifier | None = None
    created_at: datetime | None = None
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)
    # Who gave the outcome: "user" (a client, a person, an operator's import) or "judge"
    # (flywheel's judge model, loop/judging.py). Over HTTP only "user" is taken (serve/ingest.py
    # refuses "judge": a client cannot pass its scores off as the judge's), which the schema
    # states for the OpenAPI document; the store takes both from Python callers.
    source: FeedbackSource = Field("user", description=(
        "who gave this outcome; clients send \"user\" (the default). \"judge\" is written only by flywheel's "
        "judge (`flywheel traces judge`) and refused here"), json_schema_extra={"enum": ["user"]})

    @model_validator(mode="after")
    def _says_something(self) -> FeedbackIn:
        if all(getattr(self, k) is None for k in _SAYS):
            raise ValueError(f"feedback needs at least one of {', '.join(_SAYS)}")
        return self


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.startswith(BRANCH_TAG):
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
