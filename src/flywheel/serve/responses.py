"""Response builders for the OpenAI wire format: pure functions of the model's output.

Tool calls (`assistant_message`): when tools were offered, valid Hermes calls in the sampled
text become the message's `tool_calls` (arguments as a JSON string) and the text around them
its `content`; a turn whose calls are all malformed is returned as plain text, so nothing the
model wrote is lost.

Streaming (`TextStream`, `LogprobStream`, `Chunks`): a streamed choice's content goes out as
it is sampled, in pieces that are certain to be a prefix of the final text (the non-streamed
text of the same request, exactly): complete characters only, with stop strings and tool
calls held back. When a choice ends, its last chunks carry the rest, so a stream's content
reassembles to the non-streamed one.
"""

from __future__ import annotations

import codecs
import json
import logging
import uuid
from typing import Any, Callable, Iterable, Iterator, Sequence

from flywheel.models.tool_calls import HermesParser, ToolCallParser
from flywheel.inference.sampler import Sample
from flywheel.models.token_bytes import TokenTable, token_text

log = logging.getLogger(__name__)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def assistant_message(text: str, *, tools_offered: bool, finish_reason: str,
                      parser: ToolCallParser | None = None) -> tuple[dict[str, Any], str]:
    """(OpenAI assistant message, finish_reason) for one sampled text. With tools offered and
    valid calls parsed: `content` is the text around them (None when empty) and finish_reason
    "tool_calls", unless the sample was cut by its token budget ("length") or its caller went
    away ("cancelled")."""
    if tools_offered:
        parsed = (parser or HermesParser()).parse(text)
        if parsed.tool_calls:
            calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                     for c in parsed.tool_calls]
            message = {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}
            return message, (finish_reason if finish_reason in ("length", "cancelled") else "tool_calls")
    return {"role": "assistant", "content": text}, finish_reason


def _message_tokens(sample: Sample) -> tuple[list[int], list[float]]:
    """The sample's token ids and logprobs without a final stop token."""
    ids, lps = sample.token_ids, sample.logprobs
    if isinstance(sample.stop_reason, int) and ids and ids[-1] == sample.stop_reason:
        ids, lps = ids[:-1], lps[:-1]
    return list(ids), list(lps)


def chat_logprobs(table: TokenTable, sample: Sample) -> dict[str, Any]:
    """A chat choice's `logprobs`: one entry per token of the message, i.e. without a final
    stop token and without ids that have no token (vocabulary padding: they make no text).
    Each entry's `bytes` are its token's own (see token_bytes), so the entries' bytes join
    into the UTF-8 of the message's text; `top_logprobs` holds the sample's alternatives
    (`[]` when none were asked for)."""
    (ids, lps), tops = _message_tokens(sample), sample.top_logprobs
    entries = (logprob_entry(table, t, lp, tops[i] if tops is not None else None)
               for i, (t, lp) in enumerate(zip(ids, lps)))
    return {"content": [e for e in entries if e is not None], "refusal": None}


def logprob_entry(table: TokenTable, token_id: int, logprob: float,
                  alternatives: Sequence[tuple[int, float]] | None) -> dict[str, Any] | None:
    """One token's entry of `logprobs.content` (None for an id without a token)."""
    raw = table.bytes_of(token_id)
    if raw is None:
        return None
    top = []
    for alt, alt_lp in alternatives or ():
        alt_raw = table.bytes_of(alt)
        if alt_raw is not None:
            top.append({"token": token_text(alt_raw), "logprob": alt_lp, "bytes": list(alt_raw)})
    return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw), "top_logprobs": top}


def completion_logprobs(table: TokenTable, sample: Sample) -> dict[str, Any]:
    """A completion choice's `logprobs` (the legacy format): each token of the text named as
    in chat (its own bytes; `bytes:\\xNN` for part of a character), ids without a token left
    out; `text_offset` is the index in the text of the first character the token starts or
    completes (special tokens make no text)."""
    tokens, logprobs, offsets = [], [], []
    chars, decoder = 0, codecs.getincrementaldecoder("utf-8")(errors="ignore")  # characters completed so far
    for t, lp in zip(*_message_tokens(sample)):
        raw = table.bytes_of(t)
        if raw is None:
            continue
        tokens.append(token_text(raw))
        logprobs.append(lp)
        offsets.append(chars)
        if t not in table.special:
            chars += len(decoder.decode(raw))
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------------- streaming


