"""Request bodies of the OpenAI-compatible endpoints (responses are built as plain dicts).

Messages are flywheel's one message type (`flywheel.types.Message`) and tools the trace
store's `ToolDef`, TypedDicts validated into plain dicts, so a request the server accepts
is a trace the store accepts.
Unknown fields are refused with their name; OpenAI fields that this server cannot honour are
accepted only at their neutral value (e.g. `presence_penalty=0`) and refused otherwise,
never silently ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from flywheel.traces.schema import ToolDef
from flywheel.types import Message

_UNSUPPORTED_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, ge=0, le=1, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # what torch.Generator.manual_seed takes
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @model_validator(mode="after")
    def _neutral_only(self):
        for name, neutral in _UNSUPPORTED_NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name} is not supported by this server (only {neutral})")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options and set(self.stream_options) - {"include_usage"}:
            raise ValueError(f"stream_options: unknown keys {sorted(set(self.stream_options) - {'include_usage'})}")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatCompletionRequest(_Body):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none"] | None = None  # forcing a call would need constrained decoding
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)  # alternatives per token (needs logprobs)
    response_format: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _drop_nulls(cls, v: Any) -> Any:
        # clients echo assistant messages back with null / empty fields (audio, annotations, ...)
        if isinstance(v, list):
            return [{k: x for k, x in m.items() if x is not None and not (k == "annotations" and x == [])}
                    if isinstance(m, dict) else m for m in v]
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("the 'top_logprobs' parameter is only allowed when 'logprobs' is enabled")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError(f"only {{'type': 'text'}} is supported, got {v.get('type')!r}")
        return v

    @model_validator(mode="after")
    def _one_budget(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one")
        return self

    @property
    def budget(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template and the traces take them: null fields left out
        (in tool calls and content parts too), every tool call typed "function"."""
        return [_message_dict(m) for m in self.messages]

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template renders them (`tojson`, so key order counts): the
        type, then the function's name, description, parameters and strict where not null."""
        if not self.tools:
            return None
        return [{"type": "function", "function": {k: t["function"][k] for k in _FUNCTION_KEYS
                                                  if t["function"].get(k) is not None}} for t in self.tools]


_FUNCTION_KEYS = ("name", "description", "parameters", "strict")


def _without_nulls(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _message_dict(message: dict[str, Any]) -> dict[str, Any]:
    out = _without_nulls(message)
    if "tool_calls" in out:
        out["tool_calls"] = [{**_without_nulls({"id": c.get("id")}), "type": "function", "function": c["function"]}
                             for c in out["tool_calls"]]
    if isinstance(out.get("content"), list):
        out["content"] = [_without_nulls(part) for part in out["content"]]
    return out


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=0)  # only the sampled token's logprob

    @model_validator(mode="after")
    def _supported(self):
        if self.echo:
            raise ValueError("echo is not supported by this server")
        if self.best_of not in (None, 1, self.n):
            raise ValueError("best_of is not supported by this server (only equal to n)")
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be an empty list")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as texts or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    @property
    def budget(self) -> int:
        return self.max_tokens or 16  # OpenAI's default for /v1/completions
