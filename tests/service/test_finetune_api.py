"""The fine-tuning API through the official `openai` client against a real server on loopback,
with a real worker training the tiny model: files, supervised and DPO jobs to `succeeded`,
events, checkpoints, chatting with the fine-tuned model and its checkpoints, and the refusals."""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path

import httpx
import openai
import peft
import pytest
import torch
from fastapi import FastAPI, Request

from flywheel.jobs import JobStore
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve.app import create_app
from flywheel.serve.background import BackgroundServer
from flywheel.serve.core import OpenAIService
from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.worker.job_worker import JobWorker

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    base = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    store = JobStore(data_file_url(root), root / "files")
    ft = FineTuning(store, {"tiny": base})
    service = OpenAIService(base, name="tiny", default_max_tokens=8)
    srv = BackgroundServer(create_app(service, fine_tuning=ft)).start()
    worker = JobWorker(store, {"tiny": base}, root / "work", heartbeat_s=0.2, threads=1, log=lambda m: None)
    thread = threading.Thread(target=worker.run, kwargs={"idle_s": 0.1}, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client, srv, store
    worker.stopping.set()
    thread.join(60)
    srv.stop()
    service.close()
    store.close()


def upload(client, rows, name="train.jsonl"):
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    return client.files.create(file=(name, io.BytesIO(data)), purpose="fine-tune")


def wait(client, job_id, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in TERMINAL:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} did not finish in {timeout} s: {job.status}")


def checked(client, job):
    """The job once its files are checked (create answers at once: in validating_files, unless
    a small file's check was done by then)."""
    deadline = time.monotonic() + 60
    while job.status == "validating_files" and time.monotonic() < deadline:
        time.sleep(0.05)
        job = client.fine_tuning.jobs.retrieve(job.id)
    return job


def chat_row(question, answer):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_a_supervised_job_from_upload_to_chat(api):
    client, srv, _ = api
    f = upload(client, [chat_row(f"What is {i} + 1?", str(i + 1)) for i in range(16)])
    assert (f.object, f.purpose, f.filename) == ("file", "fine-tune", "train.jsonl")
    assert client.files.content(f.id).content.decode().count("\n") == 16
    job = client.fine_tuning.jobs.create(
        model="tiny", training_file=f.id, suffix="add", seed=3,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}})
    job = checked(client, job)
    assert job.status in ("queued", "running")
    assert job.hyperparameters.n_epochs == 2 and job.hyperparameters.learning_rate_multiplier == 1.0
    job = wait(client, job.id)
    assert job.status == "succeeded", job.error
    assert job.fine_tuned_model.startswith("ft:tiny:default:add:") and job.trained_tokens > 0
    events = list(client.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = [e for e in events if e.type == "metrics"]
    assert metrics and metrics[0].data["step"] == 8 and metrics[0].data["total_steps"] == 8
    assert events[0].message.startswith("The job has successfully completed")
    checkpoints = list(client.fine_tuning.jobs.checkpoints.list(job.id))
    assert [c.step_number for c in checkpoints] == [8, 4]  # one per epoch, newest first
    assert checkpoints[0].metrics.train_loss > 0
    models = [m.id for m in client.models.list()]
    assert "tiny" in models and job.fine_tuned_model in models
    for model in (job.fine_tuned_model, checkpoints[1].fine_tuned_model_checkpoint):
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What is 3 + 1?"}],
                                               max_tokens=4)
        assert reply.model == model and reply.choices[0].message.content is not None
    # both are LoRA adapters served by the base model's engine, side by side with it: no model copy
    pool = srv.server.config.app.state.service.engine.adapters
    served = {f"default/{job.fine_tuned_model}", f"default/{checkpoints[1].fine_tuned_model_checkpoint}"}
    assert served <= set(pool.names)
    assert client.fine_tuning.jobs.list(limit=1).data[0].id == job.id


