"""Tenants of the service cannot reach each other: every route and verb, called by tenant B with
tenant A's ids, answers as if the object did not exist (files, jobs, checkpoints, models,
webhooks, traces and their feedback, managed flywheels and their cycles); keys are hashed at rest,
a missing, unknown or revoked key is a 401, and a key past its rate gets a 429 with Retry-After."""

from __future__ import annotations

import io
import json
import os

import httpx
import pytest
from postgres_server import reset
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from sqlalchemy import text


from flywheel.jobs import JobStore
from flywheel.jobs.keys import Keys
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve.app import create_app
from flywheel.serve.auth import KeyAuth, RateLimited
from flywheel.serve.background import BackgroundServer
from flywheel.serve.core import OpenAIService
from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.worker.job_worker import JobWorker
from flywheel.serve.traces import TraceStoreSink
from flywheel.traces import TraceStore

ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


POSTGRES = os.environ.get("FLYWHEEL_TEST_POSTGRES_URL")


@pytest.fixture(scope="module", params=["sqlite", "postgresql"] if POSTGRES else ["sqlite"])
def world(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    base = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    url = data_file_url(root)
    if request.param == "postgresql":
        url = reset(POSTGRES)
    store = JobStore(url, root / "files")
    keys = Keys(store.engine)
    key_a, _ = keys.create("alpha")
    key_b, _ = keys.create("beta")
    auth = KeyAuth(keys, rate_per_s=1000, burst=1000, cache_s=0)
    traces = TraceStore(url)  # the job store's database: the stores share one
    service = OpenAIService(base, name="tiny", default_max_tokens=4, trace_sink=TraceStoreSink(traces))
    fine_tuning = FineTuning(store, {"tiny": base})
    srv = BackgroundServer(create_app(service, fine_tuning=fine_tuning, tenant_of=auth, trace_store=traces)).start()
    a = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key_a}"}, timeout=60)
    b = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key_b}"}, timeout=60)
    up = a.post("/v1/files", files={"file": ("t.jsonl", io.BytesIO(json.dumps(ROW).encode() + b"\n"))},
                data={"purpose": "fine-tune"})
    assert up.status_code == 200, up.text
    file_id = up.json()["id"]
    job = a.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": file_id, "suffix": "a",
                                               "method": {"type": "supervised", "supervised": {
                                                   "hyperparameters": {"n_epochs": 2, "batch_size": 1}}}}).json()
    assert fine_tuning.validator.wait(60)  # its files checked: queued
    JobWorker(store, {"tiny": base}, root / "jobs", heartbeat_s=0.2, threads=1, log=lambda m: None).run_one()
    done = a.get(f"/v1/fine_tuning/jobs/{job['id']}").json()
    assert done["status"] == "succeeded", done
    checkpoint = a.get(f"/v1/fine_tuning/jobs/{job['id']}/checkpoints").json()["data"][-1]
    flywheel = a.post("/v1/flywheels", json={"model": "tiny", "suffix": "a"})
    assert flywheel.status_code == 200, flywheel.text
    yield dict(a=a, b=b, srv=srv, keys=keys, store=store, root=root, file=file_id, job=job["id"],
               flywheel=flywheel.json()["id"], alias=flywheel.json()["production_model"],
               model=done["fine_tuned_model"], checkpoint=checkpoint["fine_tuned_model_checkpoint"],
               key_a=key_a, traces=traces, sink=service.trace_sink)
    a.close()
    b.close()
    srv.stop()
    service.close()
    traces.close()
    store.close()


ROUTES = [("GET", "/v1/files/{file}"), ("GET", "/v1/files/{file}/content"), ("DELETE", "/v1/files/{file}"),
          ("GET", "/v1/fine_tuning/jobs/{job}"), ("POST", "/v1/fine_tuning/jobs/{job}/cancel"),
          ("POST", "/v1/fine_tuning/jobs/{job}/pause"), ("POST", "/v1/fine_tuning/jobs/{job}/resume"),
          ("GET", "/v1/fine_tuning/jobs/{job}/events"), ("GET", "/v1/fine_tuning/jobs/{job}/checkpoints"),
          ("GET", "/v1/flywheels/{flywheel}"), ("GET", "/v1/flywheels/{flywheel}/cycles"),
          ("POST", "/v1/flywheels/{flywheel}/cycles"), ("POST", "/v1/flywheels/{flywheel}/rollback")]


