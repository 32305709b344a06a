"""SFT data: JSONL files -> token ids and loss masks, with every bad line accounted for.

One example per non-blank line (blank lines are ignored). Two formats, chosen by
`SFTDataConfig.format` ("auto" decides per line by its keys):

- chat, the OpenAI chat fine-tuning format:
  `{"messages": [...], "tools": [...], "parallel_tool_calls": ...}` ("tools" optional,
  "parallel_tool_calls" ignored). Roles: system, user, assistant, tool. An assistant message
  may carry `"weight": 0` to keep it out of the loss; tool-call `arguments` may be a JSON
  string or an object. Rendered with the tokenizer's chat template turn by turn
  (`flywheel.models.chat.Conversation`); the loss covers the assistant turns, end-of-turn
  token included.
- prompt_completion: `{"prompt": str, "completion": str}`, raw text with no chat template:
  ids = encode(prompt) + encode(completion) [+ eos if `add_eos`], loss on completion (+ eos).

Either row may carry `"distill": true`: its trained tokens are then trained toward the
reference's distribution at each position (the forward KL, train/forward.py `distill_loss`)
instead of toward the tokens themselves; the reference is the model with its LoRA adapter off.

A bad line raises `DataError` naming file:line (`on_error="raise"`), or is skipped with a
warning and counted in the `DataReport` (`on_error="skip"`). Lines over `max_length` are
truncated or skipped (`overlong`), also with a warning each. Nothing is dropped silently.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from jinja2.exceptions import TemplateError

from flywheel.config import SFTDataConfig
from flywheel.jsonl import MAX_LINE_BYTES, read_lines, too_long_reason
from flywheel.models.chat import ChatRenderer, ChatTemplateError
from flywheel.types import Message

ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data file or line is invalid; the message names the file (and line)."""


@dataclass
class Example:
    ids: list[int]
    loss_mask: list[int]  # 1 where the token is trained; same length as ids
    source: str  # "path:line"
    distill: bool = False  # trained toward the reference's distribution, not the tokens


@dataclass
class DataReport:
    files: list[str] = field(default_factory=list)
    lines: int = 0  # non-blank lines read
    examples: int = 0
    skipped_invalid: int = 0
    truncated: int = 0
    skipped_overlong: int = 0
    no_trained_tokens: int = 0  # skipped: no assistant message with weight 1
    warnings: list[str] = field(default_factory=list)

    def summary(self) -> str:
        n = len(self.files)
        head = f"{self.examples} examples from {n} file{'' if n == 1 else 's'} ({self.lines} lines)"
        parts = [f"{count} {what}" for count, what in (
            (self.skipped_invalid, "invalid skipped"),
            (self.no_trained_tokens, "with nothing to train skipped"),
            (self.truncated, "truncated"),
            (self.skipped_overlong, "overlong skipped"),
        ) if count]
        return head + (": " + ", ".join(parts) if parts else "")


class _BadLine(Exception):
    """A line that cannot become an example; `counter` names the DataReport field it counts in."""

    def __init__(self, reason: str, counter: str = "skipped_invalid"):
        super().__init__(reason)
        self.reason, self.counter = reason, counter


def load_sft_examples(paths: list[str], tokenizer, cfg: SFTDataConfig,
                      log: Callable[[str], None] | None = None) -> tuple[list[Example], DataReport]:
    """Read JSONL files into examples. Raises DataError for a missing file, a file that
    yields no examples, or (with on_error="raise") the first bad line."""
    log = log or (lambda msg: warnings.warn(msg, stacklevel=3))
    for path in paths:
        if not Path(path).is_file():
            raise DataError(f"data file {str(path)!r} does not exist"
                            if not Path(path).exists() else f"data path {str(path)!r} is not a file")
    report = DataReport(files=[str(p) for p in paths])
    encoder = _LineEncoder(tokenizer, cfg)
    examples: list[Example] = []

    def warn(msg: str) -> None:
        report.warnings.append(msg)
        log(msg)

    for path in paths:
        first_example, first_line = len(examples), report.lines
        with open(path, "rb") as f:
            for line in read_lines(f, MAX_LINE_BYTES):
                if line.is_blank():
                    continue
                report.lines += 1
                source = f"{path}:{line.number}"
                try:
                    if line.too_long:
                        raise _BadLine(f"the line is {too_long_reason(line, MAX_LINE_BYTES)}")
                    ids, mask, distill = encoder.encode_line(line.data)
                except _BadLine as bad:
                    if cfg.on_error == "raise":
                        raise DataError(f"{source}: {bad.reason}") from None
                    setattr(report, bad.counter, getattr(report, bad.counter) + 1)
                    warn(f"{source}: {bad.reason}; line skipped")
                    continue
                if len(ids) > cfg.max_length:
                    too_long = f"{source}: {len(ids)} tokens > max_length {cfg.max_length}"
                    if cfg.overlong == "truncate" and any(mask[:cfg.max_length]):
                        ids, mask = ids[:cfg.max_length], mask[:cfg.max_length]
                        report.truncated += 1
                        warn(f"{too_long}; truncated")
                    else:
                        report.skipped_overlong += 1
                        why = "" if cfg.overlong == "skip" else " and truncating would leave no trained token"
                        warn(f"{too_long}{why}; line skipped")
                        continue
                examples.append(Example(ids, mask, source, distill))
        if len(examples) == first_example:
            n_lines = report.lines - first_line
            raise DataError(f"{path}: no usable examples ({n_lines} non-blank lines"
                            + (", all skipped; see the warnings above)" if n_lines else ")"))
    report.examples = len(examples)
    return examples, report


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean",
             int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


