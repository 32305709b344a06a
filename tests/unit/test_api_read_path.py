"""The fine-tuning API's hot reads stay on the event loop (docs/benchmarks.md, bench/api.py):
its dependencies are coroutines (FastAPI runs a plain `def` one in its thread pool), page reads
of a SQLite store run without a thread, and servers run asyncio's loop, not uvloop."""

from __future__ import annotations

import asyncio
import inspect

import pytest
from fastapi.testclient import TestClient

from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.jobs import JobStore
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve import deps, finetune_routes
from flywheel.serve.app import create_app
from flywheel.serve.background import EVENT_LOOP, BackgroundServer
from flywheel.serve.core import OpenAIService


def test_every_dependency_is_a_coroutine():
    for dep in (deps.tenant_of_request, deps.service_of_app, deps.fine_tuning_of_app, deps.webhooks_of_app,
                deps.flywheels_of_app):
        assert inspect.iscoroutinefunction(dep), f"{dep.__name__} would run in FastAPI's thread pool"


def test_servers_run_asyncios_loop():
    assert EVENT_LOOP == "asyncio"
    assert BackgroundServer(lambda *a: None).server.config.loop == "asyncio"


@pytest.fixture()
def client(tmp_path, monkeypatch):
    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    service = OpenAIService(base, name="tiny", default_max_tokens=8)
    with TestClient(create_app(service, fine_tuning=FineTuning(store, {"tiny": base}))) as c:
        yield c, store
    service.close()
    store.close()


def test_sqlite_page_reads_take_no_thread(client, monkeypatch):
    c, store = client
    assert store.reads_inline

    async def no_thread(*args, **kwargs):
        raise AssertionError("a page read went to a thread")

    monkeypatch.setattr(finetune_routes.asyncio, "to_thread", no_thread)
    assert c.get("/v1/fine_tuning/jobs?limit=20").json()["data"] == []
    missing = c.get("/v1/fine_tuning/jobs/ftjob-nope")  # the store's refusal, answered inline
    assert missing.status_code == 404 and "ftjob-nope" in missing.json()["error"]["message"]
    assert c.get("/v1/fine_tuning/jobs/ftjob-nope/events").status_code == 404
    # a metadata-filtered listing reads up to 1,000 rows: that one goes to a thread
    with pytest.raises(AssertionError, match="went to a thread"):
        c.get("/v1/fine_tuning/jobs?metadata[team]=a")
    assert asyncio.iscoroutinefunction(finetune_routes.read)
