"""GET /openapi.json of a running server: every route documents its body and its answers
(OpenAI's error shape for every 4xx and 5xx), the served curation rules are in it, the
server's real answers match their schemas, and the trace and feedback routes accept what
their schemas allow and refuse what they do not, by hand and in a short schemathesis run."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis.checks import positive_data_acceptance

from flywheel.envs import load_env
from flywheel.envs.verifier_task import verifier_task_example
from flywheel.loop.curation_rules import CurationConfig
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve import OpenAIService
from flywheel.serve.app import create_app
from flywheel.serve.background import BackgroundServer
from flywheel.serve.traces import TraceStoreSink
from flywheel.traces import TraceStore

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CURATION = CurationConfig(failure_labels=["bad", "Regression"], success_labels=["good"],
                          environments=["examples.custom_env:load"])
ERROR = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
# What JSON Schema cannot say, the refusals of a schema-valid body allowed: the store keeps
# integers of at most 64 bits (in a free-form value too: metadata, a task payload), and keeps
# records as sent, so an integer field refuses 1.0 (a JSON Schema "integer"); and it stores
# times as UTC, so a date-time whose offset puts it before year 1 in UTC is refused (the
# `date-time` format has no bound)
INEXPRESSIBLE = ("exceeds 64-bit range", "input should be a valid integer", "out of range once converted to UTC")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(app, client): a server that records its responses as traces and takes feedback."""
    root = tmp_path_factory.mktemp("openapi")
    model = build_tiny_model(root / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    store = TraceStore(f"sqlite:///{root / 'traces.db'}")
    sink = TraceStoreSink(store)
    service = OpenAIService(str(model), version="v1", trace_sink=sink)
    app = create_app(service, trace_store=store, curation=CURATION)
    srv = BackgroundServer(app).start()
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield app, client
    srv.stop()
    sink.close()
    service.close()
    store.close()


@pytest.fixture(scope="module")
def doc(server):
    r = server[1].get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def schema_of(doc, name: str) -> jsonschema_rs.Draft202012Validator:
    """A validator of component `name` (its references resolved in the document)."""
    return jsonschema_rs.Draft202012Validator({"components": doc["components"],
                                               "$ref": f"#/components/schemas/{name}"})


def refs(node):
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for v in node.values():
            yield from refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from refs(v)


def test_every_route_documents_its_body_and_its_answers(doc):
    """Every route FastAPI documents (all but those hidden with include_in_schema=False), so a
    route added without `route_doc` fails here."""
    routes = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert routes == {("get", "/health"), ("get", "/v1/models"), ("post", "/v1/chat/completions"),
                      ("post", "/v1/completions"), ("post", "/v1/traces"), ("post", "/v1/traces/{trace_id}/feedback"),
                      ("post", "/otlp/v1/traces")}
    schemas = doc["components"]["schemas"]
    assert {r.removeprefix("#/components/schemas/") for r in refs(doc)} <= set(schemas)  # every reference resolves
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            where, answers = f"{method.upper()} {path}", op["responses"]
            assert "$ref" in answers["200"]["content"]["application/json"]["schema"], where
            errors = {s: a for s, a in answers.items() if s[0] in "45"}
            assert all(a["content"] == ERROR for a in errors.values()), where  # OpenAI's shape, never FastAPI's 422
            if method == "post":
                body = op["requestBody"]
                assert body["required"] and "$ref" in body["content"]["application/json"]["schema"], where
                assert "400" in errors, where
    streamed = {p for p, ops in doc["paths"].items() if "text/event-stream" in ops.get("post", {})
                .get("responses", {}).get("200", {}).get("content", {})}
    assert streamed == {"/v1/chat/completions", "/v1/completions"}
    error = schemas["ErrorDetail"]
    assert set(error["required"]) == set(error["properties"]) == {"message", "type", "param", "code"}


def test_the_feedback_route_states_the_trace_id_and_the_served_rules(doc):
    op = doc["paths"]["/v1/traces/{trace_id}/feedback"]["post"]
    assert "`<id>-<i>` (choice i > 0)" in op["parameters"][0]["description"]
    schemas = doc["components"]["schemas"]
    assert "choice i > 0 as `<id>-<i>`" in schemas["ChatCompletion"]["properties"]["id"]["description"]
    label = schemas["FeedbackIn"]["properties"]["label"]
    assert label["anyOf"][0]["enum"] == ["bad", "good", "regression"]
    assert "Failure labels" in label["description"] and "bad, Regression" in label["description"]
    env = schemas["Verifier"]["properties"]["env"]["enum"]
    assert "examples.custom_env:load" in env and "calculator" in env and "replay" not in env
    assert schemas["Task"]["required"] == ["answer"]


def events(r: httpx.Response) -> list:
    lines = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_real_answers_match_their_documented_schemas(server, doc):
    _, c = server
    chat = {"model": "flywheel", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    answers = [
        ("Health", c.get("/health")), ("ModelList", c.get("/v1/models")),
        ("ChatCompletion", c.post("/v1/chat/completions", json={**chat, "n": 2, "logprobs": True, "top_logprobs": 2})),
        ("TextCompletion", c.post("/v1/completions", json={"model": "flywheel", "prompt": ["1+1=", "2+2="],
                                                          "max_tokens": 3, "logprobs": 0})),
        ("ErrorResponse", c.post("/v1/chat/completions", json={**chat, "messages": []})),
        ("ErrorResponse", c.post("/v1/traces/no-such-trace/feedback", json={"score": 1.0})),
    ]
    for name, r in answers:
        assert r.headers["content-type"] == "application/json", (name, r.text)
        errors = [e.message for e in schema_of(doc, name).iter_errors(r.json())]
        assert not errors, (name, r.json(), errors)
    streams = [("ChatCompletionChunk", c.post("/v1/chat/completions", json={
                   **chat, "stream": True, "logprobs": True, "stream_options": {"include_usage": True}})),
               ("TextCompletionChunk", c.post("/v1/completions", json={
                   "model": "flywheel", "prompt": "1+1=", "max_tokens": 3, "stream": True}))]
    for name, r in streams:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = events(r)
        assert len(chunks) >= 2 and all(schema_of(doc, name).is_valid(x) for x in chunks), chunks


def test_feedback_goes_to_the_response_id_and_choice_i_to_id_dash_i(server, doc):
    _, c = server
    r = c.post("/v1/chat/completions", json={"model": "flywheel", "messages": [{"role": "user", "content": "2+2="}],
                                             "n": 2, "max_tokens": 3})
    rid = r.json()["id"]
    for trace_id in (rid, f"{rid}-1"):  # read-your-writes: accepted at once
        fb = c.post(f"/v1/traces/{trace_id}/feedback", json={"label": "regression"})
        assert fb.status_code == 200 and schema_of(doc, "FeedbackResult").is_valid(fb.json()), fb.text
    assert c.post(f"/v1/traces/{rid}-2/feedback", json={"label": "good"}).status_code == 404


def test_schema_valid_bodies_are_accepted_and_invalid_ones_refused(server, doc):
    _, c = server
    record = {"messages": [{"role": "user", "content": "hi"}], "response": {"role": "assistant", "content": "hello"}}
    batches = schema_of(doc, "TraceBatch")
    for body in ([record], {"traces": [record]}):
        assert batches.is_valid(body)
        r = c.post("/v1/traces", json=body)
        assert r.status_code == 200 and r.json()["results"][0]["status"] == "added", r.text
    for body in ({"records": [record]}, 3):
        assert not batches.is_valid(body)
        r = c.post("/v1/traces", json=body)
        assert r.status_code == 400 and schema_of(doc, "ErrorResponse").is_valid(r.json())
    # records are judged alone: an invalid one comes back `invalid`, beside the valid ones
    r = c.post("/v1/traces", json=[record, {"messages": [{"role": "robot", "content": "x"}]}])
    assert [x["status"] for x in r.json()["results"]] == ["added", "invalid"]
    trace_id = r.json()["results"][0]["id"]

    feedback = schema_of(doc, "FeedbackIn")
    calculator, arithmetic = (verifier_task_example(load_env(n)) for n in ("calculator", "arithmetic"))
    cases = [  # (body, the param a 400 names; None: accepted)
        ({"label": "regression", "verifier": {"env": "calculator", "task": calculator}}, None),
        ({"score": 0.0, "text": "off by one", "verifier": {"env": "arithmetic", "task": arithmetic}}, None),
        ({"correction": {"role": "assistant", "content": "4"}, "idempotency_key": uuid.uuid4().hex}, None),
        ({"label": "meh"}, "label"),
        ({}, "body"),
        ({"score": None}, "body"),
        ({"score": "high"}, "body"),
        ({"correction": {"role": "user", "content": "4"}}, "body"),
        ({"correction": {"role": "assistant"}}, "body"),
        ({"verifier": {"env": "replay", "task": arithmetic}}, "verifier.env"),
        ({"verifier": {"env": "arithmetic", "task": {"prompt": "1+1="}}}, "verifier.task.answer"),
        ({"verifier": {"env": "arithmetic", "task": {**arithmetic, "colour": "red"}}}, "verifier.task"),
    ]
    for body, param in cases:
        r = c.post(f"/v1/traces/{trace_id}/feedback", json=body)
        assert feedback.is_valid(body) == (param is None), body
        assert r.status_code == (200 if param is None else 400), (body, r.text)
        assert param is None or r.json()["error"]["param"] == param, (body, r.text)
    assert "bad, good, regression" in c.post(f"/v1/traces/{trace_id}/feedback", json={"label": "meh"}).text
    # the schema lists the labels as they are best sent; the server matches them stripped, in any case
    assert not feedback.is_valid({"label": " Regression"})
    assert c.post(f"/v1/traces/{trace_id}/feedback", json={"label": " Regression"}).status_code == 200


def test_schemathesis_finds_no_gap_between_the_schema_and_the_trace_routes(server, doc):
    """Schema-valid bodies (generated) are accepted and answered as documented. Negative cases
    are left out: a batch judges its records alone (an invalid record is a 200), and the
    hand-written cases above cover feedback."""
    _, c = server
    schema = schemathesis.openapi.from_dict(doc)
    base_url = str(c.base_url)
    trace_id = c.post("/v1/traces", json=[{"messages": [{"role": "user", "content": "x"}]}]).json()["results"][0]["id"]

    def fresh_keys(body):  # generated ids and keys repeat; a repeat with other content is a documented 400
        for record in (body if isinstance(body, list) else body.get("traces", [body]) if isinstance(body, dict) else []):
            for key in ("id", "idempotency_key"):
                if isinstance(record, dict) and record.get(key) is not None:
                    record[key] = uuid.uuid4().hex

    def run(path: str, examples: int) -> None:
        @given(case=schema[path]["POST"].as_strategy())
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)  # the same cases in every run
        def check(case):
            if case.path_parameters:
                case.path_parameters["trace_id"] = trace_id
            fresh_keys(case.body)
            r = case.call(base_url=base_url)
            case.validate_response(r, excluded_checks=[positive_data_acceptance])  # checked here instead:
            if r.status_code != 200:
                assert any(x in r.json()["error"]["message"] for x in INEXPRESSIBLE), r.text
            for result in r.json().get("results", []):
                assert result["status"] == "added" or any(x in result["reason"] for x in INEXPRESSIBLE), result

        check()

    run("/v1/traces/{trace_id}/feedback", 25)
    run("/v1/traces", 5)  # traces are large to generate: a few