class _LineEncoder:
    def __init__(self, tokenizer, cfg: SFTDataConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        self._renderer: ChatRenderer | None = None

    @property
    def renderer(self) -> ChatRenderer:
        if self._renderer is None:  # only chat data needs a template; a missing one is not a line error
            self._renderer = ChatRenderer(self.tokenizer)
        return self._renderer

    def encode_line(self, raw: bytes) -> tuple[list[int], list[int], bool]:
        """(ids, loss mask, distill) of one line."""
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _BadLine(f"not valid UTF-8 (byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise _BadLine(f"invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(row, dict):
            raise _BadLine(f"expected a JSON object, got {_json_type(row)}")
        distill = row.get("distill", False)
        if not isinstance(distill, bool):
            raise _BadLine(f"'distill' must be true or false, got {_json_type(distill)} {distill!r}")
        fmt = self.cfg.format
        if fmt == "auto":
            if "messages" in row:
                fmt = "chat"
            elif "prompt" in row or "completion" in row:
                fmt = "prompt_completion"
            else:
                raise _BadLine(f"neither 'messages' nor 'prompt'/'completion' (keys: {sorted(row)})")
        return (*(self._chat(row) if fmt == "chat" else self._prompt_completion(row)), distill)

    def _prompt_completion(self, row: dict) -> tuple[list[int], list[int]]:
        for key in ("prompt", "completion"):
            if key not in row:
                raise _BadLine(f"missing '{key}'")
            if not isinstance(row[key], str):
                raise _BadLine(f"'{key}' must be a string, got {_json_type(row[key])}")
        if not row["completion"]:
            raise _BadLine("empty 'completion'")
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False) if text else []
        prompt, completion = encode(row["prompt"]), encode(row["completion"])
        if self.cfg.add_eos:
            if self.tokenizer.eos_token_id is None:
                raise DataError("the tokenizer has no eos token; set data.add_eos=false")
            completion.append(self.tokenizer.eos_token_id)
        return prompt + completion, [0] * len(prompt) + [1] * len(completion)

    def _chat(self, row: dict) -> tuple[list[int], list[int]]:
        if "messages" not in row:
            raise _BadLine(f"missing 'messages' (keys: {sorted(row)})")
        messages, tools = row["messages"], row.get("tools")
        if not isinstance(messages, list) or not messages:
            raise _BadLine("'messages' must be a non-empty array")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise _BadLine("'tools' must be an array of objects")
        turns = [_clean_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
        if not any(trained for m, trained in turns if m["role"] == "assistant"):
            raise _BadLine("no trained assistant message (nothing to learn)", "no_trained_tokens")
        conv = self.renderer.start([], tools)
        try:
            run: list[Message] = []  # consecutive non-assistant messages, rendered together
            for message, trained in turns:
                if message["role"] != "assistant":
                    run.append(message)
                    continue
                conv.append_messages(run)
                run = []
                conv.append_assistant_message(message, trained=trained)
            conv.append_messages(run)
            conv.finish()
        except (ChatTemplateError, TemplateError) as e:
            raise _BadLine(f"the chat template cannot render this conversation: {e}") from None
        return conv.ids, conv.assistant_mask


def _text(content: Any, where: str) -> str:
    """Message content as a string; OpenAI's list of {"type": "text", "text": ...} parts is joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    raise _BadLine(f"{where}.content must be a string (or an array of text parts), "
                   f"got {_json_type(content)}")


def _clean_message(m: Any, where: str) -> tuple[Message, bool]:
    """Validate one OpenAI message; return (plain message for the renderer, trained)."""
    if not isinstance(m, dict):
        raise _BadLine(f"{where} is not an object ({_json_type(m)})")
    if "role" not in m:
        raise _BadLine(f"{where} has no 'role'")
    role = m["role"]
    if role not in ROLES:
        raise _BadLine(f"unknown role {role!r} in {where} (valid: {', '.join(ROLES)})")
    out = {k: v for k, v in m.items() if k != "weight"}
    if role != "assistant":
        if "weight" in m:
            raise _BadLine(f"{where}: 'weight' is only allowed on assistant messages")
        out["content"] = _text(m.get("content"), where)
        return out, False
    weight = m.get("weight", 1)
    if isinstance(weight, bool) or weight not in (0, 1):
        raise _BadLine(f"{where}: 'weight' must be 0 or 1, got {weight!r}")
    if m.get("content") is not None:
        out["content"] = _text(m["content"], where)
    calls = m.get("tool_calls")
    if calls is not None:
        out["tool_calls"] = _clean_tool_calls(calls, where)
    if not out.get("content") and not out.get("tool_calls"):
        raise _BadLine(f"{where}: assistant message has neither content nor tool_calls")
    return out, weight == 1


def _clean_tool_calls(calls: Any, where: str) -> list[dict]:
    """Check each call has function.name and function.arguments; parse string arguments so
    the template renders every call's arguments the same way (tojson)."""
    if not isinstance(calls, list):
        raise _BadLine(f"{where}.tool_calls must be an array, got {_json_type(calls)}")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict):
            raise _BadLine(f"{at} needs a 'function' object")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _BadLine(f"{at}.function.name must be a non-empty string")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise _BadLine(f"{at}.function.arguments is not valid JSON: {e.msg} "
                               f"(column {e.colno})") from None
        if not isinstance(args, dict):
            raise _BadLine(f"{at}.function.arguments must be a JSON object (or a string "
                           f"holding one), got {_json_type(args)}")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out
