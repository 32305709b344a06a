"""The dashboard's JSON routes (serve/dashboard/) through a real server with API keys: each
tenant sees only its own traffic, jobs, flywheels and cycles; another tenant's job is a 404;
no key is a 401; the page itself is a static shell that holds no data; answers match their
OpenAPI schemas. Also the pure pieces by hand: busy time as a union of intervals, the serving
cost estimate, a cycle's points per dollar, the grouping of traces. Fast: no worker runs (the
job, its metrics events and the cycle's decision are written to the stores as a worker would);
tests/browser/ drives the page with a real worker and a real cycle."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import httpx
import jsonschema_rs
import pytest

from flywheel.clock import utc_naive, utc_now
from flywheel.economics.catalog import load_catalog
from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.jobs import JobStore
from flywheel.jobs.keys import Keys
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve.app import create_app
from flywheel.serve.auth import KeyAuth
from flywheel.serve.background import BackgroundServer
from flywheel.serve.core import OpenAIService
from flywheel.serve.dashboard.data import cycle_view
from flywheel.serve.dashboard.traffic import busy_seconds, group_of, serving_cost
from flywheel.serve.traces import TraceStoreSink
from flywheel.traces import TraceStore
from flywheel.traces.results import StoredFeedback, StoredVerifier

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
T0 = datetime(2030, 1, 1, 12, 0, 0)  # naive UTC: the posted traces' times


def trace(i: int, family: str, latency_ms: float, at_s: float) -> dict:
    return {"id": f"t-{family}-{i}", "model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}],
            "response": {"role": "assistant", "content": f"a{i}"}, "metadata": {"family": family},
            "usage": {"prompt_tokens": 10, "completion_tokens": 5}, "latency_ms": latency_ms,
            "created_at": (T0 + timedelta(seconds=at_s)).isoformat()}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    base = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    url = data_file_url(root)
    store = JobStore(url, root / "files")
    keys = Keys(store.engine)
    key_a, _ = keys.create("alpha")
    key_b, _ = keys.create("beta")
    traces = TraceStore(url)
    service = OpenAIService(base, name="tiny", default_max_tokens=4, trace_sink=TraceStoreSink(traces))
    app = create_app(service, fine_tuning=FineTuning(store, {"tiny": base}), trace_store=traces,
                     tenant_of=KeyAuth(keys, rate_per_s=1000, burst=1000, cache_s=0))
    srv = BackgroundServer(app).start()
    a = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key_a}"}, timeout=60)
    b = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key_b}"}, timeout=60)
    # alpha's traffic: 3 "add" traces (2 judged bad, 1 good), 1 "mul" trace; intervals 0-2 s, 1-3 s, 5-6 s, 10-10.5 s
    posted = a.post("/v1/traces", json=[trace(0, "add", 2000, 2), trace(1, "add", 2000, 3), trace(2, "add", 1000, 6),
                                        trace(3, "mul", 500, 10.5)])
    assert posted.status_code == 200 and posted.json()["added"] == 4, posted.text
    for tid, label in (("t-add-0", "bad"), ("t-add-1", "bad"), ("t-add-2", "good")):
        assert a.post(f"/v1/traces/{tid}/feedback", json={"label": label}).status_code == 200
    # alpha's job, with the metrics events a worker writes while it trains
    job = store.create_job("alpha", model="tiny", training_file="file-none", validation_file=None, suffix="s",
                           seed=0, meta=None, method={"type": "supervised", "supervised": {"hyperparameters": {}}})
    for step, loss in ((1, 2.5), (2, 2.0), (3, 1.25)):
        store.add_event(job["id"], f"Step {step}/3: training loss={loss}", type="metrics",
                        data={"step": step, "train_loss": loss, "total_steps": 3, "train_reward_mean": step / 10})
    # alpha's flywheel with one decided, promoted cycle
    fw = a.post("/v1/flywheels", json={"model": "tiny", "suffix": "calc"})
    assert fw.status_code == 200, fw.text
    flywheels = app.state.flywheels.store
    cycle = flywheels.queue_cycle(fw.json()["id"], "12 new failures since v1")
    flywheels.record_cycle(cycle["id"], outcome="promoted", usd=0.25, version="v2", new_failures=2,
                           decision={"promote": True, "gain": 0.5, "reasons": ["new failures: +50.0 pts >= 0.0 pts"]},
                           finished_at=utc_naive(utc_now()))
    yield SimpleNamespace(a=a, b=b, srv=srv, job=job["id"], flywheel=fw.json()["id"], cycle_job=cycle["job_id"])
    a.close()
    b.close()
    srv.stop()
    service.close()
    traces.close()
    store.close()


def test_the_summary_shows_the_callers_traffic_loop_and_jobs(world):
    r = world.a.get("/v1/dashboard/summary")
    assert r.status_code == 200, r.text
    s = r.json()
    assert s["tenant"] == "alpha"
    t = s["traffic"]
    assert (t["requests"], t["with_feedback"], t["prompt_tokens"], t["completion_tokens"]) == (4, 3, 40, 20)
    assert t["outcomes"] == {"fail": 2, "pass": 1, "unknown": 1}
    groups = {g["name"]: g for g in t["groups"]}
    assert groups["add"] == {"name": "add", "kind": "family", "requests": 3, "passes": 1, "failures": 2,
                             "failure_rate": pytest.approx(2 / 3)}
    assert groups["mul"]["failure_rate"] is None and t["groups"][0]["name"] == "add"  # most failures first
    # busy 3 + 1 + 0.5 = 4.5 s over 60 tokens at cpu-2core's price
    price = load_catalog().get("cpu-2core").usd_per_hour
    assert t["cost"]["busy_seconds"] == pytest.approx(4.5)
    assert t["cost"]["usd_per_million_tokens"] == pytest.approx(4.5 * price / 3600 / 60 * 1e6)
    [fw] = s["flywheels"]
    assert (fw["id"], fw["promotions"], fw["rollbacks"], fw["usd"]) == (world.flywheel, 1, 0, 0.25)
    [c] = fw["cycles"]
    assert (c["promote"], c["outcome"], c["reasons"], c["gain_points"], c["points_per_usd"]) == (
        True, "promoted", ["new failures: +50.0 pts >= 0.0 pts"], 50.0, 200.0)
    jobs = {j["id"]: j for j in s["jobs"]}
    assert jobs[world.job]["last_metrics"] == {"train_loss": 1.25, "train_reward_mean": 0.3}
    assert jobs[world.cycle_job]["flywheel_id"] == world.flywheel and jobs[world.cycle_job]["cycle"] == 1
    [live] = s["live"]  # no job runs: the newest job that reported metrics
    assert live["job_id"] == world.job and live["series"]["train_loss"] == [[1, 2.5], [2, 2.0], [3, 1.25]]


def test_another_tenant_sees_none_of_it(world):
    s = world.b.get("/v1/dashboard/summary").json()
    assert s["tenant"] == "beta"
    assert s["traffic"]["requests"] == 0 and s["traffic"]["groups"] == [] and s["traffic"]["outcomes"] == {}
    assert s["flywheels"] == [] and s["jobs"] == [] and s["live"] == []
    for job in (world.job, world.cycle_job):
        r = world.b.get(f"/v1/dashboard/jobs/{job}")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text
        assert world.a.get(f"/v1/dashboard/jobs/{job}").status_code == 200


def test_a_job_shows_its_events_series_and_cycle(world):
    d = world.a.get(f"/v1/dashboard/jobs/{world.job}").json()
    assert d["series"] == {"train_loss": [[1, 2.5], [2, 2.0], [3, 1.25]],
                           "train_reward_mean": [[1, 0.1], [2, 0.2], [3, 0.3]]}
    messages = [e["message"] for e in d["events"]]
    assert messages[0].startswith("Validating training file") and "Step 3/3: training loss=1.25" in messages
    assert d["cycle"] is None
    cycle = world.a.get(f"/v1/dashboard/jobs/{world.cycle_job}").json()
    assert cycle["cycle"]["number"] == 1 and cycle["cycle"]["outcome"] == "promoted"
    assert cycle["events"][0]["message"].endswith("cycle 1 queued: 12 new failures since v1")


@pytest.mark.parametrize("path", ["/v1/dashboard/summary", "/v1/dashboard/jobs/{job}"])
@pytest.mark.parametrize("auth", [None, "Bearer fw-not-a-key"])
def test_no_key_or_a_bad_key_is_a_401(world, path, auth):
    r = httpx.get(world.srv.url + path.format(job=world.job), headers={"authorization": auth} if auth else {})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text


def test_the_page_is_a_static_shell_with_its_assets_and_a_strict_policy(world):
    for path in ("/dashboard", f"/dashboard/jobs/{world.job}"):
        r = httpx.get(world.srv.url + path)  # no key: the shell holds no data
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        assert "/dashboard/assets/dashboard.js" in r.text and world.job not in r.text and "alpha" not in r.text
        assert "script-src 'self'" in r.headers["content-security-policy"]
    js = httpx.get(world.srv.url + "/dashboard/assets/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "Bearer" in js.text and "innerHTML" not in js.text  # data goes in as text, never as HTML
    assert httpx.get(world.srv.url + "/dashboard/assets/dashboard.css").headers["content-type"].startswith("text/css")
    missing = httpx.get(world.srv.url + "/dashboard/assets/..%2Fdata.py")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_answers_match_their_openapi_schemas(world):
    doc = httpx.get(world.srv.url + "/openapi.json").json()
    for path, name in (("/v1/dashboard/summary", "DashboardSummary"), ("/v1/dashboard/jobs/{job_id}", "DashboardJob")):
        op = doc["paths"][path]["get"]
        assert op["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": f"#/components/schemas/{name}"}
        assert {"401", "429"} <= set(op["responses"])
    check = [("DashboardSummary", world.a.get("/v1/dashboard/summary").json()),
             ("DashboardSummary", world.b.get("/v1/dashboard/summary").json()),
             ("DashboardJob", world.a.get(f"/v1/dashboard/jobs/{world.job}").json()),
             ("DashboardJob", world.a.get(f"/v1/dashboard/jobs/{world.cycle_job}").json())]
    for name, answer in check:
        schema = jsonschema_rs.Draft202012Validator({"components": doc["components"],
                                                     "$ref": f"#/components/schemas/{name}"})
        assert not [e.message for e in schema.iter_errors(answer)], name


# ---------------------------------------------------------------- the pure pieces, by hand


def test_busy_time_counts_overlapping_requests_once():
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0
    assert busy_seconds([(0, 10), (2, 3), (4, 5)]) == 10.0  # nested intervals add nothing
    assert busy_seconds([(5, 6), (0, 1)]) == 2.0  # order does not matter


def test_serving_cost_is_price_times_busy_time_over_tokens():
    row = lambda end_s, latency_ms, tokens: SimpleNamespace(  # noqa: E731
        created_at=T0 + timedelta(seconds=end_s), latency_ms=latency_ms, prompt_tokens=tokens, completion_tokens=0)
    rows = [row(2, 2000, 100), row(3, 2000, 100), row(100, None, 10_000)]  # the last: posted, no latency: left out
    cost = serving_cost(rows, "cpu-2core")
    price = load_catalog().get("cpu-2core").usd_per_hour
    assert cost.busy_seconds == 3.0 and cost.tokens == 200
    assert cost.usd_per_million_tokens == pytest.approx(3.0 * price / 3600 / 200 * 1e6)
    unknown = serving_cost(rows, "no-such-gpu")
    assert unknown.usd_per_million_tokens is None and "unknown hardware 'no-such-gpu'" in unknown.note


def test_a_cycles_points_per_dollar_count_only_a_promotion():
    row = dict(number=2, job_id="ftjob-x", job_status="succeeded", reason="r", version="v3", fine_tuned_model=None,
               created_at=None, finished_at=None, estimated_cost=None, usd=0.5, outcome="rejected",
               decision={"promote": False, "gain": 0.1, "reasons": ["regression on add"]})
    rejected = cycle_view(row)
    assert (rejected.gain_points, rejected.points_per_usd, rejected.promote) == (pytest.approx(10.0), 0.0, False)
    promoted = cycle_view({**row, "outcome": "promoted", "estimated_cost": 0.2, "decision": {"promote": True,
                                                                                              "gain": 0.1}})
    assert promoted.usd == 0.2 and promoted.points_per_usd == pytest.approx(50.0)
    pending = cycle_view({**row, "outcome": None, "decision": None})
    assert pending.promote is None and pending.points_per_usd is None and pending.reasons == []


def test_a_trace_is_grouped_by_family_then_env_then_verifier_then_model():
    fb = [StoredFeedback(id="f", trace_id="t", created_at=datetime.now(timezone.utc),
                         verifier=StoredVerifier("calculator", {}))]
    assert group_of({"family": "add", "env": "x"}, fb, "m") == ("family", "add")
    assert group_of({"environment": "code_repair"}, fb, "m") == ("env", "code_repair")
    assert group_of({"request_metadata": {"env": "swe"}}, [], "m") == ("env", "swe")
    assert group_of({}, fb, "m") == ("env", "calculator")
    assert group_of(None, [], "m") == ("model", "m")