def text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as `LocalEngine` decodes a sample's text (special tokens skipped)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class TextStream:
    """One streamed sample row: `feed` token ids as they are sampled, get the text that is
    safe to send now; `finish` with the final text, get the rest. Held back:
      - incomplete characters: decoding is incremental over the ids, and text whose decoding
        ends in U+FFFD (a UTF-8 sequence split across tokens) waits for the next token;
      - stop strings: text that contains one, or ends with what could be the start of one, is
        held from there until it is known not to be one (the final text is cut before the
        first stop string);
      - tool calls (tools offered): everything from the first `hold` string (the parser's
        `open_tag`; a parser without one: the whole content) on; the choice's last chunks
        carry the rest of the content, then the parsed `delta.tool_calls` (one chunk with
        index, id, type and function name, one with the arguments), as OpenAI streams them.
        Since a message with tool calls has its content stripped, trailing whitespace is held
        until text follows it, and a turn that starts with whitespace is held to its end.

    stop: the request's stop strings. hold: strings from whose first occurrence on the text
    is held to the end (the tool-call tag). tools: a tool-call turn (whitespace rules).
    hold_all: send nothing before the end."""

    def __init__(self, decode: Callable[[list[int]], str], *, stop: Sequence[str] = (), hold: Sequence[str] = (),
                 tools: bool = False, hold_all: bool = False):
        self.decode = decode
        self.watch = tuple(stop) + tuple(hold)
        self.tools, self.hold_all = tools, hold_all
        self.ids: list[int] = []
        self.text = ""  # complete characters decoded so far
        self.sent = ""  # the text sent so far
        self._prefix = self._read = 0  # ids[_prefix:_read] decode to the end of `text`

    def feed(self, ids: Iterable[int]) -> str:
        self.ids.extend(ids)
        # incremental: decode only the last piece; its text before _read is already in `text`
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        if self.hold_all:
            return ""
        safe = self._safe()
        if len(safe) > len(self.sent) and safe.startswith(self.sent):
            piece, self.sent = safe[len(self.sent):], safe
            return piece
        return ""

    def _safe(self) -> str:
        text, start = self.text, len(self.sent)  # nothing sent overlaps a watched string
        if self.tools and text[:1].isspace():
            return ""  # stripped if the turn holds a tool call, kept if not: unknown until the end
        cut = len(text)
        for s in self.watch:
            at = text.find(s, start)
            if at >= 0:
                cut = min(cut, at)
                continue
            for k in range(min(len(s) - 1, len(text) - start), 0, -1):
                if text.endswith(s[:k]):  # could be the start of `s`
                    cut = min(cut, len(text) - k)
                    break
        safe = text[:cut]
        return safe.rstrip() if self.tools else safe

    def finish(self, final: str) -> str:
        """The part of the final text not sent yet."""
        if not final.startswith(self.sent):  # a tokenizer whose decoding is not prefix-stable
            log.error("streamed text %r is not a prefix of the final text %r", self.sent[-40:], final[:80])
        rest, self.sent = final[len(self.sent):], final
        return rest


class LogprobStream:
    """The logprob entries of one streamed chat choice, sent with the chunk whose text
    completes their tokens: `feed` the reported tokens, `take` after sending a piece of
    text. A token that makes no text of its own (a special token) goes with the next one
    that does, so a final stop token is never sent here; whatever is not sent when the
    choice ends goes in its last chunks (`Chunks.chat_end`, from the final entries)."""

    def __init__(self, table: TokenTable):
        self.table = table
        self.pending: list[tuple[dict[str, Any], int]] = []  # (entry, bytes of text it makes)
        self.sent = 0  # entries sent
        self.text_bytes = 0  # bytes of the text sent
        self._covered = 0  # bytes of text the sent entries make

    def feed(self, ids: Sequence[int], reported: Sequence[tuple[float, Any]]) -> None:
        for t, (lp, alternatives) in zip(ids, reported):
            entry = logprob_entry(self.table, t, lp, alternatives)
            if entry is not None:
                self.pending.append((entry, self.table.text_bytes(t)))

    def take(self, piece: str) -> dict[str, Any] | None:
        """After `piece` was sent: the `logprobs` of its chunk (None if no entry is due)."""
        self.text_bytes += len(piece.encode("utf-8"))
        total, cut, cut_total = self._covered, 0, self._covered
        for j, (_, n) in enumerate(self.pending):
            if total + n > self.text_bytes:
                break
            total += n
            if n:
                cut, cut_total = j + 1, total
        if not cut:
            return None
        out = [e for e, _ in self.pending[:cut]]
        del self.pending[:cut]
        self.sent += cut
        self._covered = cut_total
        return {"content": out, "refusal": None}


class Chunks:
    """The chunk objects of one streamed response (`chat.completion.chunk` or streamed
    `text_completion`); with include_usage every chunk has `usage: null` and `usage()` makes
    the last one."""

    def __init__(self, kind: str, rid: str, created: int, model: str, fingerprint: str | None,
                 include_usage: bool = False):
        self.head = {"id": rid, "object": kind, "created": created, "model": model,
                     "system_fingerprint": fingerprint}
        self.include_usage = include_usage

    def _wrap(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {**self.head, "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def chat(self, index: int, delta: dict[str, Any], finish: str | None = None, logprobs=None) -> dict[str, Any]:
        return self._wrap({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish})

    def text(self, index: int, text: str, finish: str | None = None, logprobs=None) -> dict[str, Any]:
        return self._wrap({"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish})

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage}

    def chat_end(self, choice: dict[str, Any], rest: str, sent_logprobs: int = 0) -> Iterator[dict[str, Any]]:
        """The last chunks of a chat choice: the rest of its content, its tool calls, its
        logprobs (those after the `sent_logprobs` entries already streamed), its finish_reason."""
        i, message = choice["index"], choice["message"]
        logprobs = choice.get("logprobs")
        if logprobs is not None:
            logprobs = {**logprobs, "content": logprobs["content"][sent_logprobs:]}
            if not logprobs["content"] and (sent_logprobs or rest):
                logprobs = None
        if rest:
            yield self.chat(i, {"content": rest}, logprobs=logprobs)
            logprobs = None
        for k, call in enumerate(message.get("tool_calls") or []):
            fn = call["function"]
            yield self.chat(i, {"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                                "function": {"name": fn["name"], "arguments": ""}}]})
            if fn["arguments"]:
                yield self.chat(i, {"tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]})
        if logprobs is not None:
            yield self.chat(i, {}, logprobs=logprobs)
        yield self.chat(i, {}, choice["finish_reason"])

    def text_end(self, choice: dict[str, Any], rest: str) -> Iterator[dict[str, Any]]:
        if rest:
            yield self.text(choice["index"], rest)
        yield self.text(choice["index"], "", choice["finish_reason"], choice.get("logprobs"))


SSE_DONE = "data: [DONE]\n\n"


def sse_event(chunk: dict[str, Any]) -> str:
    """One server-sent event: a `data:` line."""
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
