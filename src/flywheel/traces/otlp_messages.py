"""The chat a GenAI span carries, in the OpenAI chat format flywheel stores.

A span's attributes arrive as plain Python values (otlp.py decodes OTLP's AnyValue: a
kvlistValue is a dict, an arrayValue a list). Three generations of the OpenTelemetry GenAI
semantic conventions are read, newest first; the first that yields messages wins:

1. `gen_ai.input.messages` / `gen_ai.output.messages` / `gen_ai.system_instructions` /
   `gen_ai.tool.definitions`: JSON strings (or structured values) of the conventions' message
   format, `[{"role", "parts": [{"type": "text", "content"}, {"type": "tool_call", "id",
   "name", "arguments"}, {"type": "tool_call_response", "id", "response"}, ...]}]`, output
   messages with a `finish_reason`. Also read from a `gen_ai.client.inference.operation.details`
   span event, which carries the same attributes.
2. The older flattened attributes: `gen_ai.prompt.N.role|content|tool_call_id|tool_calls.M.*`,
   `gen_ai.completion.N.role|content|finish_reason|tool_calls.M.*`, tools as
   `llm.request.functions.N.name|description|parameters`.
3. The older span events: `gen_ai.system.message`, `gen_ai.user.message`,
   `gen_ai.assistant.message`, `gen_ai.tool.message` (input, in event order) and `gen_ai.choice`
   (output), their body's fields as event attributes (`content`, `role`, `tool_calls`, `id`,
   `message`, `finish_reason`); and `gen_ai.content.prompt` / `gen_ai.content.completion`
   events with OpenAI-format JSON under `gen_ai.prompt` / `gen_ai.completion`.

Parts map to OpenAI messages: text parts -> `content` (a string for one text part, else a
list of `{"type": "text", "text"}` parts), tool_call parts -> `tool_calls` (arguments kept as
sent: a JSON string or an object; none recorded -> `{}`), each tool_call_response part -> its
own `{"role": "tool", "tool_call_id", "content"}` message (a non-string response as JSON), a
`reasoning` part -> `reasoning_content`, any other part kept as a content part as it is.
Anything that cannot be read raises `ContentError` naming the attribute (or event) and the
place in it: `gen_ai.input.messages[2].role: unknown role 'robot' (...)`.
"""

from __future__ import annotations

import json
import re
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")
INPUT_EVENTS = {"gen_ai.system.message": "system", "gen_ai.user.message": "user",
                "gen_ai.assistant.message": "assistant", "gen_ai.tool.message": "tool"}
DETAILS_EVENT = "gen_ai.client.inference.operation.details"

Message = dict[str, Any]  # an OpenAI chat message (flywheel.types.Message)


class ContentError(ValueError):
    """A GenAI attribute or event this module cannot read; the message names where."""


class SpanChat:
    """What one span says of its chat call: `inputs` (the messages sent, system instructions
    first), `outputs` (the choices, assistant messages), `finish_reasons`, `tools` (OpenAI
    `tools` entries)."""

    def __init__(self, inputs: list[Message], outputs: list[Message], finish_reasons: list[str | None],
                 tools: list[dict]):
        self.inputs, self.outputs, self.finish_reasons, self.tools = inputs, outputs, finish_reasons, tools

    @property
    def empty(self) -> bool:
        return not self.inputs and not self.outputs


def span_chat(attributes: dict[str, Any], events: list[tuple[str, dict[str, Any]]]) -> SpanChat:
    """The chat of a span from its attributes and its events ((name, attributes), in order)."""
    attrs = dict(attributes)
    for name, event_attrs in events:
        if name == DETAILS_EVENT:  # the newest conventions' event form: the same attributes
            attrs = {**{k: v for k, v in event_attrs.items() if k.startswith("gen_ai.")}, **attrs}
    tools = _tools(attrs)
    for read in (_semconv_messages, _flat_messages, _event_messages):
        chat = read(attrs, events)
        if not chat.empty:
            chat.tools = chat.tools or tools
            return chat
    return SpanChat([], [], [], tools)


# ---------------------------------------------------------------- 1. gen_ai.input.messages and friends

