"""The live dashboard in a real headless Chromium (Playwright), against a real server with API
keys, a real JobWorker and a managed flywheel with a reduced loop on the tiny model (the
machinery of tests/service/test_flywheels.py: a gate that admits any candidate, so the
outcome does not depend on learning).

Tenant alpha signs in and sees its traffic; simulated users (examples/loop_traffic.py) call
its flywheel's alias and report failures, the trigger queues a cycle, the worker runs it, and
the page shows the cycle and the gate's decision with its reasons without being reloaded;
a link leads to a fine-tuning job's view with its events and metrics charts; tenant beta
sees none of alpha's. Screenshots go to pytest's tmp dir; with FLYWHEEL_UPDATE_SCREENSHOTS=1 the
overview is copied to docs/dashboard.png (the README shows it), so a plain test run changes no
tracked file."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.jobs import JobStore
from flywheel.jobs.keys import Keys
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve.app import create_app
from flywheel.serve.auth import KeyAuth
from flywheel.serve.background import BackgroundServer
from flywheel.serve.core import OpenAIService
from flywheel.serve.traces import TraceStoreSink
from flywheel.traces import TraceStore
from flywheel.worker.job_worker import JobWorker

from reduced_loop import MACHINERY

pytestmark = [pytest.mark.browser, pytest.mark.usefixtures("one_thread")]
REPO = Path(__file__).resolve().parents[2]
ROWS = [{"messages": [{"role": "user", "content": f"Say {i}"}, {"role": "assistant", "content": str(i)}]}
        for i in range(4)]
CYCLE_S = 300_000  # ms: a cycle on a shared 2-core machine


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("dashboard")
    base = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64, max_positions=512))
    url = data_file_url(root)
    store = JobStore(url, root / "files")
    keys = Keys(store.engine)
    key_a, key_b = keys.create("alpha")[0], keys.create("beta")[0]
    traces = TraceStore(url)
    service = OpenAIService(base, name="tiny", default_max_tokens=8, trace_sink=TraceStoreSink(traces))
    ft = FineTuning(store, {"tiny": base})
    srv = BackgroundServer(create_app(service, fine_tuning=ft, trace_store=traces, flywheel_poll_s=0.4,
                                      tenant_of=KeyAuth(keys, rate_per_s=1000, burst=1000))).start()
    worker = JobWorker(store, {"tiny": base}, root / "work", heartbeat_s=0.2, metrics_every=1, threads=1,
                       log=lambda m: None)
    thread = threading.Thread(target=worker.run, kwargs={"idle_s": 0.1}, daemon=True)
    thread.start()
    a = httpx.Client(base_url=srv.url, headers={"authorization": f"Bearer {key_a}"}, timeout=60)
    up = a.post("/v1/files", files={"file": ("t.jsonl", io.BytesIO("".join(json.dumps(r) + "\n" for r in ROWS)
                                                                  .encode()))}, data={"purpose": "fine-tune"})
    job = a.post("/v1/fine_tuning/jobs", json={"model": "tiny", "training_file": up.json()["id"], "suffix": "sft",
                                               "method": {"type": "supervised", "supervised": {
                                                   "hyperparameters": {"n_epochs": 3, "batch_size": 1}}}})
    assert job.status_code == 200, job.text
    fw = a.post("/v1/flywheels", json={"model": "tiny", "suffix": "calc", **MACHINERY})
    assert fw.status_code == 200, fw.text
    posted = a.post("/v1/traces", json=[
        {"id": f"t{i}", "model": "tiny", "messages": [{"role": "user", "content": f"q{i}"}],
         "response": {"role": "assistant", "content": "?"}, "metadata": {"family": family},
         "usage": {"prompt_tokens": 12, "completion_tokens": 3}, "latency_ms": 40.0}
        for i, family in enumerate(["add", "add", "add", "mul"])])
    assert posted.json()["added"] == 4, posted.text
    for tid in ("t0", "t1"):
        assert a.post(f"/v1/traces/{tid}/feedback", json={"label": "bad"}).status_code == 200
    yield SimpleNamespace(srv=srv, url=srv.url, key_a=key_a, key_b=key_b, a=a, job=job.json()["id"],
                          flywheel=fw.json(), root=root)
    a.close()
    worker.stopping.set()
    thread.join(60)
    srv.stop()
    service.close()
    traces.close()
    store.close()


def sign_in(browser, url: str, key: str, path: str = "/dashboard"):
    """A new tab at `path`, signed in with `key` through the page's form."""
    page = browser.new_page(viewport={"width": 1360, "height": 1000})
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text)  # a refused fetch is logged too: not a page error
            if msg.type == "error" and not msg.text.startswith("Failed to load resource") else None)
    page.errors = errors
    page.goto(url + path)
    page.wait_for_selector("#login:not([hidden])")
    page.fill("#key", key)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#status.ok")
    return page


def card(page, testid: str) -> str:
    return page.locator(f"[data-testid={testid}] .value").first.inner_text()


