"""Tool-call parsing from assistant text. Default: the Hermes / Qwen convention,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn, with text
around them; a tag may also hold a JSON list of such calls (the SmolLM2 family's format,
models/chat_template_smollm2_tools.jinja). A malformed call never raises: it becomes an entry
in `errors`, which the env turns into a tool-error message for the model."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from flywheel.types import ToolCall

@dataclass
class ParsedTurn:
    content: str  # the text outside tool calls, stripped
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # one per malformed call, for the model to read

class ToolCallParser(Protocol):
    def parse(self, text: str) -> ParsedTurn: ...

class HermesParser:
    open_tag, close_tag = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> ParsedTurn:
        calls, errors, outside = [], [], []
        pos = 0
        while True:
            start = text.find(self.open_tag, pos)
            if start < 0:
                outside.append(text[pos:])
                break
            outside.append(text[pos:start])
            body_start = start + len(self.open_tag)
            end = text.find(self.close_tag, body_start)
            if end < 0:  # unterminated: take the rest of the turn (models often stop before the tag)
                body, pos = text[body_start:], len(text)
            else:
                body, pos = text[body_start:end], end + len(self.close_tag)
            for call, error in self._parse_body(body.strip(), len(calls) + len(errors)):
                if call is not None:
                    calls.append(call)
                else:
                    errors.append(error)
            if end < 0:
                break
        return ParsedTurn(content="".join(outside).strip(), tool_calls=calls, errors=errors)

    @classmethod
    def _parse_body(cls, body: str, index: int) -> list[tuple[ToolCall | None, str]]:
        """The calls in one tag's body (an object, or a list of them), each a call or an error;
        `index`: the turn's calls and errors before this tag."""
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            return [(None, f"tool call {index + 1}: invalid JSON ({e.msg} at column {e.colno}): {_clip(body)}")]
        if isinstance(obj, list):
            return [cls._call(item, index + i) for i, item in enumerate(obj)]
        return [cls._call(obj, index)]

    @staticmethod
    def _call(obj, index: int) -> tuple[ToolCall | None, str]:
        where = f"tool call {index + 1}"
        if not isinstance(obj, dict):
            return None, f"{where}: expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
        name = obj.get("name")
        if not isinstance(name, str) or not name:
            return None, f"{where}: missing 'name'"
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models double-encode the arguments
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                return None, f"{where} ({name}): 'arguments' is a string that is not JSON: {_clip(args)}"
        if not isinstance(args, dict):
            return None, f"{where} ({name}): 'arguments' must be an object, got {type(args).__name__}"
        return ToolCall(name=name, arguments=args, id=f"call_{index}"), ""

def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."

