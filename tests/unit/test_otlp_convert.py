"""OTLP/JSON trace exports as flywheel traces (flywheel.traces.otlp), on hand-written bodies:
the GenAI conventions' message attributes, the older flattened attributes and events, tool
calls, an agent's span tree stitched into one trace, spans without GenAI attributes ignored,
and malformed bodies refused with the field's path."""

from __future__ import annotations

import json
import random

import pytest

from flywheel.traces.batch import prepare_traces
from flywheel.traces.otlp import OtlpMalformed, convert

T1, T2 = "0af7651916cd43dd8448eb211c80319c", "1bf7651916cd43dd8448eb211c80319d"
SEC = 10 ** 9
BASE = 1_700_000_000 * SEC  # 2023-11-14T22:13:20Z


def value(v):
    """A Python value as an OTLP/JSON AnyValue (ints as decimal strings, as protobuf's JSON writes them)."""
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, str):
        return {"stringValue": v}
    if isinstance(v, list):
        return {"arrayValue": {"values": [value(x) for x in v]}}
    return {"kvlistValue": {"values": attrs(v)}}


def attrs(d: dict) -> list[dict]:
    return [{"key": k, "value": value(v)} for k, v in d.items()]


def span(span_id: str, attributes: dict | None = None, *, trace=T1, parent=None, start=0.0, end=None, name="s",
         events=()) -> dict:
    out = {"traceId": trace, "spanId": span_id, "name": name, "kind": 1,
           "startTimeUnixNano": str(BASE + int(start * SEC)),
           "endTimeUnixNano": str(BASE + int((start + 1 if end is None else end) * SEC)),
           "attributes": attrs(attributes or {})}
    if parent:
        out["parentSpanId"] = parent
    if events:
        out["events"] = [{"name": n, "timeUnixNano": str(BASE), "attributes": attrs(a)} for n, a in events]
    return out


def export(*spans: dict, service: str = "support-agent") -> dict:
    return {"resourceSpans": [{"resource": {"attributes": attrs({"service.name": service})},
                               "scopeSpans": [{"scope": {"name": "opentelemetry.instrumentation.openai_v2"},
                                               "spans": list(spans)}]}]}


def text(role: str, content: str, **extra) -> dict:
    return {"role": role, "parts": [{"type": "text", "content": content}], **extra}


def chat_attrs(inputs: list, outputs: list, **extra) -> dict:
    return {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o-mini",
            "gen_ai.input.messages": json.dumps(inputs), "gen_ai.output.messages": json.dumps(outputs), **extra}


WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_1", "name": "get_weather",
                                        "arguments": {"city": "Paris"}}], "finish_reason": "tool_call"}
RESULT = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": {"temp_c": 21}}]}


def only_trace(body: dict) -> dict:
    out = convert(body)
    assert not out.errors and len(out.traces) == 1, (out.errors, out.traces)
    record = out.traces[0].record
    assert not prepare_traces([record], "test").invalid  # a valid TraceIn
    return record


def test_new_style_messages_become_an_openai_chat_trace():
    a = chat_attrs([text("user", "Weather in Paris?"), CALL, RESULT],
                   [text("assistant", "21 °C and sunny.", finish_reason="stop")],
                   **{"gen_ai.system_instructions": json.dumps([{"type": "text", "content": "Be brief."}]),
                      "gen_ai.tool.definitions": json.dumps([WEATHER]), "gen_ai.response.model": "gpt-4o-mini-2024",
                      "gen_ai.usage.input_tokens": 52, "gen_ai.usage.output_tokens": 7,
                      "gen_ai.provider.name": "openai", "gen_ai.response.id": "chatcmpl-1"})
    record = only_trace(export(span("b7ad6b7169203331", a, start=2.0, end=2.25)))
    assert record["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "id": "call_1", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    assert record["response"] == {"role": "assistant", "content": "21 °C and sunny."}
    assert record["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city", "parameters": WEATHER["parameters"]}}]
    assert record["model"] == "gpt-4o-mini-2024"  # the response's model before the request's
    assert record["usage"] == {"prompt_tokens": 52, "completion_tokens": 7, "total_tokens": 59}
    assert record["latency_ms"] == 250.0
    assert record["created_at"] == "2023-11-14T22:13:22+00:00"
    assert record["source"] == "otlp:support-agent"
    assert record["idempotency_key"] == f"otlp:{T1}:b7ad6b7169203331"
    assert record["metadata"]["otel"] == {
        "trace_id": T1, "span_id": "b7ad6b7169203331", "span_ids": ["b7ad6b7169203331"],
        "service_name": "support-agent",
        "scope": "opentelemetry.instrumentation.openai_v2", "operation": "chat", "turns": 1, "provider": "openai",
        "response_id": "chatcmpl-1", "finish_reason": "stop"}


