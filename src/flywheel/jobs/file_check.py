"""Checking an uploaded JSONL file against the row format of a fine-tuning method, before a job
trains on it (pure: bytes in, a report out).

- supervised: `{"messages": [...], "tools"?: [...], "parallel_tool_calls"?: bool}` with at
  least one assistant message (OpenAI's chat fine-tuning format; `weight: 0|1` on an
  assistant message keeps it out of the loss or in).
- dpo: `{"input": {"messages": [...], "tools"?: [...]}, "preferred_output": [assistant
  message], "non_preferred_output": [assistant message]}`.
- reinforcement: `{"messages": [...], "tools"?: [...], <any other field the grader reads as
  {{ item.<field> }}>}`, the messages ending before the answer the model is to sample.
A message is an object with a known `role`; content is a string, a list of text parts, or
null on an assistant message that calls tools. `check_file` reads a stream a line at a time and reports every bad
line with its number (1-based) and reason, up to `MAX_REPORTED`, and how many rows were good.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable

import orjson

from flywheel.jsonl import MAX_LINE_BYTES, read_lines, too_long_reason

ROLES = {"system", "developer", "user", "assistant", "tool"}
MAX_REPORTED = 20


@dataclass
class FileReport:
    rows: int = 0  # good rows
    problems: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason), the first MAX_REPORTED
    bad_rows: int = 0

    @property
    def ok(self) -> bool:
        return self.bad_rows == 0 and self.rows > 0

    def message(self, what: str) -> str:
        """One line a person can act on: which lines are bad and why (the first few)."""
        if self.rows == 0 and self.bad_rows == 0:
            return f"{what} has no rows"
        shown = "; ".join(f"line {n}: {reason}" for n, reason in self.problems[:5])
        more = f" (and {self.bad_rows - 5} more bad lines)" if self.bad_rows > 5 else ""
        return f"{what} has {self.bad_rows} invalid line(s) of {self.rows + self.bad_rows}: {shown}{more}"


def check_file(f: BinaryIO, method_type: str, max_line_bytes: int = MAX_LINE_BYTES) -> FileReport:
    return check_rows(f, {"supervised": _supervised, "dpo": _dpo, "reinforcement": _reinforcement}[method_type],
                      max_line_bytes)


def check_rows(f: BinaryIO, check: Callable[[dict], str | None], max_line_bytes: int = MAX_LINE_BYTES) -> FileReport:
    """The report of `check(row)` (a problem, or None) over every JSON-object line of the binary
    stream `f`, read a line at a time (flywheel/jsonl.py: a leading BOM is dropped, a line over
    `max_line_bytes` is a problem and is never read whole)."""
    report = FileReport()
    for line in read_lines(f, max_line_bytes):
        if line.is_blank():
            continue
        if line.too_long:
            problem = too_long_reason(line, max_line_bytes)
        else:
            try:
                row = orjson.loads(line.data)
            except orjson.JSONDecodeError as exc:
                problem = f"not valid JSON ({exc})"
            else:
                problem = check(row) if isinstance(row, dict) else \
                    f"a row must be a JSON object, got {type(row).__name__}"
        if problem is None:
            report.rows += 1
        else:
            report.bad_rows += 1
            if len(report.problems) < MAX_REPORTED:
                report.problems.append((line.number, problem))
    return report


def _message_problem(m: Any, where: str) -> str | None:
    if not isinstance(m, dict):
        return f"{where} must be an object"
    role = m.get("role")
    if role not in ROLES:
        return f"{where}.role must be one of {', '.join(sorted(ROLES))}, got {role!r}"
    content = m.get("content")
    calls = m.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list) or not all(
            isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls)):
        return f"{where}.tool_calls must be a list of {{function: {{name, arguments}}}} on an assistant message"
    if content is None:
        if not (role == "assistant" and calls):
            return f"{where}.content is missing (only an assistant message with tool_calls may omit it)"
    elif not isinstance(content, str) and not (isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content)):
        return f"{where}.content must be a string or a list of text parts"
    if "weight" in m and (role != "assistant" or m["weight"] not in (0, 1)):
        return f"{where}.weight must be 0 or 1, on an assistant message"
    return None


def _messages_problem(messages: Any, where: str) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"{where} must be a non-empty list of messages"
    for i, m in enumerate(messages):
        problem = _message_problem(m, f"{where}[{i}]")
        if problem:
            return problem
    return None


def _tools_problem(row: dict, where: str = "tools") -> str | None:
    tools = row.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        return f"{where} must be a list of {{type: function, function: {{name, parameters}}}}"
    return None


def _supervised(row: dict) -> str | None:
    problem = _messages_problem(row.get("messages"), "messages") or _tools_problem(row)
    if problem:
        return problem
    if not any(m["role"] == "assistant" for m in row["messages"]):
        return "messages has no assistant message to train on"
    return None


def _output_problem(output: Any, where: str) -> str | None:
    if not isinstance(output, list) or len(output) != 1:
        return f"{where} must be a list of one assistant message"
    problem = _message_problem(output[0], f"{where}[0]")
    if problem is None and output[0]["role"] != "assistant":
        return f"{where}[0].role must be assistant"
    return problem


def _dpo(row: dict) -> str | None:
    inp = row.get("input")
    if not isinstance(inp, dict):
        return "input must be an object with messages"
    return (_messages_problem(inp.get("messages"), "input.messages") or _tools_problem(inp, "input.tools")
            or _output_problem(row.get("preferred_output"), "preferred_output")
            or _output_problem(row.get("non_preferred_output"), "non_preferred_output"))


def _reinforcement(row: dict) -> str | None:
    problem = _messages_problem(row.get("messages"), "messages") or _tools_problem(row)
    if problem:
        return problem
    if row["messages"][-1]["role"] == "assistant":
        return "messages must end before the answer: the last message is the assistant's, which the model samples"
    return None