@pytest.mark.parametrize("method, route", ROUTES)
def test_another_tenants_ids_are_not_found(world, method, route):
    path = route.format(file=world["file"], job=world["job"], flywheel=world["flywheel"])
    r = world["b"].request(method, path)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", (method, path, r.text)
    assert world["a"].request("GET", path if method == "GET" else path.rsplit("/", 1)[0]).status_code == 200


@pytest.mark.parametrize("method, route", [("GET", "/v1/models/{model}/content"), ("DELETE", "/v1/models/{model}"),
                                           ("GET", "/v1/models/{checkpoint}/content"),
                                           ("DELETE", "/v1/webhooks/{webhook}")])
def test_another_tenants_models_and_webhooks_are_not_found(world, method, route):
    if "webhook_id" not in world:
        world["webhook_id"] = world["a"].post("/v1/webhooks", json={"url": "http://127.0.0.1:9/x"}).json()["id"]
    path = route.format(model=world["model"], checkpoint=world["checkpoint"], webhook=world["webhook_id"])
    r = world["b"].request(method, path)
    assert r.status_code == 404, (method, path, r.text)
    assert world["webhook_id"] in [w["id"] for w in world["a"].get("/v1/webhooks").json()["data"]]
    assert world["b"].get("/v1/webhooks").json()["data"] == []
    assert world["a"].get(f"/v1/models/{world['model']}/content").status_code == 200  # still there for its owner


def test_listings_and_models_show_only_the_callers_objects(world):
    a, b = world["a"], world["b"]
    for path in ("/v1/files", "/v1/fine_tuning/jobs", "/v1/flywheels"):
        assert [x["id"] for x in b.get(path).json()["data"]] == []
        assert len(a.get(path).json()["data"]) == 1
    assert world["model"] in [m["id"] for m in a.get("/v1/models").json()["data"]]
    assert world["model"] not in [m["id"] for m in b.get("/v1/models").json()["data"]]
    r = b.get("/v1/fine_tuning/jobs", params={"after": world["job"]})
    assert r.status_code == 404  # another tenant's id is no cursor either


