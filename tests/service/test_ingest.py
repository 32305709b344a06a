"""POST /v1/traces and feedback over HTTP: mixed batches, retries, outcomes, bad requests."""

import pytest
from fastapi.testclient import TestClient

from flywheel.loop import TraceStore
from flywheel.models import TinySpec, build_tiny_model
from flywheel.service import OpenAIService
from flywheel.service.app import create_app


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("ingest")
    model = build_tiny_model(root / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    service = OpenAIService(str(model), version="v1")
    store = TraceStore(f"sqlite:///{root / 'traces.db'}")
    with TestClient(create_app(service, trace_store=store)) as c:
        yield c, store
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
                                                          "verifier": {"env": "arithmetic", "task": {"prompt": "10+1="}}})
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
