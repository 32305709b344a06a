"""Response builders for the OpenAI wire format: pure functions of the model's output.

Tool calls: when tools were offered, the sampled text is parsed with the Hermes parser
(`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`). Valid calls become the
message's `tool_calls` (arguments as a JSON string, as OpenAI sends them) and the text
around them its `content` (None when empty); finish_reason is then "tool_calls" unless the
sample was cut by its token budget ("length"). A turn whose calls are all malformed is
returned as plain text, so nothing the model wrote is lost.

Streaming (`chat_chunks`, `completion_chunks`): the chunks are cut from a finished
response. The engine runs a batch to completion before any token leaves it, so a stream
carries the whole completion in pieces right after its batch ends (time to first token =
time to the last); the wire format is OpenAI's, and chunks reassemble to exactly the
non-streamed text. True token streaming needs a per-step callback in LocalEngine.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Iterator, Sequence

from flywheel.envs.parsing import HermesParser, ToolCallParser
from flywheel.inference.sampler import Sample

CHUNK_CHARS = 16  # characters of content per streamed chunk


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def assistant_message(text: str, *, tools_offered: bool, finish_reason: str,
                      parser: ToolCallParser | None = None) -> tuple[dict[str, Any], str]:
    """(OpenAI assistant message, finish_reason) for one sampled text."""
    if tools_offered:
        parsed = (parser or HermesParser()).parse(text)
        if parsed.tool_calls:
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                     for c in parsed.tool_calls]
            message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
            return message, ("length" if finish_reason == "length" else "tool_calls")
    return {"role": "assistant", "content": text}, finish_reason


def token_logprobs(tokenizer, sample: Sample) -> list[tuple[str, float]]:
    """(token text, logprob) of each sampled token, without a final stop token."""
    ids, lps = sample.token_ids, sample.logprobs
    if isinstance(sample.stop_reason, int) and ids and ids[-1] == sample.stop_reason:
        ids, lps = ids[:-1], lps[:-1]
    return [(tokenizer.decode([t], skip_special_tokens=False), lp) for t, lp in zip(ids, lps)]


def chat_logprobs(pairs: Sequence[tuple[str, float]]) -> dict[str, Any]:
    return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()), "top_logprobs": []}
                        for tok, lp in pairs], "refusal": None}


def completion_logprobs(pairs: Sequence[tuple[str, float]]) -> dict[str, Any]:
    offsets, at = [], 0
    for tok, _ in pairs:
        offsets.append(at)
        at += len(tok)
    return {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
            "top_logprobs": None, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------------- streaming


def _pieces(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    for start in range(0, len(text), size):
        yield text[start:start + size]


def chat_chunks(response: dict[str, Any], include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a finished chat completion, choice by choice."""
    head = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"], "system_fingerprint": response.get("system_fingerprint")}

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs=None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    for choice in response["choices"]:
        i, message = choice["index"], choice["message"]
        yield chunk(i, {"role": "assistant", "content": ""})
        for piece in _pieces(message.get("content") or ""):
            yield chunk(i, {"content": piece})
        for k, call in enumerate(message.get("tool_calls") or []):
            yield chunk(i, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                            "function": {"name": call["function"]["name"], "arguments": ""}}]})
            for piece in _pieces(call["function"]["arguments"]):
                yield chunk(i, {"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
        if choice.get("logprobs"):
            yield chunk(i, {}, logprobs=choice["logprobs"])
        yield chunk(i, {}, choice["finish_reason"])
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def completion_chunks(response: dict[str, Any], include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The streamed `text_completion` objects of a finished completion."""
    head = {"id": response["id"], "object": "text_completion", "created": response["created"],
            "model": response["model"], "system_fingerprint": response.get("system_fingerprint")}

    def chunk(index: int, text: str, finish: str | None = None, logprobs=None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            out["usage"] = None
        return out

    for choice in response["choices"]:
        for piece in _pieces(choice["text"]):
            yield chunk(choice["index"], piece)
        yield chunk(choice["index"], "", choice["finish_reason"], choice.get("logprobs"))
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}


def sse(chunks: Iterator[dict[str, Any]]) -> Iterator[str]:
    """Server-sent events: one `data:` line per chunk, then `data: [DONE]`."""
    for c in chunks:
        yield f"data: {json.dumps(c, ensure_ascii=False)}\n\n"
    yield "data: [DONE]\n\n"