def test_another_tenants_fine_tuned_model_and_checkpoints_cannot_be_used(world):
    for model in (world["model"], world["checkpoint"]):
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = world["b"].post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", r.text
        assert world["a"].post("/v1/chat/completions", json=chat).status_code == 200
        r = world["b"].post("/v1/fine_tuning/jobs", json={"model": model, "training_file": world["file"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_another_tenants_flywheel_alias_cannot_be_called_nor_fed(world):
    from flywheel.traces.scope import ScopedTraces, TraceScope

    a, b, alias = world["a"], world["b"], world["alias"]
    chat = {"model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = b.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found", r.text
    assert a.post("/v1/chat/completions", json=chat).status_code == 200
    # B's traces naming A's alias are B's: A's flywheel never reads them
    posted = b.post("/v1/traces", json=[{"model": alias, "messages": [{"role": "user", "content": "q"}],
                                          "response": {"role": "assistant", "content": "a"}}])
    assert posted.status_code == 200 and posted.json()["added"] == 1
    assert world["sink"].flush()
    scoped = ScopedTraces(world["traces"], TraceScope("alpha", (alias,)))
    assert [t.tenant for t in scoped.iter_traces()] == ["alpha"]  # A's own call, not B's post
    # nor can B's flywheel evaluate on A's file
    grader = {"type": "string_check", "name": "s", "input": "{{ sample.output_text }}", "reference": "x",
              "operation": "eq"}
    stolen = b.post("/v1/flywheels", json={"model": "tiny", "suffix": "steal", "eval": {"suites": {
        "s": {"file": world["file"], "grader": grader}}}})
    assert stolen.status_code == 404 and stolen.json()["error"]["param"] == "eval.suites.s.file", stolen.text
    # B may run a flywheel of the same model and suffix: its alias is its own
    own = b.post("/v1/flywheels", json={"model": "tiny", "suffix": "a"})
    assert own.status_code == 200 and own.json()["production_model"] != alias


def test_another_tenants_file_cannot_train_a_job(world):
    r = world["b"].post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": world["file"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "training_file"


def test_keys_are_required_hashed_and_revocable(world):
    url = world["srv"].url
    for headers in ({}, {"authorization": "Bearer fw-not-a-key"}, {"authorization": "Basic abc"}):
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/files"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/fine_tuning/jobs")):
            r = httpx.request(method, url + path, headers=headers, json={})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (headers, path, r.text)
            assert "fw-not-a-key" not in r.text
    assert httpx.get(url + "/health").status_code == 200
    with world["store"].engine.connect() as conn:
        stored = " ".join(str(v) for row in conn.execute(text("select * from api_keys")) for v in row)
    assert world["key_a"] not in stored and world["key_a"][:8] in stored  # the hash and a prefix, never the key
    key, row = world["keys"].create("alpha", name="temporary")
    assert httpx.get(url + "/v1/files", headers={"authorization": f"Bearer {key}"}).status_code == 200
    world["keys"].revoke(row["id"])
    assert httpx.get(url + "/v1/files", headers={"authorization": f"Bearer {key}"}).status_code == 401


def test_a_key_past_its_rate_gets_429_with_retry_after(tmp_path):
    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    keys = Keys(store.engine)
    key, _ = keys.create("gamma")
    now = [0.0]
    auth = KeyAuth(keys, rate_per_s=1.0, burst=2, clock=lambda: now[0])
    app = FastAPI()

    @app.exception_handler(RateLimited)
    async def handler(request, exc):
        return JSONResponse(exc.body(), status_code=exc.status, headers={"retry-after": str(exc.retry_after_s)})

    @app.get("/x")
    async def x(request: Request):
        return {"tenant": auth(request)}

    client = TestClient(app, raise_server_exceptions=False)
    h = {"authorization": f"Bearer {key}"}
    assert [client.get("/x", headers=h).status_code for _ in range(2)] == [200, 200]
    r = client.get("/x", headers=h)
    assert r.status_code == 429 and r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
    now[0] = 1.0
    assert client.get("/x", headers=h).json() == {"tenant": "gamma"}
    store.close()


def test_the_keys_commands_and_an_open_server_refused(tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli.main import app

    run = CliRunner().invoke
    made = run(app, ["keys", "create", "--tenant", "acme", "--data-dir", str(tmp_path)])
    assert made.exit_code == 0, made.output
    key = made.output.split()[0]
    assert key.startswith("fw-") and "cannot be shown again" in made.output
    listed = run(app, ["keys", "list", "--data-dir", str(tmp_path / "other")])
    assert listed.exit_code == 0 and listed.output == ""
    listed = run(app, ["keys", "list", "--data-dir", str(tmp_path)]).output
    assert "acme" in listed and key[:8] in listed and key not in listed
    key_id = listed.split()[0]
    assert run(app, ["keys", "revoke", key_id, "--data-dir", str(tmp_path)]).exit_code == 0
    assert "revoked" in run(app, ["keys", "list", "--data-dir", str(tmp_path)]).output
    again = run(app, ["keys", "revoke", key_id, "--data-dir", str(tmp_path)])
    assert again.exit_code == 2 and "no active key" in again.output

    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    fresh = tmp_path / "fresh"
    served = run(app, ["serve", "--model", str(base), "--fine-tuning", "--data-dir", str(fresh), "--host", "0.0.0.0",
                       "--no-traces"])
    assert served.exit_code == 2 and "no API keys exist" in served.output


def test_keys_and_file_contents_stay_out_of_the_logs(tmp_path, caplog):
    """Every logger at DEBUG while a keyed client uploads a file, trains nothing and is refused
    once: neither the key nor a byte of the file's content appears in any record."""
    import logging

    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    keys = Keys(store.engine)
    key, _ = keys.create("secretive")
    service = OpenAIService(base, name="tiny", default_max_tokens=2)
    app = create_app(service, fine_tuning=FineTuning(store, {"tiny": base}), tenant_of=KeyAuth(keys))
    marker = "CONFIDENTIAL-ROW-CONTENT-7f3a"
    row = {"messages": [{"role": "user", "content": marker}, {"role": "assistant", "content": marker}]}
    with caplog.at_level(logging.DEBUG), BackgroundServer(app, log_level="debug") as srv:
        before = {name: logging.getLogger(name).propagate for name in ("uvicorn", "uvicorn.access", "uvicorn.error")}
        for name in before:
            logging.getLogger(name).propagate = True  # uvicorn's own config keeps them from the root logger
        h = {"authorization": f"Bearer {key}"}
        up = httpx.post(srv.url + "/v1/files", headers=h, files={"file": ("t.jsonl", json.dumps(row).encode() + b"\n")},
                        data={"purpose": "fine-tune"})
        assert up.status_code == 200
        httpx.post(srv.url + "/v1/fine_tuning/jobs", headers=h, json={"model": "tiny", "training_file": up.json()["id"]})
        httpx.get(srv.url + "/v1/files", headers={"authorization": f"Bearer {key}x"})  # a wrong key, refused
        httpx.post(srv.url + "/v1/chat/completions", headers=h,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for name, value in before.items():
        logging.getLogger(name).propagate = value
    logged = "\n".join(f"{r.name} {r.getMessage()}" for r in caplog.records)
    assert logged, "nothing was logged: the check would be empty"
    assert {"uvicorn.access", "httpx"} <= {r.name for r in caplog.records}  # the server's records are in it too
    assert key not in logged and key[3:20] not in logged and marker not in logged
    service.close()
    store.close()


def test_traces_and_their_feedback_belong_to_the_caller(world):
    a, b, traces = world["a"], world["b"], world["traces"]
    for model in ("tiny", world["model"]):  # the base model and A's fine-tuned one
        chat = a.post("/v1/chat/completions", json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        trace_id = chat.json()["id"]
        assert world["sink"].flush() and traces.get(trace_id).tenant == "alpha"
        refused = b.post(f"/v1/traces/{trace_id}/feedback", json={"score": 0.0})
        assert refused.status_code == 404 and refused.json()["error"]["param"] == "trace_id", refused.text
        assert a.post(f"/v1/traces/{trace_id}/feedback", json={"score": 1.0}).status_code == 200
        assert [f.score for f in traces.get(trace_id).feedback] == [1.0]  # B's never landed
    record = {"messages": [{"role": "user", "content": "q"}], "response": {"role": "assistant", "content": "a"},
              "idempotency_key": "batch-1"}
    first = a.post("/v1/traces", json=[record]).json()["results"][0]
    assert first["status"] == "added"
    # the same key from B is B's own trace, not a duplicate that would hand B the id of A's
    other = b.post("/v1/traces", json=[record]).json()["results"][0]
    assert other["status"] == "added" and other["id"] != first["id"]
    assert traces.get(other["id"], tenant="beta").tenant == "beta"
    # an id A holds is refused to B without a word about A's trace
    taken = b.post("/v1/traces", json=[{**record, "id": first["id"], "idempotency_key": "b-2"}]).json()["results"][0]
    assert taken["status"] == "conflict" and "batch-1" not in taken["reason"]
    fb = {"score": 0.5, "idempotency_key": "fb-1"}
    assert a.post(f"/v1/traces/{first['id']}/feedback", json=fb).status_code == 200
    assert b.post(f"/v1/traces/{other['id']}/feedback", json=fb).status_code == 200  # B's key space is its own
    beta = [t.id for t in traces.iter_traces(tenant="beta") if t.model != world["alias"]]  # that one: B's alias test
    assert beta == [other["id"]]  # the module's other tests are A's
