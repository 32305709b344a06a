"""One message type: `flywheel.types.Message` is what the trace store and the server validate,
what the chat renderer renders and what a parsed tool call turns into."""

from __future__ import annotations

import inspect

import pytest
from pydantic import TypeAdapter, ValidationError

from flywheel.models import chat
from flywheel.serve import schemas as service_schemas
from flywheel.traces import schema as trace_schema
from flywheel.traces.schema import describe
from flywheel.types import Message, ToolCall, ToolCallPart

MESSAGE = TypeAdapter(Message)


def test_the_wire_schema_the_server_and_the_renderer_name_the_same_type():
    assert trace_schema.Message is Message
    assert service_schemas.Message is Message
    assert chat.Message is Message
    assert "ChatMessage" not in vars(trace_schema) and "ToolCall" not in vars(trace_schema)
    assert "Message" in inspect.signature(chat.ChatRenderer.render).parameters["messages"].annotation


def test_a_parsed_tool_call_is_a_valid_message_part():
    part = ToolCall("calc", {"expr": "1+2"}, "call_0").to_message_part()
    assert part == {"type": "function", "id": "call_0", "function": {"name": "calc", "arguments": {"expr": "1+2"}}}
    assert TypeAdapter(ToolCallPart).validate_python(part) == part
    message = {"role": "assistant", "content": None, "tool_calls": [part]}
    assert MESSAGE.validate_python(message) == message  # plain dicts in, plain dicts out


@pytest.mark.parametrize("message, reason", [
    ({"role": "robot", "content": "x"}, "role: unknown role 'robot' (valid: system, developer, user, assistant, tool)"),
    ({"role": "user", "content": 5}, "content: must be a string, a list of content parts or null"),
    ({"role": "user"}, "a user message needs content"),
    ({"role": "user", "content": "x", "tool_calls": []}, "only assistant messages carry tool_calls, not user"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 1}}]},
     "tool_calls[0].function.arguments: must be a JSON string or an object"),
    ({"role": "user", "content": "x", "mood": "ok"}, "mood: unknown field"),
])
def test_a_bad_message_is_refused_naming_the_field(message, reason):
    with pytest.raises(ValidationError) as e:
        MESSAGE.validate_python(message)
    assert describe(e.value) == reason
