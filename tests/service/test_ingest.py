"""POST /v1/traces and feedback over HTTP: mixed batches, retries, outcomes, bad requests."""

import json

import pytest
from fastapi.testclient import TestClient

from flywheel.traces import TraceStore
from flywheel.traces.encoding import NotJSON, decode_json
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve import OpenAIService
from flywheel.serve.app import create_app
from flywheel.serve.ingest_pool import IngestPool


@pytest.fixture(scope="module", params=[0, 2], ids=["in-server", "2-workers"])
def client(request, tmp_path_factory):
    """The app with batches prepared in a thread of the server, and in 2 worker processes
    (every body, however small, goes to a worker)."""
    root = tmp_path_factory.mktemp("ingest")
    model = build_tiny_model(root / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    service = OpenAIService(str(model), version="v1")
    store = TraceStore(f"sqlite:///{root / 'traces.db'}")
    pool = IngestPool(request.param, inline_bytes=0)
    with TestClient(create_app(service, trace_store=store, ingest_pool=pool)) as c:
        yield c, store
    assert pool.offloaded > 0 if request.param else pool.offloaded == 0
    service.close()
    store.close()


def trace(i, **extra):
    return {"idempotency_key": f"k{i}", "messages": [{"role": "user", "content": f"{i}+1="}],
            "response": {"role": "assistant", "content": str(i + 1)}, **extra}


def test_a_mixed_batch_keeps_the_valid_records_and_names_the_bad_ones(client):
    c, store = client
    before = store.count()
    batch = [trace(1), {"messages": [{"role": "robot", "content": "x"}]}, trace(2), {"no": "messages"}]
    r = c.post("/v1/traces", json={"traces": batch})
    assert r.status_code == 200
    body = r.json()
    assert (body["added"], body["rejected"]) == (2, 2)
    statuses = [x["status"] for x in body["results"]]
    assert statuses == ["added", "invalid", "added", "invalid"]
    assert "messages[0].role" in body["results"][1]["reason"]
    assert store.count() == before + 2
    again = c.post("/v1/traces", json=[trace(1), trace(2)]).json()  # a retry is a no-op
    assert (again["added"], again["duplicates"]) == (0, 2) and store.count() == before + 2


def test_feedback_arrives_later_and_bad_feedback_is_refused(client):
    c, store = client
    trace_id = c.post("/v1/traces", json=[trace(10)]).json()["results"][0]["id"]
    ok = c.post(f"/v1/traces/{trace_id}/feedback", json={"score": 0.0, "label": "wrong",
                                                          "verifier": {"env": "arithmetic", "task": {"prompt": "10+1=", "answer": "11"}}})
    assert ok.status_code == 200 and ok.json()["id"]
    assert len(store.get(trace_id).feedback) == 1
    missing = c.post("/v1/traces/no-such-trace/feedback", json={"score": 1.0})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    empty = c.post(f"/v1/traces/{trace_id}/feedback", json={})
    assert empty.status_code == 400 and empty.json()["error"]["message"]


def test_bodies_that_are_not_batches_are_clear_errors(client):
    c, _ = client
    r = c.post("/v1/traces", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = c.post("/v1/traces", json={"records": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "traces"
    r = c.post("/v1/traces", content=b"[" * 100_000 + b"]" * 100_000)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]


def test_records_the_fast_json_decoder_would_change_are_judged_as_the_stdlib_reads_them(client):
    """orjson reads NaN as an error and integers beyond 64 bits as floats: such bodies are
    decoded by the stdlib instead, so each record is still judged on what it holds."""
    c, store = client
    nan = (b'[' + json.dumps(trace(30)).encode()
           + b', {"messages": [{"role": "user", "content": "x"}], "latency_ms": NaN}]')
    r = c.post("/v1/traces", content=nan)
    assert r.status_code == 200
    assert [x["status"] for x in r.json()["results"]] == ["added", "invalid"]
    assert "latency_ms" in r.json()["results"][1]["reason"]
    big = [trace(31, metadata={"n": 123456789012345678901234567890}),
           trace(32, metadata={"id": "12345678901234567890123"})]  # 20 digits in a string: decoded alike
    body = c.post("/v1/traces", content=json.dumps(big).encode()).json()
    assert [x["status"] for x in body["results"]] == ["invalid", "added"]
    assert "not JSON" in body["results"][0]["reason"]
    assert store.get(body["results"][1]["id"]).metadata == {"id": "12345678901234567890123"}


@pytest.mark.parametrize("raw", [b'{"a": [1, 2.5, "\\u00e9", null, true]}', b'[1e999, -0.0]', b'["\\ud800"]',
                                 b'[18446744073709551615, 18446744073709551616]', b'"x"'])
def test_decode_json_gives_what_the_stdlib_gives(raw):
    assert repr(decode_json(raw)) == repr(json.loads(raw))
    with pytest.raises(NotJSON, match="not valid JSON"):
        decode_json(b'{"a": ')


def test_a_large_mixed_batch_reports_every_rejection_and_reads_back(client):
    c, store = client
    batch, bad = [], {}
    for i in range(300):
        if i % 37 == 5:
            usage = {"prompt_tokens": "12", "completion_tokens": 1}  # a string count: strict fields refuse it
            batch.append({"messages": [{"role": "user", "content": "q"}], "usage": usage})
            bad[i] = "usage.prompt_tokens"
        elif i % 53 == 7:
            batch.append({"idempotency_key": f"big{i}", "messages": []})
            bad[i] = "messages"
        else:
            batch.append(trace(1000 + i, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]))
    body = c.post("/v1/traces", json={"traces": batch}).json()
    assert body["added"] == 300 - len(bad) and body["rejected"] == len(bad)
    for row in body["results"]:
        if row["index"] in bad:
            assert row["status"] == "invalid" and bad[row["index"]] in row["reason"] and row["id"] is None
        else:
            assert row["status"] == "added"
            stored = store.get(row["id"])
            assert stored.messages == batch[row["index"]]["messages"] and stored.tools == batch[row["index"]]["tools"]
    again = c.post("/v1/traces", json={"traces": batch}).json()  # the retry: every valid one a duplicate, same ids
    assert again["duplicates"] == 300 - len(bad) and again["added"] == 0
    assert [x["id"] for x in again["results"]] == [x["id"] for x in body["results"]]


@pytest.mark.parametrize("n", [100, pytest.param(1000, marks=pytest.mark.slow)])  # 1,000: make test-all
def test_feedback_sent_right_after_each_response_is_always_accepted(tmp_path, n):
    """Read-your-writes: served traces are written in the background (here every 0.2 s, the
    default), yet feedback sent the moment a response returns never gets a 404."""
    from flywheel.serve import TraceStoreSink

    model = build_tiny_model(tmp_path / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    store = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    sink = TraceStoreSink(store, interval_s=0.2)
    service = OpenAIService(str(model), version="v1", trace_sink=sink, window_s=0.0)  # one client: no batching wait
    errors = []
    with TestClient(create_app(service, trace_store=store)) as c:
        for i in range(n):
            response = c.post("/v1/chat/completions", json={
                "model": "flywheel", "messages": [{"role": "user", "content": f"{i}+1="}], "max_tokens": 1})
            assert response.status_code == 200, response.text
            feedback = c.post(f"/v1/traces/{response.json()['id']}/feedback", json={"score": 0.0, "label": "wrong"})
            if feedback.status_code != 200:
                errors.append((i, feedback.status_code, feedback.text))
        missing = c.post("/v1/traces/never-served/feedback", json={"score": 1.0})  # still a 404, promptly
    service.close()
    assert errors == []
    assert missing.status_code == 404 and store.count() == n
    store.close()


def test_feedback_curation_could_not_use_is_refused_with_the_field(client):
    c, store = client
    trace_id = c.post("/v1/traces", json=[trace(900)]).json()["results"][0]["id"]
    for body, param in [({"label": "thumbs-down"}, "label"),
                        ({"verifier": {"env": "nope", "task": {"prompt": "1+1=", "answer": "2"}}}, "verifier.env"),
                        ({"verifier": {"env": "arithmetic", "task": {"prompt": "1+1="}}}, "verifier.task.answer")]:
        r = c.post(f"/v1/traces/{trace_id}/feedback", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert store.get(trace_id).feedback == []  # nothing stored
