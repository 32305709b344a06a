"""What the service answers, as models, for its OpenAPI document (serve/openapi.py).

The answers themselves are plain dicts built where they are made (core.py, responses.py,
ingest.py, app.py): building them through models would cost time on every token streamed.
These models only describe them; tests/service/test_openapi.py checks the answers of a
running server against them, so an answer that changes shape without its model fails there.
A message and a usage are the request side's own types (flywheel.types.Message, the trace
store's Usage): what the server answers is a trace the store accepts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from flywheel.traces.results import RecordResult
from flywheel.traces.schema import Usage
from flywheel.types import Message

FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]  # cancelled: the client went away

TRACE_ID = ("the response's id. A server that records traces (`flywheel serve` unless --no-traces, "
            "`flywheel loop run`) stores choice 0 as the trace with this id and choice i > 0 as `<id>-<i>`: "
            "POST /v1/traces/{id}/feedback reports how a choice went")
VERSION = "the model version that answered"


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an answer that grows a field must grow its model too


class ErrorDetail(_Out):
    message: str = Field(description="what is wrong, starting with the field it is about when there is one")
    type: str = Field(description="invalid_request_error, not_found_error, server_error or server_busy")
    param: str | None = Field(description="the field the error is about, as a path (`messages[1].role`, "
                                          "`verifier.task.answer`), or null")
    code: str | None = Field(description="a machine-readable code where there is one (`model_not_found`), or null")


class ErrorResponse(_Out):
    """Every error this server answers (unknown routes and bodies that are not JSON included),
    in OpenAI's shape."""

    error: ErrorDetail


class Health(_Out):
    status: Literal["ok"]
    model: str = Field(description="the served model's name, what requests put in `model`")
    version: str = Field(description="the model version served now")


class ModelCard(_Out):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    version: str = Field(description="the model version served now")


class ModelList(_Out):
    object: Literal["list"]
    data: list[ModelCard]


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] = Field(description="the token's own UTF-8 bytes; the entries' bytes join into the text's")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(description="the `top_logprobs` most likely alternatives ([] when none "
                                                       "were asked for)")


class ChatLogprobs(_Out):
    content: list[TokenLogprob]
    refusal: None


class _Response(_Out):
    id: str = Field(description=TRACE_ID)
    created: int
    model: str
    system_fingerprint: str = Field(description=VERSION)


class ChatChoice(_Out):
    index: int
    message: Message = Field(description="the assistant's message; valid tool calls in the text become `tool_calls`")
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(_Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: None
    text_offset: list[int]


class TextChoice(_Out):
    index: int = Field(description="prompt p's sample j is choice p * n + j")
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class TextCompletion(_Response):
    object: Literal["text_completion"]
    choices: list[TextChoice]
    usage: Usage


class FunctionDelta(_Out):
    name: str | None = None
    arguments: str


class ToolCallDelta(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class ChatDelta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class _Chunk(_Response):
    usage: Usage | None = Field(None, description="with stream_options.include_usage: null on every chunk but the "
                                                  "last, which has no choices and the request's usage")


class ChatCompletionChunk(_Chunk):
    """One server-sent event of a streamed chat completion."""

    object: Literal["chat.completion.chunk"]
    choices: list[ChatChunkChoice]


class TextChunkChoice(_Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class TextCompletionChunk(_Chunk):
    """One server-sent event of a streamed completion."""

    object: Literal["text_completion"]
    choices: list[TextChunkChoice]


class TraceIngestResult(_Out):
    """The fate of each record of a batch: valid records are stored (committed before this
    answer), invalid ones come back with their reason, a retry is a duplicate."""

    added: int
    duplicates: int
    rejected: int = Field(description="records invalid or in conflict")
    results: list[RecordResult] = Field(description="one per record, in the batch's order; `id` is the trace id "
                                                    "that feedback is posted to")


class FeedbackResult(_Out):
    id: str = Field(description="the stored feedback's id (a retry with the same idempotency_key gets the same)")