def test_structured_attribute_values_read_like_json_strings():
    """The conventions allow messages as structured values (arrayValue of kvlistValue) besides JSON text."""
    a = {"gen_ai.operation.name": "chat", "gen_ai.input.messages": [text("user", "hi")],
         "gen_ai.output.messages": [text("assistant", "hello", finish_reason="stop")]}
    record = only_trace(export(span("00000000000000a1", a)))
    assert record["messages"] == [{"role": "user", "content": "hi"}]
    assert record["response"] == {"role": "assistant", "content": "hello"}


def test_older_flattened_prompt_and_completion_attributes():
    a = {"gen_ai.system": "openai", "gen_ai.request.model": "gpt-4", "llm.request.type": "chat",
         "gen_ai.prompt.0.role": "system", "gen_ai.prompt.0.content": "You add numbers.",
         "gen_ai.prompt.1.role": "user", "gen_ai.prompt.1.content": "2+3?",
         "gen_ai.prompt.2.role": "assistant", "gen_ai.prompt.2.tool_calls.0.id": "c9",
         "gen_ai.prompt.2.tool_calls.0.name": "add", "gen_ai.prompt.2.tool_calls.0.arguments": '{"a": 2, "b": 3}',
         "gen_ai.prompt.3.role": "tool", "gen_ai.prompt.3.tool_call_id": "c9", "gen_ai.prompt.3.content": "5",
         "gen_ai.completion.0.role": "assistant", "gen_ai.completion.0.content": "5",
         "gen_ai.completion.0.finish_reason": "stop",
         "llm.request.functions.0.name": "add", "llm.request.functions.0.parameters": '{"type": "object"}',
         "gen_ai.usage.prompt_tokens": 30, "gen_ai.usage.completion_tokens": 1}
    record = only_trace(export(span("00000000000000b1", a)))
    assert record["messages"] == [
        {"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2+3?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "id": "c9",
                                              "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "5"}]
    assert record["response"] == {"role": "assistant", "content": "5"}
    assert record["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert record["usage"]["prompt_tokens"] == 30 and record["metadata"]["otel"]["provider"] == "openai"


def test_older_message_events_and_the_details_event():
    events = [("gen_ai.system.message", {"content": "Be kind."}),
              ("gen_ai.user.message", {"content": "Hi!"}),
              ("gen_ai.choice", {"index": 0, "finish_reason": "tool_calls", "message": json.dumps(
                  {"role": "assistant", "tool_calls": [{"id": "t1", "type": "function",
                                                        "function": {"name": "wave", "arguments": "{}"}}]})})]
    record = only_trace(export(span("00000000000000c1", {"gen_ai.operation.name": "chat"}, events=events)))
    assert record["messages"] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi!"}]
    assert record["response"] == {"role": "assistant", "tool_calls": [
        {"type": "function", "id": "t1", "function": {"name": "wave", "arguments": "{}"}}]}
    assert record["metadata"]["otel"]["finish_reason"] == "tool_calls"
    details = [("gen_ai.client.inference.operation.details", {
        "gen_ai.input.messages": json.dumps([text("user", "ping")]),
        "gen_ai.output.messages": json.dumps([text("assistant", "pong", finish_reason="stop")])})]
    record = only_trace(export(span("00000000000000c2", {"gen_ai.operation.name": "chat"}, events=details)))
    assert (record["messages"], record["response"]["content"]) == ([{"role": "user", "content": "ping"}], "pong")


def agent_run(history_resent: bool) -> list[dict]:
    """invoke_agent > chat (asks for a tool) > execute_tool > chat (answers): the openai-agents shape."""
    agent = span("a000000000000001", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather"},
                 start=0, end=5, name="invoke_agent weather")
    first = span("c000000000000001", chat_attrs([text("system", "Use tools."), text("user", "Paris?")], [CALL],
                                                **{"gen_ai.usage.input_tokens": 20, "gen_ai.usage.output_tokens": 5}),
                 parent="a000000000000001", start=0.5, end=1.5)
    tool = span("e000000000000001", {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
                                     "gen_ai.tool.call.id": "call_1", "gen_ai.tool.call.result": '{"temp_c": 21}'},
                parent="a000000000000001", start=1.6, end=1.8)
    second_input = [text("system", "Use tools."), text("user", "Paris?"), CALL, RESULT] if history_resent else []
    second = span("c000000000000002", chat_attrs(second_input, [text("assistant", "21 °C.", finish_reason="stop")],
                                                 **{"gen_ai.usage.input_tokens": 40, "gen_ai.usage.output_tokens": 4}),
                  parent="a000000000000001", start=2.0, end=4.5)
    return [agent, first, tool, second]


STITCHED = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Paris?"},
            {"role": "assistant", "tool_calls": [{"type": "function", "id": "call_1", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]


@pytest.mark.parametrize("history_resent", [True, False], ids=["history-resent", "new-turns-only"])
def test_an_agent_span_tree_becomes_one_multi_turn_trace(history_resent):
    spans = agent_run(history_resent)
    random.Random(0).shuffle(spans)  # exporters send spans as they end: order comes from start times
    record = only_trace(export(*spans))
    assert record["messages"] == STITCHED  # the tool's result from execute_tool when the call lacks it
    assert record["response"] == {"role": "assistant", "content": "21 °C."}
    assert record["usage"] == {"prompt_tokens": 60, "completion_tokens": 9, "total_tokens": 69}
    assert record["latency_ms"] == 5000.0  # the agent span's whole run
    assert record["idempotency_key"] == f"otlp:{T1}:c000000000000002"
    otel = record["metadata"]["otel"]
    assert (otel["agent_span_id"], otel["agent_name"], otel["turns"]) == ("a000000000000001", "weather", 2)
    assert sorted(otel["span_ids"]) == ["a000000000000001", "c000000000000001", "c000000000000002",
                                        "e000000000000001"]


def test_two_agent_runs_in_one_trace_are_two_traces_and_loose_chats_group_by_trace_id():
    run_a = agent_run(True)
    run_b = [dict(s, spanId="b" + s["spanId"][1:], **({"parentSpanId": "b" + s["parentSpanId"][1:]}
                                                     if "parentSpanId" in s else {})) for s in agent_run(True)]
    loose = [span("d000000000000001", chat_attrs([text("user", "a")], [text("assistant", "b")]), trace=T2, start=0),
             span("d000000000000002", chat_attrs([text("user", "a"), text("assistant", "b"), text("user", "c")],
                                                 [text("assistant", "d")]), trace=T2, start=1)]
    out = convert(export(*run_a, *run_b, *loose))
    keys = sorted(t.record["idempotency_key"] for t in out.traces)
    assert keys == [f"otlp:{T1}:b000000000000002", f"otlp:{T1}:c000000000000002", f"otlp:{T2}:d000000000000002"]
    stitched = next(t.record for t in out.traces if T2 in t.record["idempotency_key"])
    assert [m["content"] for m in stitched["messages"]] == ["a", "b", "c"]


def test_spans_without_genai_attributes_are_counted_and_ignored():
    http = span("f000000000000001", {"http.request.method": "POST", "url.full": "https://api.openai.com/v1/chat"})
    no_content = span("f000000000000002", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m"},
                      trace=T2)  # content capture off: GenAI, but no messages
    chat = span("f000000000000003", chat_attrs([text("user", "x")], [text("assistant", "y")]))
    out = convert(export(http, no_content, chat))
    assert (out.spans, out.ignored, out.no_content, len(out.traces), out.errors) == (3, 1, 1, 1, [])


BAD_BODIES = [  # (body, the field named)
    ([], ""),
    ({"resourceSpans": {}}, "resourceSpans"),
    ({"resourceSpans": [{"scopeSpans": [{"spans": "x"}]}]}, "resourceSpans[0].scopeSpans[0].spans"),
    (export(span("00000000000000e1"), dict(span("00000000000000e2"), traceId="abc")),
     "resourceSpans[0].scopeSpans[0].spans[1].traceId"),
    (export({k: v for k, v in span("00000000000000e1").items() if k != "spanId"}),
     "resourceSpans[0].scopeSpans[0].spans[0].spanId"),
    (export(dict(span("00000000000000e1"), traceId="0" * 32)), "resourceSpans[0].scopeSpans[0].spans[0].traceId"),
    (export(dict(span("00000000000000e1"), parentSpanId="xyz")),
     "resourceSpans[0].scopeSpans[0].spans[0].parentSpanId"),
    (export(dict(span("00000000000000e1"), startTimeUnixNano="-5")),
     "resourceSpans[0].scopeSpans[0].spans[0].startTimeUnixNano"),
    (export(dict(span("00000000000000e1"), attributes=[{"key": "n", "value": {"intValue": "ten"}}])),
     "resourceSpans[0].scopeSpans[0].spans[0].attributes[0].value.intValue"),
    (export(dict(span("00000000000000e1"), attributes=[{"key": "n", "value": {"stringValue": "a", "intValue": 1}}])),
     "resourceSpans[0].scopeSpans[0].spans[0].attributes[0].value"),
    (export(dict(span("00000000000000e1"), attributes=[{"value": {"stringValue": "a"}}])),
     "resourceSpans[0].scopeSpans[0].spans[0].attributes[0].key"),
]


@pytest.mark.parametrize("body, field", BAD_BODIES)
def test_a_malformed_body_is_refused_naming_the_field(body, field):
    with pytest.raises(OtlpMalformed) as e:
        convert(body)
    assert e.value.field == field
    assert str(e.value).startswith(f"{field}: " if field else "expected")


def test_a_run_whose_content_cannot_be_read_is_rejected_whole_and_named():
    bad_json = span("00000000000000f1", {"gen_ai.operation.name": "chat", "gen_ai.input.messages": "[{oops"})
    bad_role = span("00000000000000f2", chat_attrs([text("robot", "beep")], []), trace=T2)
    good = span("00000000000000f3", chat_attrs([text("user", "x")], [text("assistant", "y")]),
                trace="2" * 32)
    out = convert(export(bad_json, bad_role, good))
    assert len(out.traces) == 1 and out.rejected_spans == 2
    messages = sorted(e.message for e in out.errors)
    assert messages[0].startswith("resourceSpans[0].scopeSpans[0].spans[0]: gen_ai.input.messages: not valid JSON")
    assert messages[1] == ("resourceSpans[0].scopeSpans[0].spans[1]: gen_ai.input.messages[0].role: unknown role "
                           "'robot' (valid: system, developer, user, assistant, tool)")
    usage = span("00000000000000f4", chat_attrs([text("user", "x")], [], **{"gen_ai.usage.input_tokens": -1}))
    assert "gen_ai.usage.input_tokens: expected a non-negative integer" in convert(export(usage)).errors[0].message


# ---------------------------------------------------------------- evaluations -> feedback

A1, C1, E1 = "a000000000000001", "c000000000000001", "e000000000000001"
QUESTION = [text("user", "What is 512 minus 38?")]
WRONG = [text("assistant", "The answer is 516.", finish_reason="stop")]
EVAL = {"gen_ai.evaluation.name": "calculator_check", "gen_ai.evaluation.score.value": 0.0,
        "gen_ai.evaluation.score.label": "wrong", "gen_ai.evaluation.explanation": "expected 474",
        "flywheel.verifier.env": "calculator", "flywheel.verifier.task": '{"answer": "474"}'}


def evaluated_run(agent_attrs: dict | None = None, agent_events=(), *extra: dict) -> dict:
    agent = span(A1, {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "calc", **(agent_attrs or {})},
                 end=3, events=agent_events)
    return export(agent, span(C1, chat_attrs(QUESTION, WRONG), parent=A1, start=1), *extra)


def test_an_evaluation_event_on_the_agent_span_is_the_trace_feedback_with_a_verifier():
    out = convert(evaluated_run(None, [("gen_ai.evaluation.result", EVAL)]))
    assert not out.errors and out.ignored == 0 and len(out.traces) == 1
    (where, fb), = out.traces[0].feedback
    assert where == "resourceSpans[0].scopeSpans[0].spans[0].events[0]"
    assert fb == {"source": "user", "idempotency_key": f"otlp:{T1}:{A1}:0", "score": 0.0, "label": "wrong",
                  "text": "calculator_check: expected 474", "created_at": "2023-11-14T22:13:20+00:00",
                  "verifier": {"env": "calculator", "task": {"answer": "474"}}}
    # a re-sent export gives the same keys: the store adds nothing
    assert convert(evaluated_run(None, [("gen_ai.evaluation.result", EVAL)])).traces[0].feedback[0][1] == fb


def test_an_evaluation_span_counts_as_genai_and_takes_the_agents_verifier():
    verifier = {k: EVAL.pop(k) for k in ("flywheel.verifier.env", "flywheel.verifier.task")}
    try:
        evaluation = span(E1, {**EVAL, "gen_ai.evaluation.score.value": 1}, parent=C1, start=3, end=3)
        other = span("f000000000000001", {"http.method": "GET"}, parent=A1)
        out = convert(evaluated_run(verifier, (), evaluation, other))
    finally:
        EVAL.update(verifier)
    assert not out.errors and out.ignored == 1 and out.no_content == 0 and len(out.traces) == 1
    record, ((where, fb),) = out.traces[0].record, out.traces[0].feedback
    assert where.endswith("spans[2]") and fb["idempotency_key"] == f"otlp:{T1}:{E1}:span"
    assert fb["score"] == 1.0 and fb["verifier"] == {"env": "calculator", "task": {"answer": "474"}}
    assert record["latency_ms"] == 3000.0  # the evaluation after the run is not part of its time


def test_an_evaluation_in_another_trace_joins_the_run_by_response_id_else_is_an_orphan():
    chat = span(C1, chat_attrs(QUESTION, WRONG, **{"gen_ai.response.id": "chatcmpl-9"}))
    evaluation = span(E1, {**EVAL, "gen_ai.response.id": "chatcmpl-9"}, trace=T2)
    out = convert(export(chat, evaluation))
    assert len(out.traces) == 1 and len(out.traces[0].feedback) == 1 and out.orphan_evaluations == 0
    alone = convert(export(span(E1, EVAL, trace=T2)))
    assert alone.traces == [] and alone.orphan_evaluations == 1 and alone.no_content == 0 and alone.ignored == 0


@pytest.mark.parametrize("change, message", [
    ({"gen_ai.evaluation.score.value": "high"}, "events[0]: gen_ai.evaluation.score.value: expected a finite number"),
    ({"flywheel.verifier.task": "{answer: 474}"}, "events[0]: flywheel.verifier.task: not valid JSON"),
    ({"flywheel.verifier.task": '["474"]'}, "events[0]: flywheel.verifier.task: expected a JSON object, got list"),
    ({"flywheel.verifier.env": None}, "events[0]: flywheel.verifier.env: required with flywheel.verifier.task"),
    ({"gen_ai.evaluation.name": ""}, "events[0]: gen_ai.evaluation.name: required"),
])
def test_a_malformed_evaluation_rejects_its_run_naming_the_attribute(change, message):
    evaluation = {k: v for k, v in {**EVAL, **change}.items() if v is not None}
    other_run = span("b000000000000001", chat_attrs(QUESTION, WRONG), trace=T2)
    out = convert(export(*evaluated_run(None, [("gen_ai.evaluation.result", evaluation)])["resourceSpans"][0]
                         ["scopeSpans"][0]["spans"], other_run))
    assert len(out.traces) == 1 and len(out.errors) == 1 and out.rejected_spans == 2
    assert out.errors[0].message.startswith("resourceSpans[0].scopeSpans[0].spans[0].") and message in \
        out.errors[0].message, out.errors[0].message
