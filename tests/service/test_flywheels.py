"""Managed flywheels through the HTTP API, against a real server and a real worker on the tiny
model: a flywheel made by POST /v1/flywheels serves its production alias at once; simulated
traffic (examples/loop_traffic.py, the official `openai` client) calling the alias and judging
its answers fills the flywheel's trigger; each cycle runs as a fine-tuning job, is gated and
promoted; the alias switches to the promoted model with no failed request while a client
keeps calling it; /cycles shows each decision with its reasons and cost; rollback is one call.
The machinery, not learning: an untrained model under a gate that admits any candidate
(delta 0, epsilon 1, one new failure enough to decide)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from flywheel.jobs import JobStore
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve import OpenAIService, open_trace_sink
from flywheel.serve.app import create_app
from flywheel.serve.background import BackgroundServer
from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.worker.job_worker import JobWorker

from reduced_loop import MACHINERY

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("flywheels")
    base = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64, max_positions=512))
    store = JobStore(data_file_url(root), root / "files")
    ft = FineTuning(store, {"tiny": base})
    sink = open_trace_sink(f"sqlite:///{root / 'traces.db'}")
    service = OpenAIService(base, name="tiny", default_max_tokens=8, trace_sink=sink)
    srv = BackgroundServer(create_app(service, fine_tuning=ft, trace_store=sink.store, flywheel_poll_s=0.4)).start()
    worker = JobWorker(store, {"tiny": base}, root, heartbeat_s=0.2, threads=1, log=lambda m: None)
    thread = threading.Thread(target=worker.run, kwargs={"idle_s": 0.1}, daemon=True)
    thread.start()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield client, srv, root
    worker.stopping.set()
    thread.join(60)
    srv.stop()
    service.close()
    store.close()


def traffic(srv, alias: str, episodes: int, seed: int) -> None:
    done = subprocess.run([sys.executable, str(REPO / "examples" / "loop_traffic.py"), "--url", srv.url + "/v1",
                           "--model", alias, "--episodes", str(episodes), "--max-tokens", "8",
                           "--correction-rate", "1", "--seed", str(seed)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def cycles(srv, fw_id: str) -> list[dict]:
    r = httpx.get(f"{srv.url}/v1/flywheels/{fw_id}/cycles")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen in {timeout} s")


class Caller:
    """A client calling the alias over and over in a thread: every answer's status and the
    version that served it."""

    def __init__(self, srv, alias: str):
        self.url, self.alias = srv.url, alias
        self.statuses: list[int] = []
        self.versions: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.is_set():
                r = http.post(self.url + "/v1/chat/completions", json={
                    "model": self.alias, "max_tokens": 2, "messages": [{"role": "user", "content": "What is 2 + 2?"}]})
                self.statuses.append(r.status_code)
                if r.status_code == 200:
                    self.versions.append(r.headers["x-flywheel-model-version"])

    def __enter__(self) -> "Caller":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(60)


def validator(doc, name):
    import jsonschema_rs

    return jsonschema_rs.Draft202012Validator({"components": doc["components"], "$ref": f"#/components/schemas/{name}"})


def check_schema(srv, name: str, answer: dict) -> None:
    doc = httpx.get(srv.url + "/openapi.json").json()
    errors = [e.message for e in validator(doc, name).iter_errors(answer)]
    assert not errors, (name, answer, errors)


FLYWHEEL_ROUTES = [("/v1/flywheels", "POST"), ("/v1/flywheels", "GET"), ("/v1/flywheels/{flywheel_id}", "GET"),
                   ("/v1/flywheels/{flywheel_id}/cycles", "GET"), ("/v1/flywheels/{flywheel_id}/cycles", "POST"),
                   ("/v1/flywheels/{flywheel_id}/rollback", "POST")]


def test_schemathesis_finds_no_5xx_and_no_undocumented_answer_on_the_flywheel_routes(world):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    _, srv, _ = world
    doc = httpx.get(srv.url + "/openapi.json").json()
    assert {(p, m.lower()) for p, m in FLYWHEEL_ROUTES} <= {(p, m) for p, ops in doc["paths"].items() for m in ops}
    schema = schemathesis.openapi.from_dict(doc)
    for path, method in FLYWHEEL_ROUTES:
        @given(case=schema[path][method].as_strategy())
        @settings(max_examples=15, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), derandomize=True)
        def check(case):
            r = case.call(base_url=srv.url)
            calls.append(r.status_code)
            assert r.status_code < 500, (path, r.text)
            case.validate_response(r, checks=[schemathesis.checks.response_schema_conformance,
                                              schemathesis.checks.status_code_conformance])

        calls: list[int] = []
        check()
        assert len(calls) >= 3, (path, method, calls)


@pytest.mark.slow  # two cycles through a worker (~40 s); make test stays under four minutes
def test_a_managed_flywheel_runs_gated_cycles_and_its_alias_follows_promotions(world):
    import io
    import json

    client, srv, root = world
    rows = [{"messages": [{"role": "user", "content": f"Say {i}"}], "answer": str(i)} for i in range(4)]
    house = client.files.create(file=("house.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in rows).encode())),
                                purpose="fine-tune")
    grader = {"type": "string_check", "name": "says", "input": "{{ sample.output_text }}",
              "reference": "{{ item.answer }}", "operation": "eq"}
    suites = {**MACHINERY["eval"]["suites"], "house": {"file": house.id, "grader": grader, "tasks": 4}}
    r = httpx.post(srv.url + "/v1/flywheels", json={"model": "tiny", "suffix": "calc", **MACHINERY,
                                                    "eval": {**MACHINERY["eval"], "suites": suites}})
    assert r.status_code == 200, r.text
    fw = r.json()
    check_schema(srv, "Flywheel", fw)
    alias = fw["production_model"]
    assert alias == "ft:tiny:default:calc:production" and fw["production"] == {
        "model": "tiny", "version": "v1", "generation": 0}
    reply = client.chat.completions.create(model=alias, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert reply.model == alias and reply.system_fingerprint == "tiny"  # served at once, by the model it started from

    promoted = []
    with Caller(srv, alias) as caller:
        for n, seed in ((1, 0), (2, 1)):
            traffic(srv, alias, episodes=16, seed=seed)
            cycle = wait_for(lambda: next((c for c in cycles(srv, fw["id"]) if c["number"] == n
                                           and c["status"] in ("succeeded", "failed")), None), 300, f"cycle {n}")
            assert cycle["status"] == "succeeded" and cycle["outcome"] == "promoted", cycle
            assert "new failures" in cycle["reason"] and cycle["decision"]["reasons"]
            assert cycle["estimated_cost"] > 0 and cycle["new_failures"] >= 1 and cycle["version"] == f"v{n + 1}"
            assert {"add", "house", "new_failures"} <= set(cycle["scores"]["candidate"])  # the graded file, too
            check_schema(srv, "FlywheelCycle", cycle)
            promoted.append(cycle["fine_tuned_model"])
            wait_for(lambda: caller.versions and caller.versions[-1] == promoted[-1], 30, "the alias to switch")
    assert caller.statuses and set(caller.statuses) == {200}, "a request failed during a switch"
    seen = list(dict.fromkeys(caller.versions))
    assert seen[0] in ("tiny", promoted[0]) and seen[-1] == promoted[1]

    # each cycle is a fine-tuning job, its stages in its events; the promoted models serve as adapters on the base
    job = client.fine_tuning.jobs.retrieve(cycles(srv, fw["id"])[0]["fine_tuning_job_id"])
    assert job.status == "succeeded" and job.fine_tuned_model == promoted[1] and job.training_file is None
    events = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=100)]
    assert any("trained" in m for m in events) and any("promoted v3" in m for m in events), events
    pool = srv.server.config.app.state.service.engine.adapters
    assert f"default/{promoted[1]}" in pool.names

    check_schema(srv, "FlywheelCycleList", httpx.get(f"{srv.url}/v1/flywheels/{fw['id']}/cycles").json())
    check_schema(srv, "FineTuningJob", httpx.get(f"{srv.url}/v1/fine_tuning/jobs/{job.id}").json())
    shown = httpx.get(f"{srv.url}/v1/flywheels/{fw['id']}").json()
    assert shown["production"] == {"model": promoted[1], "version": "v3", "generation": 2}
    back = httpx.post(f"{srv.url}/v1/flywheels/{fw['id']}/rollback", json={})
    assert back.status_code == 200, back.text
    assert back.json()["production"] == {"model": promoted[0], "version": "v2", "generation": 3}
    wait_for(lambda: client.chat.completions.create(
        model=alias, max_tokens=2, messages=[{"role": "user", "content": "hi"}]).system_fingerprint == promoted[0],
        30, "the alias to follow the rollback")
