"""POST /otlp/v1/traces on a real server: the opentelemetry-sdk's own OTLP/HTTP exporter
(protobuf, plain and gzip) sends an agent's GenAI spans, made by hand the way the openai
instrumentation makes them; hand-written OTLP/JSON through httpx; re-sent exports store
nothing new; the traces are the caller's tenant's only; malformed bodies are 400s naming
the field, answered in OpenAI's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from flywheel.jobs import JobStore
from flywheel.jobs.keys import Keys
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve import OpenAIService
from flywheel.serve.app import create_app
from flywheel.serve.auth import KeyAuth
from flywheel.serve.background import BackgroundServer
from flywheel.traces import TraceStore

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("otlp")
    model = build_tiny_model(root / "m", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    jobs = JobStore(data_file_url(root), root / "files")
    keys = Keys(jobs.engine)
    key_a, _ = keys.create("alpha")
    key_b, _ = keys.create("beta")
    store = TraceStore(data_file_url(root))
    service = OpenAIService(str(model), version="v1")
    app = create_app(service, trace_store=store, tenant_of=KeyAuth(keys, rate_per_s=1000, burst=1000, cache_s=0))
    srv = BackgroundServer(app).start()
    a = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key_a}"}, timeout=60)
    b = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key_b}"}, timeout=60)
    yield dict(url=srv.url, a=a, b=b, key_a=key_a, store=store, doc=a.get("/openapi.json").json())
    a.close()
    b.close()
    srv.stop()
    service.close()
    store.close()
    jobs.close()


def msgs(*messages) -> str:
    return json.dumps(list(messages))


def part_text(role: str, content: str, **extra) -> dict:
    return {"role": role, "parts": [{"type": "text", "content": content}], **extra}


CALL = {"role": "assistant", "parts": [{"type": "tool_call", "id": "call_7", "name": "get_weather",
                                        "arguments": {"city": "Lyon"}}], "finish_reason": "tool_call"}
RESULT = {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_7", "response": "18 C, rain"}]}
SYSTEM, USER = part_text("system", "You answer weather questions."), part_text("user", "Weather in Lyon?")


def chat_span(tracer, inputs: list, output: dict, tokens: tuple[int, int]) -> None:
    """A chat span as opentelemetry-instrumentation-openai-v2 records one with content capture on."""
    with tracer.start_as_current_span("chat gpt-4o-mini", kind=SpanKind.CLIENT, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.system": "openai", "gen_ai.request.model": "gpt-4o-mini",
            "gen_ai.response.model": "gpt-4o-mini-2024-07-18", "gen_ai.response.id": "chatcmpl-x",
            "gen_ai.response.finish_reasons": [output.get("finish_reason", "stop")],
            "gen_ai.usage.input_tokens": tokens[0], "gen_ai.usage.output_tokens": tokens[1],
            "server.address": "api.openai.com", "gen_ai.input.messages": msgs(*inputs),
            "gen_ai.output.messages": msgs(output)}):
        pass


def agent_run(tracer) -> None:
    """invoke_agent > chat (calls a tool) > execute_tool > chat (answers), and an HTTP span with no gen_ai.*."""
    with tracer.start_as_current_span("invoke_agent weather", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "weather"}):
        chat_span(tracer, [SYSTEM, USER], CALL, (31, 9))
        with tracer.start_as_current_span("execute_tool get_weather", attributes={
                "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "get_weather",
                "gen_ai.tool.call.id": "call_7"}):
            with tracer.start_as_current_span("GET /weather", kind=SpanKind.CLIENT,
                                              attributes={"http.request.method": "GET"}):
                pass
        chat_span(tracer, [SYSTEM, USER, CALL, RESULT], part_text("assistant", "18 C and rain.",
                                                                 finish_reason="stop"), (52, 6))


def provider(*processors) -> TracerProvider:
    tp = TracerProvider(resource=Resource.create({"service.name": "weather-agent"}))
    for p in processors:
        tp.add_span_processor(p)
    return tp


def test_the_sdk_exporter_sends_an_agent_run_that_becomes_one_trace_of_the_callers_tenant(world):
    store, a, b = world["store"], world["a"], world["b"]
    exporter = OTLPSpanExporter(endpoint=f"{world['url']}/otlp/v1/traces",
                                headers={"authorization": f"Bearer {world['key_a']}"})
    memory = InMemorySpanExporter()
    tp = provider(BatchSpanProcessor(exporter), SimpleSpanProcessor(memory))
    agent_run(tp.get_tracer("weather-agent"))
    assert tp.force_flush(30_000)
    tp.shutdown()
    stored = [t for t in store.iter_traces(tenant="alpha") if t.source == "otlp:weather-agent"]
    assert len(stored) == 1, stored
    trace = stored[0]
    assert [m["role"] for m in trace.messages] == ["system", "user", "assistant", "tool"]
    assert trace.messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Lyon"}}
    assert trace.messages[3] == {"role": "tool", "tool_call_id": "call_7", "content": "18 C, rain"}
    assert trace.response == {"role": "assistant", "content": "18 C and rain."}
    assert trace.model == "gpt-4o-mini-2024-07-18" and trace.usage["prompt_tokens"] == 83
    spans = memory.get_finished_spans()
    last_chat = max((s for s in spans if s.name.startswith("chat")), key=lambda s: s.start_time)
    assert trace.metadata["otel"]["span_id"] == format(last_chat.context.span_id, "016x")
    assert trace.metadata["otel"]["service_name"] == "weather-agent" and trace.latency_ms > 0
    # the same export again, gzip this time: nothing new
    again = OTLPSpanExporter(endpoint=f"{world['url']}/otlp/v1/traces", compression=Compression.Gzip,
                             headers={"authorization": f"Bearer {world['key_a']}"})
    assert again.export(spans) == SpanExportResult.SUCCESS
    assert store.count(tenant="alpha", source="otlp:weather-agent") == 1
    # another tenant's key reaches none of it, and its own export is its own
    assert store.count(tenant="beta") == 0
    assert b.post(f"/v1/traces/{trace.id}/feedback", json={"score": 0.0}).status_code == 404
    assert a.post(f"/v1/traces/{trace.id}/feedback", json={"score": 1.0}).status_code == 200
    r = b.post("/otlp/v1/traces", content=encode_spans(spans).SerializeToString(),
               headers={"content-type": "application/x-protobuf"})
    assert r.status_code == 200 and r.headers["x-flywheel-traces-added"] == "1", r.text
    assert r.headers["x-flywheel-spans-ignored"] == "1"  # the HTTP span
    assert ExportTraceServiceResponse.FromString(r.content) == ExportTraceServiceResponse()  # full success
    assert store.count(tenant="beta") == 1 and store.count(tenant="alpha", source="otlp:weather-agent") == 1
    assert httpx.post(f"{world['url']}/otlp/v1/traces", content=b"",
                      headers={"content-type": "application/x-protobuf"}).status_code == 401


def kv(key: str, value) -> dict:
    return {"key": key, "value": {"intValue": str(value)} if isinstance(value, int) else {"stringValue": value}}


def json_export(*spans) -> dict:
    return {"resourceSpans": [{"resource": {"attributes": [kv("service.name", "json-agent")]},
                               "scopeSpans": [{"scope": {"name": "hand"}, "spans": list(spans)}]}]}


def json_span(trace_id: str, span_id: str, attributes: list) -> dict:
    return {"traceId": trace_id, "spanId": span_id, "name": "chat", "kind": 3,
            "startTimeUnixNano": "1700000000000000000", "endTimeUnixNano": 1700000000200000000,
            "attributes": attributes}


def test_otlp_json_with_a_partial_success_answered_as_the_spec_says(world):
    a, store, doc = world["a"], world["store"], world["doc"]
    good = json_span("5" * 32, "6" * 16, [kv("gen_ai.operation.name", "chat"), kv("gen_ai.prompt.0.role", "user"),
                                          kv("gen_ai.prompt.0.content", "1+1?"), kv("gen_ai.completion.0.content", "2"),
                                          kv("gen_ai.usage.input_tokens", 4), kv("gen_ai.usage.output_tokens", 1)])
    bad = json_span("7" * 32, "8" * 16, [kv("gen_ai.operation.name", "chat"), kv("gen_ai.input.messages", "[{oops")])
    plain = json_span("9" * 32, "a" * 16, [kv("db.system", "postgresql")])
    r = a.post("/otlp/v1/traces", json=json_export(good, bad, plain))
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    partial = r.json()["partialSuccess"]
    assert partial["rejectedSpans"] == 1
    assert "resourceSpans[0].scopeSpans[0].spans[1]: gen_ai.input.messages: not valid JSON" in partial["errorMessage"]
    schema = {"components": doc["components"], "$ref": "#/components/schemas/OtlpExportTraceServiceResponse"}
    assert jsonschema_rs.Draft202012Validator(schema).is_valid(r.json())
    (trace,) = store.iter_traces(tenant="alpha", source="otlp:json-agent")
    assert trace.messages == [{"role": "user", "content": "1+1?"}] and trace.response["content"] == "2"
    assert trace.latency_ms == 200.0 and trace.usage["total_tokens"] == 5
    again = a.post("/otlp/v1/traces", json=json_export(good, plain))
    assert again.json() == {} and again.headers["x-flywheel-traces-duplicate"] == "1"
    assert again.headers["x-flywheel-trace-ids"] == trace.id  # where its feedback goes
    assert store.count(tenant="alpha", source="otlp:json-agent") == 1


@pytest.mark.parametrize("content, content_type, status, param", [
    (json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "abc", "spanId": "1" * 16}]}]}]}),
     "application/json", 400, "resourceSpans[0].scopeSpans[0].spans[0].traceId"),
    (b"{not json", "application/json; charset=utf-8", 400, "body"),
    (b"\xff\xff\xff\xff", "application/x-protobuf", 400, "body"),
    (b"{}", "text/plain", 415, "content-type"),
])
def test_a_malformed_body_is_a_400_naming_the_field(world, content, content_type, status, param):
    r = world["a"].post("/otlp/v1/traces", content=content, headers={"content-type": content_type})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and set(error) == {"message", "type", "param", "code"}
    assert param == "body" or error["message"].startswith(param) or status == 415


def test_an_evaluation_event_becomes_feedback_with_a_verifier_once_and_a_bad_verifier_refuses_the_run(world):
    """The SDK exports an agent run whose agent span carries a gen_ai.evaluation.result event with
    flywheel's verifier attributes: the trace gets one user feedback that curation makes an RL
    task of; the same export again adds nothing; a verifier env curation does not trust refuses
    the run with the attribute named, and nothing of it is stored."""
    store = world["store"]
    memory = InMemorySpanExporter()
    tp = TracerProvider(resource=Resource.create({"service.name": "graded-agent"}))
    tp.add_span_processor(SimpleSpanProcessor(memory))
    tracer = tp.get_tracer("graded-agent")
    for env in ("calculator", "calculater"):
        with tracer.start_as_current_span("invoke_agent calc", attributes={
                "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "calc"}) as agent:
            chat_span(tracer, [part_text("user", f"What is 512 minus 38? ({env})")],
                      part_text("assistant", "516", finish_reason="stop"), (9, 2))
            agent.add_event("gen_ai.evaluation.result", {
                "gen_ai.evaluation.name": "exact_answer", "gen_ai.evaluation.score.value": 0.0,
                "gen_ai.evaluation.score.label": "wrong", "gen_ai.evaluation.explanation": "expected 474",
                "flywheel.verifier.env": env, "flywheel.verifier.task": json.dumps({"answer": "474"})})
    spans = memory.get_finished_spans()
    body = encode_spans(spans).SerializeToString()
    for attempt in range(2):
        r = world["a"].post("/otlp/v1/traces", content=body, headers={"content-type": "application/x-protobuf"})
        assert r.status_code == 200, r.text
        assert r.headers["x-flywheel-traces-added"] == ("1" if attempt == 0 else "0")
        assert r.headers["x-flywheel-feedback-stored"] == "1" and r.headers["x-flywheel-spans-rejected"] == "2"
        message = ExportTraceServiceResponse.FromString(r.content).partial_success.error_message
        assert "events[0]: flywheel.verifier.env: 'calculater' is neither a built-in environment" in message, message
    (trace,) = store.iter_traces(tenant="alpha", source="otlp:graded-agent")
    assert trace.messages == [{"role": "user", "content": "What is 512 minus 38? (calculator)"}]
    (fb,) = trace.feedback
    assert (fb.score, fb.label, fb.text, fb.source) == (0.0, "wrong", "exact_answer: expected 474", "user")
    assert (fb.verifier.env, fb.verifier.task) == ("calculator", {"answer": "474"})