@pytest.mark.slow  # two more jobs; make test stays under four minutes
def test_a_lora_checkpoint_continues_as_a_new_job_and_serves_on_the_base(api):
    client, srv, _ = api
    f = upload(client, [chat_row(f"{i} + 2?", str(i + 2)) for i in range(4)])
    first = wait(client, client.fine_tuning.jobs.create(model="tiny", training_file=f.id, suffix="one", method={
        "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 2}}}).id)
    checkpoint = client.fine_tuning.jobs.checkpoints.list(first.id).data[-1].fine_tuned_model_checkpoint
    second = wait(client, client.fine_tuning.jobs.create(model=checkpoint, training_file=f.id, suffix="two", method={
        "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}}).id)
    assert second.status == "succeeded", second.error
    reply = client.chat.completions.create(model=second.fine_tuned_model, max_tokens=2,
                                           messages=[{"role": "user", "content": "1 + 2?"}])
    assert reply.model == second.fine_tuned_model
    pool = srv.server.config.app.state.service.engine.adapters
    assert f"default/{second.fine_tuned_model}" in pool.names  # the continued adapter, on the base's engine


def test_a_dpo_job_succeeds(api):
    client, _, _ = api
    pair = {"input": {"messages": [{"role": "user", "content": "Say hi"}]},
            "preferred_output": [{"role": "assistant", "content": "hi"}],
            "non_preferred_output": [{"role": "assistant", "content": "no"}]}
    f = upload(client, [pair] * 8, "pairs.jsonl")
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id,
                                         method={"type": "dpo", "dpo": {"hyperparameters": {"batch_size": 4,
                                                                                             "n_epochs": 1}}})
    job = checked(client, job)
    assert job.method.dpo.hyperparameters.beta == 0.1  # "auto", resolved
    job = wait(client, job.id)
    assert job.status == "succeeded", job.error
    reply = client.chat.completions.create(model=job.fine_tuned_model, max_tokens=2,
                                           messages=[{"role": "user", "content": "Say hi"}])
    assert reply.model == job.fine_tuned_model


def test_a_file_with_bad_rows_fails_its_job_naming_the_lines(api):
    client, _, _ = api
    f = upload(client, [chat_row("a", "b"), {"messages": [{"role": "user", "content": "no answer"}]},
                        {"messages": [{"role": "wizard", "content": "x"}]}])
    job = checked(client, client.fine_tuning.jobs.create(model="tiny", training_file=f.id))
    assert job.status == "failed" and job.error.param == "training_file"
    assert "line 2: messages has no assistant message" in job.error.message and "line 3" in job.error.message


@pytest.mark.parametrize("kwargs, status, words", [
    (dict(model="nope"), 400, "unknown model 'nope'"),
    (dict(training_file="file-missing"), 400, "no file 'file-missing'"),
    (dict(method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}}), 400, "n_epochs"),
    (dict(method={"type": "reinforcement", "reinforcement": {"grader": {"type": "string_check"}}}), 400,
     "is required for a string_check grader"),
])
def test_job_refusals_name_the_field(api, kwargs, status, words):
    client, _, store = api
    f = upload(client, [chat_row("a", "b")])
    before = len(store.list_jobs("default", limit=1000)[0])
    with pytest.raises(openai.APIStatusError) as info:
        client.fine_tuning.jobs.create(**{"model": "tiny", "training_file": f.id, **kwargs})
    assert info.value.status_code == status and words in info.value.message
    assert len(store.list_jobs("default", limit=1000)[0]) == before  # nothing half-created


def test_upload_refusals(api):
    client, srv, _ = api
    with pytest.raises(openai.BadRequestError, match="line 2 is not valid JSON"):
        client.files.create(file=("x.jsonl", io.BytesIO(b'{"a": 1}\nnot json\n')), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="purpose must be one of fine-tune"):
        client.files.create(file=("x.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
    r = httpx.post(srv.url + "/v1/files", content=b"{}", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "file"


def test_cancel_a_queued_job_and_delete_its_file(api):
    client, _, store = api
    f = upload(client, [chat_row("a", "b")])
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id, method={
        "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 50, "batch_size": 1}}})
    job = client.fine_tuning.jobs.cancel(job.id)
    assert job.status in ("cancelled", "running")
    job = wait(client, job.id)
    assert job.status == "cancelled"
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


# --------------------------------------------------------------------------- the OpenAPI document

FT_ROUTES = {("post", "/v1/files"), ("get", "/v1/files"), ("get", "/v1/files/{file_id}"),
             ("delete", "/v1/files/{file_id}"), ("get", "/v1/files/{file_id}/content"),
             ("post", "/v1/fine_tuning/jobs"), ("get", "/v1/fine_tuning/jobs"),
             ("get", "/v1/fine_tuning/jobs/{job_id}"), ("post", "/v1/fine_tuning/jobs/{job_id}/cancel"),
             ("post", "/v1/fine_tuning/jobs/{job_id}/pause"), ("post", "/v1/fine_tuning/jobs/{job_id}/resume"),
             ("get", "/v1/fine_tuning/jobs/{job_id}/events"), ("get", "/v1/fine_tuning/jobs/{job_id}/checkpoints")}


@pytest.fixture(scope="module")
def doc(api):
    return httpx.get(api[1].url + "/openapi.json").json()


def validator(doc, name):
    import jsonschema_rs

    return jsonschema_rs.Draft202012Validator({"components": doc["components"], "$ref": f"#/components/schemas/{name}"})


def test_the_document_has_every_fine_tuning_route_with_openai_errors(doc):
    routes = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert FT_ROUTES <= routes
    for method, path in FT_ROUTES - {("get", "/v1/files/{file_id}/content")}:
        answers = doc["paths"][path][method]["responses"]
        assert "$ref" in answers["200"]["content"]["application/json"]["schema"], (method, path)
        assert all(a["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
                   for s, a in answers.items() if s[0] in "45"), (method, path)
    assert "multipart/form-data" in doc["paths"]["/v1/files"]["post"]["requestBody"]["content"]


def test_real_fine_tuning_answers_match_their_schemas(api, doc):
    client, srv, _ = api
    f = upload(client, [chat_row("a", "b")] * 4)
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id,
                                         method={"type": "supervised", "supervised": {"hyperparameters": {
                                             "n_epochs": 1, "batch_size": 2}}})
    wait(client, job.id)
    base = srv.url + "/v1"
    for name, r in [("FileObject", httpx.get(f"{base}/files/{f.id}")), ("FileList", httpx.get(f"{base}/files")),
                    ("FineTuningJob", httpx.get(f"{base}/fine_tuning/jobs/{job.id}")),
                    ("JobList", httpx.get(f"{base}/fine_tuning/jobs")),
                    ("JobEventList", httpx.get(f"{base}/fine_tuning/jobs/{job.id}/events")),
                    ("JobCheckpointList", httpx.get(f"{base}/fine_tuning/jobs/{job.id}/checkpoints")),
                    ("ErrorResponse", httpx.post(f"{base}/fine_tuning/jobs/{job.id}/resume")),
                    ("ErrorResponse", httpx.get(f"{base}/fine_tuning/jobs/ftjob-nope"))]:
        errors = [e.message for e in validator(doc, name).iter_errors(r.json())]
        assert not errors, (name, r.json(), errors)


def test_schemathesis_finds_no_5xx_and_no_undocumented_answer(api, doc):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    base_url = api[1].url
    schema = schemathesis.openapi.from_dict(doc)
    for path, method in [("/v1/fine_tuning/jobs", "POST"), ("/v1/fine_tuning/jobs", "GET"),
                         ("/v1/fine_tuning/jobs/{job_id}", "GET"), ("/v1/fine_tuning/jobs/{job_id}/cancel", "POST"),
                         ("/v1/fine_tuning/jobs/{job_id}/pause", "POST"),
                         ("/v1/fine_tuning/jobs/{job_id}/resume", "POST"),
                         ("/v1/fine_tuning/jobs/{job_id}/events", "GET"),
                         ("/v1/fine_tuning/jobs/{job_id}/checkpoints", "GET"), ("/v1/files", "GET"),
                         ("/v1/files", "POST"), ("/v1/files/{file_id}", "GET"), ("/v1/files/{file_id}", "DELETE"),
                         ("/v1/fine_tuning/alpha/graders/validate", "POST"),
                         ("/v1/fine_tuning/alpha/graders/run", "POST"), ("/v1/webhooks", "POST"),
                         ("/v1/webhooks", "GET"), ("/v1/webhooks/{webhook_id}", "DELETE"),
                         ("/v1/models/{model}", "DELETE")]:
        @given(case=schema[path][method].as_strategy())
        @settings(max_examples=15, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case):
            r = case.call(base_url=base_url)
            calls.append(r.status_code)
            assert r.status_code < 500, (path, r.text)
            case.validate_response(r, checks=[schemathesis.checks.response_schema_conformance,
                                              schemathesis.checks.status_code_conformance])

        calls: list[int] = []
        check()
        assert len(calls) >= (1 if (path, method) == ("/v1/webhooks", "GET") else 3), (path, method, calls)


def test_a_retried_post_with_its_idempotency_key_gets_the_same_object(api):
    client, srv, store = api
    data = json.dumps(chat_row("a", "b")).encode() + b"\n"
    files = [client.files.create(file=("t.jsonl", data), purpose="fine-tune",
                                 extra_headers={"Idempotency-Key": "upload-1"}) for _ in range(2)]
    assert files[0].id == files[1].id
    body = {"model": "tiny", "training_file": files[0].id, "suffix": "once"}
    r1, r2 = (httpx.post(srv.url + "/v1/fine_tuning/jobs", json=body, headers={"Idempotency-Key": "job-1"})
              for _ in range(2))
    assert r1.status_code == r2.status_code == 200 and r1.json()["id"] == r2.json()["id"]
    other = httpx.post(srv.url + "/v1/fine_tuning/jobs", json={**body, "suffix": "twice"},
                       headers={"Idempotency-Key": "job-1"})
    assert other.status_code == 409 and other.json()["error"]["param"] == "idempotency_key"
    client.fine_tuning.jobs.cancel(r1.json()["id"])


# --------------------------------------------------------------------------- the SDK


def test_the_sdk_runs_a_job_from_a_file_path_to_its_model(api, tmp_path):
    from flywheel.client import AsyncFlywheel, Flywheel, FlywheelError

    _, srv, _ = api
    path = tmp_path / "add.jsonl"
    path.write_text("".join(json.dumps(chat_row(f"{i}+2", str(i + 2))) + "\n" for i in range(8)))
    with Flywheel(srv.url) as fw:
        f = fw.files.upload(path)
        assert f.filename == "add.jsonl" and fw.files.content(f.id) == path.read_bytes()
        job = fw.jobs.create(model="tiny", training_file=f.id, suffix="sdk", n_epochs=1, batch_size=4)
        job = fw.jobs.wait(job.id, poll_s=0.2, timeout_s=180, progress=True)
        assert job.status == "succeeded" and job.fine_tuned_model.startswith("ft:tiny:default:sdk:")
        assert [c.step_number for c in fw.jobs.checkpoints(job.id)] == [2]
        assert job.fine_tuned_model in [m.id for m in fw.models.list()]
        assert any(e.type == "metrics" for e in fw.jobs.events(job.id, limit=50))
        with pytest.raises(FlywheelError) as info:
            fw.jobs.get("ftjob-nope")
        assert info.value.status == 404 and info.value.param == "fine_tuning_job_id"

    async def from_async():
        async with AsyncFlywheel(srv.url) as afw:
            page = await afw.jobs.list(limit=1)
            done = await afw.jobs.wait(page.data[0].id, poll_s=0.1, timeout_s=30)
            return page, done

    import asyncio

    page, done = asyncio.run(from_async())
    assert len(page) == 1 and page.data[0].id == job.id and done.status == "succeeded"


def test_the_cli_uploads_creates_follows_and_controls_jobs(api, tmp_path):
    from typer.testing import CliRunner

    from flywheel.cli.main import app

    _, srv, _ = api
    run = CliRunner().invoke
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(chat_row(f"{i}", f"{i}")) + "\n" for i in range(4)))
    up = run(app, ["files", "upload", str(path), "--base-url", srv.url])
    assert up.exit_code == 0, up.output
    file_id = up.output.split()[0]
    assert file_id in run(app, ["files", "list", "--base-url", srv.url]).output
    made = run(app, ["jobs", "create", "--model", "tiny", "--training-file", file_id, "--set", "n_epochs=1",
                     "--set", "batch_size=2", "--lora-rank", "4", "--suffix", "cli", "--wait", "--base-url", srv.url])
    assert made.exit_code == 0 and "succeeded" in made.output and "ft:tiny:default:cli:" in made.output, made.output
    job_id = made.output.split()[0]
    shown = json.loads(run(app, ["jobs", "show", job_id, "--base-url", srv.url]).output)
    assert shown["hyperparameters"] == {"n_epochs": 1, "batch_size": 2, "learning_rate_multiplier": 1.0,
                                        "lora": {**shown["hyperparameters"]["lora"], "rank": 4, "alpha": 8.0}}
    assert "The job has successfully completed" in run(app, ["jobs", "events", job_id, "--base-url", srv.url]).output
    assert "ckpt-step-2" in run(app, ["jobs", "checkpoints", job_id, "--base-url", srv.url]).output
    name = shown["fine_tuned_model"]
    got = run(app, ["jobs", "download", name, "--out", str(tmp_path / "dl"), "--base-url", srv.url])
    assert got.exit_code == 0 and (tmp_path / "dl").is_dir(), got.output
    assert (Path(got.output.strip()) / "adapter_config.json").exists()  # a LoRA fine-tune: its peft adapter
    merged = run(app, ["jobs", "download", name, "--merged", "--out", str(tmp_path / "dm"), "--base-url", srv.url])
    assert merged.exit_code == 0 and (Path(merged.output.strip()) / "config.json").exists(), merged.output
    refused = run(app, ["jobs", "pause", job_id, "--base-url", srv.url])
    assert refused.exit_code == 1 and "only a queued or running job can be paused" in refused.output
    bad = run(app, ["jobs", "create", "--model", "nope", "--training-file", file_id, "--base-url", srv.url])
    assert bad.exit_code == 1 and "unknown model 'nope'" in bad.output and "(param: model)" in bad.output


def test_a_reinforcement_job_with_a_grader(api):
    client, srv, _ = api
    rows = [{"messages": [{"role": "user", "content": f"Say {i}"}], "answer": str(i)} for i in range(12)]
    f = upload(client, rows, "rft.jsonl")
    grader = {"type": "string_check", "name": "says", "input": "{{ sample.output_text }}",
              "reference": "{{ item.answer }}", "operation": "like"}
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id, suffix="rft", method={
        "type": "reinforcement", "reinforcement": {"grader": grader, "hyperparameters": {
            "n_epochs": 1, "batch_size": 2, "eval_interval": 2}}})
    job = checked(client, job)
    assert job.status in ("queued", "running") and job.method.reinforcement.hyperparameters.compute_multiplier == 1.0
    assert job.method.reinforcement.hyperparameters.lora["rank"] == 16  # LoRA RL by default
    job = wait(client, job.id)
    assert job.status == "succeeded", job.error
    metrics = [e.data for e in client.fine_tuning.jobs.list_events(job.id, limit=100) if e.type == "metrics"]
    assert metrics and "train_reward_mean" in metrics[0] and metrics[0]["total_steps"] == 6
    reply = client.chat.completions.create(model=job.fine_tuned_model, max_tokens=2,
                                           messages=[{"role": "user", "content": "Say 3"}])
    assert reply.model == job.fine_tuned_model
    pool = srv.server.config.app.state.service.engine.adapters
    assert f"default/{job.fine_tuned_model}" in pool.names  # an adapter on the base's engine


def test_the_grader_routes_validate_and_run_like_a_job(api):
    _, srv, _ = api
    grader = {"type": "multi", "name": "m", "calculate_output": "0.5 * a + 0.5 * b", "graders": {
        "a": {"type": "string_check", "name": "a", "input": "{{ sample.output_text }}", "reference": "{{ item.x }}",
              "operation": "eq"},
        "b": {"type": "text_similarity", "name": "b", "input": "{{ sample.output_text }}",
              "reference": "{{ item.x }}", "evaluation_metric": "rouge_l"}}}
    ok = httpx.post(srv.url + "/v1/fine_tuning/alpha/graders/validate", json={"grader": grader})
    assert ok.status_code == 200 and ok.json() == {"grader": grader}
    r = httpx.post(srv.url + "/v1/fine_tuning/alpha/graders/run",
                   json={"grader": grader, "model_sample": "red fox", "item": {"x": "red fox"}})
    assert r.status_code == 200 and r.json()["reward"] == 1.0 and r.json()["sub_rewards"] == {"a": 1.0, "b": 1.0}
    r = httpx.post(srv.url + "/v1/fine_tuning/alpha/graders/run",
                   json={"grader": grader, "model_sample": "red", "item": {}})
    assert r.status_code == 400 and "{{ item.x }} names nothing" in r.json()["error"]["message"]
    bad = httpx.post(srv.url + "/v1/fine_tuning/alpha/graders/validate",
                     json={"grader": {**grader, "calculate_output": "a ** 2"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "calculate_output"


def test_a_reinforcement_job_graded_by_a_flywheel_environment(api):
    import dataclasses

    from flywheel.envs import load_env

    client, srv, _ = api
    tasks = load_env("calculator", chain_prob=0.0).tasks("train", n=10)
    f = upload(client, [{"task": dataclasses.asdict(t)} for t in tasks], "calc.jsonl")
    env_grader = {"type": "flywheel_environment", "name": "calc", "env": "calculator",
                  "settings": {"chain_prob": 0.0}}
    job = client.fine_tuning.jobs.create(model="tiny", training_file=f.id, method={
        "type": "reinforcement", "reinforcement": {"grader": env_grader, "hyperparameters": {
            "n_epochs": 1, "batch_size": 2, "eval_interval": 5}}})
    job = checked(client, job)
    assert job.status in ("queued", "running"), job.error
    job = wait(client, job.id)
    assert job.status == "succeeded", job.error
    # rows that are not its tasks, and an environment that does not load, are refused by name
    bad = upload(client, [{"task": {"answer": 3}}, {"prompt": "x"}], "bad.jsonl")
    failed = client.fine_tuning.jobs.create(model="tiny", training_file=bad.id, method={
        "type": "reinforcement", "reinforcement": {"grader": env_grader}})
    failed = checked(client, failed)
    assert failed.status == "failed" and "line 1: task: missing field 'prompt'" in failed.error.message
    assert "line 2" in failed.error.message
    with pytest.raises(openai.BadRequestError) as info:
        client.fine_tuning.jobs.create(model="tiny", training_file=f.id, method={
            "type": "reinforcement", "reinforcement": {"grader": {**env_grader, "env": "no_such_env"}}})
    assert info.value.body["param"] == "method.reinforcement.grader.env"


def test_a_fine_tuned_model_downloads_as_a_folder_and_can_be_deleted(api, tmp_path):
    import tarfile

    from flywheel.models import load

    client, srv, _ = api
    f = upload(client, [chat_row("a", "b")] * 2)
    job = wait(client, client.fine_tuning.jobs.create(model="tiny", training_file=f.id, suffix="gone", method={
        "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}}).id)
    name = job.fine_tuned_model
    def fetch(query: str, out: str) -> Path:
        r = httpx.get(f"{srv.url}/v1/models/{name}/content{query}")
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
        (tmp_path / f"{out}.tar").write_bytes(r.content)
        with tarfile.open(tmp_path / f"{out}.tar") as tar:
            tar.extractall(tmp_path / out, filter="data")
        (folder,) = (tmp_path / out).iterdir()
        return folder

    adapter = fetch("", "out")  # a peft adapter folder that peft loads onto the base as it is
    base, _ = load(json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"])
    tuned = peft.PeftModel.from_pretrained(base, adapter)
    model, _ = load(fetch("?format=merged", "merged"))  # a Hugging Face folder that loads
    ids = torch.tensor([[5, 9, 13]])
    with torch.no_grad():
        assert (model(input_ids=ids).logits - tuned(input_ids=ids).logits).abs().max() < 1e-4
    checkpoint = client.fine_tuning.jobs.checkpoints.list(job.id).data[0].fine_tuned_model_checkpoint
    client.chat.completions.create(model=name, messages=[{"role": "user", "content": "a"}], max_tokens=2)
    deleted = client.models.delete(name)
    assert deleted.deleted and deleted.id == name
    assert name not in [m.id for m in client.models.list()]
    with pytest.raises(openai.BadRequestError, match="unknown model"):
        client.chat.completions.create(model=name, messages=[{"role": "user", "content": "a"}], max_tokens=2)
    assert httpx.get(f"{srv.url}/v1/models/{name}/content").status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.models.delete(name)
    with pytest.raises(openai.PermissionDeniedError):
        client.models.delete("tiny")
    reply = client.chat.completions.create(model=checkpoint, messages=[{"role": "user", "content": "a"}], max_tokens=2)
    assert reply.model == checkpoint  # its checkpoints stay


def test_score_model_graders_ask_a_model_the_server_has(api):
    _, srv, _ = api
    judge = {"type": "score_model", "name": "judge", "model": "tiny", "range": [0, 1],
             "input": [{"role": "user", "content": "Score {{ sample.output_text }} from 0 to 1"}]}
    r = httpx.post(srv.url + "/v1/fine_tuning/alpha/graders/run",
                   json={"grader": judge, "model_sample": "hello", "item": {}})
    assert r.status_code == 200 and 0.0 <= r.json()["reward"] <= 1.0, r.text
    r = httpx.post(srv.url + "/v1/fine_tuning/alpha/graders/validate", json={"grader": {**judge, "model": "nope"}})
    assert r.status_code == 400 and "score_model names model 'nope'" in r.json()["error"]["message"]


def test_a_webhook_hears_of_a_job_that_ended(api):
    from flywheel.jobs.webhooks import verify

    client, srv, _ = api
    got = []
    receiver = FastAPI()

    @receiver.post("/hook")
    async def hook(request: Request):
        got.append((dict(request.headers), await request.body()))
        return {}

    with BackgroundServer(receiver) as rx:
        made = httpx.post(srv.url + "/v1/webhooks", json={"url": rx.url + "/hook",
                                                          "events": ["fine_tuning.job.succeeded"]})
        assert made.status_code == 200 and made.json()["secret"].startswith("whsec_"), made.text
        listed = httpx.get(srv.url + "/v1/webhooks").json()["data"]
        assert [w["id"] for w in listed] == [made.json()["id"]] and "secret" not in listed[0]
        f = upload(client, [chat_row("a", "b")] * 2)
        job = wait(client, client.fine_tuning.jobs.create(model="tiny", training_file=f.id, method={
            "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 2}}}).id)
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            time.sleep(0.1)
        assert httpx.delete(srv.url + f"/v1/webhooks/{made.json()['id']}").status_code == 200
    assert got, [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=50)]
    headers, body = got[0]
    assert json.loads(body)["data"] == {"id": job.id} and json.loads(body)["type"] == "fine_tuning.job.succeeded"
    assert verify(made.json()["secret"], headers, body)
    assert any("Webhook fine_tuning.job.succeeded delivered" in e.message
               for e in client.fine_tuning.jobs.list_events(job.id, limit=50))
    bad = httpx.post(srv.url + "/v1/webhooks", json={"url": "ftp://x", "events": []})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"


def test_bodies_over_the_limit_are_a_413_before_they_are_read(tmp_path):
    from flywheel.jobs.limits import TenantLimits

    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    service = OpenAIService(base, name="tiny", default_max_tokens=2)
    app = create_app(service, fine_tuning=FineTuning(store, {"tiny": base}, limits=TenantLimits(max_file_bytes=2000)),
                     max_body_bytes=1000)
    with BackgroundServer(app) as srv:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 2000}]}
        r = httpx.post(srv.url + "/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no content-length: cut off once past the limit
            for _ in range(10):
                yield b"x" * 200
        r = httpx.post(srv.url + "/v1/fine_tuning/jobs", content=chunks())
        assert r.status_code == 413
        padded = json.dumps(chat_row("a", "b")).encode() + b"\n" + b" " * 1200
        ok = httpx.post(srv.url + "/v1/files", files={"file": ("t.jsonl", padded)}, data={"purpose": "fine-tune"})
        assert ok.status_code == 200, ok.text  # an upload may be larger than a JSON body, up to its own limit
        r = httpx.post(srv.url + "/v1/files", files={"file": ("t.jsonl", b"{}\n" * 30_000)},
                       data={"purpose": "fine-tune"})
        assert r.status_code == 413
    service.close()
    store.close()