def _json_value(value: Any, where: str) -> Any:
    """An attribute that holds JSON: a JSON string, or a structured value already."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise ContentError(f"{where}: not valid JSON ({e})") from None
    return value


def _list_of_objects(value: Any, where: str) -> list[dict]:
    value = _json_value(value, where)
    if not isinstance(value, list):
        raise ContentError(f"{where}: expected a JSON array, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ContentError(f"{where}[{i}]: expected a JSON object, got {type(item).__name__}")
    return value


def _semconv_messages(attrs: dict[str, Any], events) -> SpanChat:
    inputs: list[Message] = []
    if "gen_ai.system_instructions" in attrs:
        where = "gen_ai.system_instructions"
        parts = _list_of_objects(attrs[where], where)
        if parts:
            inputs += parts_to_messages("system", parts, where)
    for i, msg in enumerate(_list_of_objects(attrs.get("gen_ai.input.messages", []), "gen_ai.input.messages")):
        inputs += semconv_message(msg, f"gen_ai.input.messages[{i}]")
    outputs, reasons = [], []
    for i, msg in enumerate(_list_of_objects(attrs.get("gen_ai.output.messages", []), "gen_ai.output.messages")):
        where = f"gen_ai.output.messages[{i}]"
        converted = semconv_message(msg, where)
        if len(converted) != 1 or converted[0]["role"] != "assistant":
            raise ContentError(f"{where}: an output message must be one assistant message")
        outputs.append(converted[0])
        reasons.append(_optional_str(msg.get("finish_reason"), f"{where}.finish_reason"))
    return SpanChat(inputs, outputs, reasons, [])


def semconv_message(msg: dict, where: str) -> list[Message]:
    """One message of the conventions' format as OpenAI messages (several when it carries
    tool call responses: one tool message each)."""
    role = msg.get("role")
    if not isinstance(role, str):
        raise ContentError(f"{where}.role: required, a string")
    parts = msg.get("parts")
    if not isinstance(parts, list):
        raise ContentError(f"{where}.parts: required, a JSON array of parts")
    out = parts_to_messages(role, parts, where)
    name = msg.get("name")
    if isinstance(name, str) and name and out and out[-1]["role"] == role:
        out[-1]["name"] = name
    return out


def parts_to_messages(role: str, parts: list, where: str) -> list[Message]:
    if role not in ROLES:
        raise ContentError(f"{where}.role: unknown role {role!r} (valid: {', '.join(ROLES)})")
    content: list[dict] = []
    calls: list[dict] = []
    tool_messages: list[Message] = []
    reasoning: list[str] = []
    for j, part in enumerate(parts):
        at = f"{where}.parts[{j}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str) or not part["type"]:
            raise ContentError(f"{at}: expected an object with a 'type'")
        kind = part["type"]
        if kind == "text":
            content.append({"type": "text", "text": _text(part.get("content"), f"{at}.content")})
        elif kind == "tool_call":
            calls.append(tool_call(part.get("id"), part.get("name"), part.get("arguments"), at))
        elif kind == "tool_call_response":
            if "response" not in part:
                raise ContentError(f"{at}.response: required")
            tool_messages.append({"role": "tool", "tool_call_id": _optional_str(part.get("id"), f"{at}.id"),
                                  "content": _as_text(part["response"])})
        elif kind == "reasoning":
            reasoning.append(_text(part.get("content"), f"{at}.content"))
        else:
            content.append(dict(part))  # an image, a file, a provider's own part: kept as it came
    if calls and role != "assistant":
        raise ContentError(f"{where}: a {role} message cannot carry tool_call parts")
    message: Message = {"role": role}
    if len(content) == 1 and content[0]["type"] == "text":
        message["content"] = content[0]["text"]
    elif content:
        message["content"] = content
    if calls:
        message["tool_calls"] = calls
    if reasoning and role == "assistant":
        message["reasoning_content"] = "".join(reasoning)
    if "content" not in message and not calls:
        if tool_messages:  # a message of tool call responses only
            return tool_messages
        message["content"] = ""
    return tool_messages + [message]  # responses first: they answer the assistant turn before


def tool_call(call_id: Any, name: Any, arguments: Any, where: str) -> dict:
    """An OpenAI `tool_calls` entry."""
    if not isinstance(name, str) or not name:
        raise ContentError(f"{where}.name: required, a non-empty string")
    if arguments is None:
        arguments = {}
    elif not isinstance(arguments, (str, dict)):
        arguments = json.dumps(arguments)
    call: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    call_id = _optional_str(call_id, f"{where}.id")
    if call_id:
        call["id"] = call_id
    return call


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ContentError(f"{where}: required, a string")
    return value


def _optional_str(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ContentError(f"{where}: expected a string, got {type(value).__name__}")
    return value


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _tools(attrs: dict[str, Any]) -> list[dict]:
    """`gen_ai.tool.definitions` (the conventions' `{"type": "function", "name", ...}` or
    OpenAI's `{"type": "function", "function": {...}}`), else `llm.request.functions.N.*`;
    tools of other types than function are left out."""
    tools = []
    if "gen_ai.tool.definitions" in attrs:
        where = "gen_ai.tool.definitions"
        for i, tool in enumerate(_list_of_objects(attrs[where], where)):
            if tool.get("type", "function") != "function":
                continue
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            tools.append(_function(fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}[{i}]"))
        return tools
    for i, fields in sorted(_indexed(attrs, "llm.request.functions.").items()):
        where = f"llm.request.functions.{i}"
        tools.append(_function(fields.get("name"), fields.get("description"), fields.get("parameters"), where))
    return tools


def _function(name: Any, description: Any, parameters: Any, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise ContentError(f"{where}.name: required, a non-empty string")
    fn: dict[str, Any] = {"name": name}
    if description is not None:
        fn["description"] = _optional_str(description, f"{where}.description")
    if parameters is not None:
        parameters = _json_value(parameters, f"{where}.parameters")
        if not isinstance(parameters, dict):
            raise ContentError(f"{where}.parameters: expected a JSON object (a JSON Schema)")
        fn["parameters"] = parameters
    return {"type": "function", "function": fn}


# ---------------------------------------------------------------- 2. gen_ai.prompt.N.* / gen_ai.completion.N.*

_INDEXED = re.compile(r"(\d+)\.(.+)")


def _indexed(attrs: dict[str, Any], prefix: str) -> dict[int, dict[str, Any]]:
    """{N: {rest: value}} of the attributes named `prefix` + "N." + rest."""
    out: dict[int, dict[str, Any]] = {}
    for key, value in attrs.items():
        if key.startswith(prefix):
            m = _INDEXED.fullmatch(key[len(prefix):])
            if m:
                out.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return out


def _flat_messages(attrs: dict[str, Any], events) -> SpanChat:
    prompts = sorted(_indexed(attrs, "gen_ai.prompt.").items())
    inputs = [_flat_message(fields, f"gen_ai.prompt.{i}", "user") for i, fields in prompts]
    outputs, reasons = [], []
    for i, fields in sorted(_indexed(attrs, "gen_ai.completion.").items()):
        where = f"gen_ai.completion.{i}"
        message = _flat_message(fields, where, "assistant")
        if message["role"] != "assistant":
            raise ContentError(f"{where}.role: a completion must be an assistant message, not {message['role']!r}")
        outputs.append(message)
        reasons.append(_optional_str(fields.get("finish_reason"), f"{where}.finish_reason"))
    return SpanChat(inputs, outputs, reasons, [])


def _flat_message(fields: dict[str, Any], where: str, default_role: str) -> Message:
    role = fields.get("role", default_role)
    if role not in ROLES:
        raise ContentError(f"{where}.role: unknown role {role!r} (valid: {', '.join(ROLES)})")
    message: Message = {"role": role}
    content = fields.get("content")
    if content is not None:
        message["content"] = _content(content, f"{where}.content")
    calls = [tool_call(f.get("id"), f.get("name"), f.get("arguments"), f"{where}.tool_calls.{j}")
             for j, f in sorted(_indexed(fields, "tool_calls.").items())]
    if "function_call.name" in fields:  # the legacy single function call
        calls.append(tool_call(None, fields["function_call.name"], fields.get("function_call.arguments"),
                               f"{where}.function_call"))
    if calls:
        message["tool_calls"] = calls
    if role == "tool" and fields.get("tool_call_id") is not None:
        message["tool_call_id"] = _optional_str(fields["tool_call_id"], f"{where}.tool_call_id")
    if "content" not in message and not calls:
        message["content"] = ""
    return message


def _content(value: Any, where: str) -> str | list:
    """A content attribute: text, or (as some instrumentations write a list of parts) the JSON
    text of OpenAI content parts."""
    if isinstance(value, str) and value.startswith("[{"):
        try:
            parts = json.loads(value)
        except json.JSONDecodeError:
            return value
        if all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in parts):
            return parts
        return value
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in value):
        return value
    raise ContentError(f"{where}: expected a string or a list of content parts, got {type(value).__name__}")


# ---------------------------------------------------------------- 3. the older span events

def _event_messages(attrs: dict[str, Any], events: list[tuple[str, dict[str, Any]]]) -> SpanChat:
    inputs: list[Message] = []
    outputs: list[Message] = []
    reasons: list[str | None] = []
    for k, (name, fields) in enumerate(events):
        where = f"events[{k}]({name})"
        if "gen_ai.event.content" in fields:  # a body recorded whole, as JSON
            body = _json_value(fields["gen_ai.event.content"], f"{where}.gen_ai.event.content")
            fields = body if isinstance(body, dict) else {"content": body}
        if name in INPUT_EVENTS:
            inputs.append(_openai_message(fields, where, INPUT_EVENTS[name]))
        elif name == "gen_ai.choice":
            message = fields.get("message")
            body = _json_value(message, f"{where}.message") if message is not None else fields
            if not isinstance(body, dict):
                raise ContentError(f"{where}.message: expected a JSON object")
            outputs.append(_openai_message(body, where, "assistant"))
            reasons.append(_optional_str(fields.get("finish_reason"), f"{where}.finish_reason"))
        elif name == "gen_ai.content.prompt" and "gen_ai.prompt" in fields:
            for i, m in enumerate(_list_of_objects(fields["gen_ai.prompt"], f"{where}.gen_ai.prompt")):
                inputs.append(_openai_message(m, f"{where}.gen_ai.prompt[{i}]", "user"))
        elif name == "gen_ai.content.completion" and "gen_ai.completion" in fields:
            for i, m in enumerate(_list_of_objects(fields["gen_ai.completion"], f"{where}.gen_ai.completion")):
                body = m.get("message") if isinstance(m.get("message"), dict) else m
                outputs.append(_openai_message(body, f"{where}.gen_ai.completion[{i}]", "assistant"))
                reasons.append(_optional_str(m.get("finish_reason"), f"{where}.gen_ai.completion[{i}].finish_reason"))
    return SpanChat(inputs, outputs, reasons, [])


def _openai_message(fields: dict[str, Any], where: str, role: str) -> Message:
    """An OpenAI-like message body (content, tool_calls, id / tool_call_id), the role from the
    event's name unless the body names one."""
    role = fields.get("role") or role
    if role not in ROLES:
        raise ContentError(f"{where}.role: unknown role {role!r} (valid: {', '.join(ROLES)})")
    message: Message = {"role": role}
    if fields.get("content") is not None:
        message["content"] = _content(fields["content"], f"{where}.content")
    raw_calls = fields.get("tool_calls")
    if raw_calls is not None:
        calls = []
        for j, call in enumerate(_list_of_objects(raw_calls, f"{where}.tool_calls")):
            fn = call.get("function") if isinstance(call.get("function"), dict) else call
            calls.append(tool_call(call.get("id"), fn.get("name"), fn.get("arguments"), f"{where}.tool_calls[{j}]"))
        if calls:
            message["tool_calls"] = calls
    call_id = fields.get("tool_call_id", fields.get("id"))
    if role == "tool" and call_id is not None:
        message["tool_call_id"] = _optional_str(call_id, f"{where}.id")
    if "content" not in message and "tool_calls" not in message:
        message["content"] = ""
    return message