def traffic(world, episodes: int, seed: int) -> None:
    """Simulated users calling alpha's flywheel alias, every answer judged (failures fill the trigger)."""
    done = subprocess.run([sys.executable, str(REPO / "examples" / "loop_traffic.py"), "--url", world.url + "/v1",
                           "--model", world.flywheel["production_model"], "--episodes", str(episodes),
                           "--max-tokens", "8", "--correction-rate", "1", "--seed", str(seed),
                           "--api-key", world.key_a], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


def test_tenant_a_sees_its_traffic(world, browser, shots):
    page = sign_in(browser, world.url, world.key_a)
    assert page.inner_text("#tenant") == "tenant alpha"
    page.wait_for_function("document.querySelector('[data-testid=requests] .value').textContent === '4'")
    assert card(page, "failures") == "2" and card(page, "tokens") == "60"
    add = page.locator("#groups tr[data-group=add]")
    assert add.locator("td").nth(3).inner_text() == "2"  # failures of the "add" family
    assert "100.0%" in add.inner_text()  # both judged traces failed
    assert card(page, "serving-cost").startswith("$")  # 4 x 40 ms in flight at cpu-2core's price over 60 tokens
    page.screenshot(path=str(shots / "1-traffic.png"), full_page=True)
    assert not page.errors, page.errors
    page.close()


def test_a_cycle_appears_with_the_gates_decision_without_a_reload(world, browser, shots):
    page = sign_in(browser, world.url, world.key_a)
    page.evaluate("window.__sameDocument = true")
    page.wait_for_selector(f"[data-flywheel='{world.flywheel['id']}']")
    assert page.locator("[data-testid=cycle]").count() == 0
    traffic(world, episodes=16, seed=0)
    page.wait_for_selector("[data-testid=cycle][data-cycle='1']", timeout=60_000)  # queued by the trigger
    page.screenshot(path=str(shots / "2-cycle-running.png"), full_page=True)
    page.wait_for_selector("[data-testid=cycle][data-cycle='1'][data-outcome=promoted]", timeout=CYCLE_S)
    row = page.locator("[data-testid=cycle][data-cycle='1']")
    assert "promote" in row.locator(".badge").all_inner_texts()
    reasons = row.locator("td.reasons li").all_inner_texts()
    assert reasons and any("pts" in r for r in reasons), reasons  # the gate's reasons, as the API gives them
    assert page.evaluate("window.__sameDocument") is True  # the same page, never reloaded
    assert card(page, "promotions") == "1"
    page.screenshot(path=str(shots / "3-cycle-decided.png"), full_page=True)
    assert not page.errors, page.errors
    page.close()


def test_a_link_leads_to_a_jobs_events_and_metrics_chart(world, browser, shots):
    page = sign_in(browser, world.url, world.key_a)
    page.wait_for_selector(f"#jobs tr[data-testid=job] a[data-job='{world.job}']")
    page.wait_for_function(f"""[...document.querySelectorAll('#jobs tr[data-testid=job]')].some(
        r => r.textContent.includes('{world.job}') && r.textContent.includes('succeeded'))""", timeout=CYCLE_S)
    page.wait_for_selector("#live figure[data-metric=train_loss] path.line")
    page.screenshot(path=str(shots / "4-overview.png"), full_page=True)
    if os.environ.get("FLYWHEEL_UPDATE_SCREENSHOTS") == "1":
        shutil.copyfile(shots / "4-overview.png", REPO / "docs" / "dashboard.png")
    page.click(f"#jobs a[data-job='{world.job}']")
    page.wait_for_url(f"**/dashboard/jobs/{world.job}")
    page.wait_for_selector("#job:not([hidden]) #job-charts figure[data-metric=train_loss] path.line")
    assert page.inner_text("#job-title") == f"Job {world.job}"
    events = page.locator("#job-events tr[data-testid=event]").all_inner_texts()
    assert any("Step 12/12: training loss=" in e for e in events) and any("successfully completed" in e
                                                                           for e in events), events
    points = page.locator("#job-charts figure[data-metric=train_loss] circle.dot").count()
    assert points == 12  # one metrics event per step (metrics_every=1): 4 rows x 3 epochs
    page.screenshot(path=str(shots / "5-job.png"), full_page=True)
    page.click("#back")
    page.wait_for_selector("#overview:not([hidden])")
    assert not page.errors, page.errors
    page.close()


def test_tenant_b_sees_none_of_a(world, browser, shots):
    page = sign_in(browser, world.url, world.key_b)
    assert page.inner_text("#tenant") == "tenant beta"
    assert card(page, "requests") == "0" and card(page, "failures") == "0"
    assert page.inner_text("#flywheels") == "no managed flywheels"
    assert page.locator("#jobs tr[data-testid=job]").count() == 0
    html = page.content()
    assert world.job not in html and world.flywheel["id"] not in html and "alpha" not in html
    page.screenshot(path=str(shots / "6-tenant-b.png"), full_page=True)
    page.goto(world.url + f"/dashboard/jobs/{world.job}")  # alpha's job by its address: a 404 for beta
    page.wait_for_selector("#status.bad")
    assert "no fine-tuning job" in page.inner_text("#status") and page.is_hidden("#job")
    assert page.inner_text("#job-title") == ""
    page.close()


def test_a_wrong_key_is_refused_on_the_form(world, browser, shots):
    page = browser.new_page()
    page.goto(world.url + "/dashboard")
    page.fill("#key", "fw-not-a-key")
    page.click("#login-form button[type=submit]")
    page.wait_for_function("document.getElementById('login-error').textContent.length > 0")
    assert "invalid API key" in page.inner_text("#login-error") and page.is_hidden("#overview")
    page.screenshot(path=str(shots / "0-login.png"))
    page.close()
