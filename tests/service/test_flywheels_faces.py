"""Managed flywheels through their faces, the SDK (`Flywheel`, `AsyncFlywheel`) and the CLI
(`flywheel flywheels ...`), against a real server on loopback with no worker, so that a cycle
started stays queued: create, retrieve, list, start a cycle (a second one is refused while it is
unfinished), list cycles, and the server's refusals (nothing to roll back, a bad field) arriving
with its message and the field named."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.client import AsyncFlywheel, Flywheel, FlywheelCycle, FlywheelError, ManagedFlywheel
from flywheel.jobs import JobStore
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.serve import OpenAIService, open_trace_sink
from flywheel.serve.app import create_app
from flywheel.serve.background import BackgroundServer
from flywheel.finetuning.fine_tuning import FineTuning

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
QUIET = {"trigger": {"min_new_failures": 10_000}}  # no trace arrives; the trigger never starts a cycle


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("faces")
    base = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64, max_positions=512))
    store = JobStore(data_file_url(root), root / "files")
    ft = FineTuning(store, {"tiny": base})
    sink = open_trace_sink(f"sqlite:///{root / 'traces.db'}")
    service = OpenAIService(base, name="tiny", default_max_tokens=8, trace_sink=sink)
    server = BackgroundServer(create_app(service, fine_tuning=ft, trace_store=sink.store,
                                         flywheel_poll_s=0.4)).start()
    yield server
    server.stop()
    service.close()
    store.close()


def test_the_sdk_creates_lists_cycles_and_reports_refusals(srv):
    with Flywheel(srv.url, max_retries=0) as fw:
        made = fw.flywheels.create(model="tiny", suffix="sdk", gate={"delta": 0.1}, budget_usd=1.5,
                                   metadata={"team": "a"}, **QUIET)
        assert isinstance(made, ManagedFlywheel) and made.id.startswith("fw")
        assert made.production_model == "ft:tiny:default:sdk:production" and made.production_version == "v1"
        assert made.gate["delta"] == 0.1 and made.gate["epsilon"] == 0.02  # the rest: the server's defaults
        assert made.budget_usd == 1.5 and made.metadata == {"team": "a"} and made.status == "active"
        got = fw.flywheels.retrieve(made.id)
        assert got.raw == made.raw
        assert made.id in [f.id for f in fw.flywheels.list()]
        assert len(fw.flywheels.list(limit=1)) == 1

        cycle = fw.flywheels.run_cycle(made.id)
        assert isinstance(cycle, FlywheelCycle) and cycle.flywheel_id == made.id and cycle.number == 1
        assert cycle.status == "queued" and cycle.fine_tuning_job_id.startswith("ftjob")
        assert cycle.outcome is None and cycle.reasons == [] and not cycle.done
        assert fw.jobs.get(cycle.fine_tuning_job_id).status == "queued"  # no worker: it stays queued
        with pytest.raises(FlywheelError) as again:
            fw.flywheels.run_cycle(made.id)
        assert again.value.status == 409 and "has a cycle that has not finished" in again.value.message
        assert [c.id for c in fw.flywheels.cycles(made.id)] == [cycle.id]

        with pytest.raises(FlywheelError) as back:
            fw.flywheels.rollback(made.id)
        assert back.value.status == 409 and "nothing to roll back to" in back.value.message
        with pytest.raises(FlywheelError) as bad:
            fw.flywheels.create(model="tiny", suffix="bad", gate={"delta": 2})
        assert bad.value.status == 400 and bad.value.param == "gate.delta" and "gate.delta" in str(bad.value)
        with pytest.raises(FlywheelError) as missing:
            fw.flywheels.retrieve("fw-nope")
        assert missing.value.status == 404

    async def from_async():
        async with AsyncFlywheel(srv.url, max_retries=0) as afw:
            return await afw.flywheels.retrieve(made.id), await afw.flywheels.cycles(made.id)

    got, cycles = asyncio.run(from_async())
    assert got.id == made.id and [c.id for c in cycles] == [cycle.id]


def test_the_cli_creates_shows_runs_and_refuses(srv, tmp_path):
    run = CliRunner().invoke
    url = ["--base-url", srv.url]
    config = tmp_path / "flywheel.yaml"
    config.write_text("training:\n  sft: {steps: 3}\ntrigger:\n  min_new_failures: 10000\n"
                      "eval:\n  suites:\n    add: {env: arithmetic, tasks: 4}\n")
    made = run(app, ["flywheels", "create", "--model", "tiny", "--suffix", "cli", "--config", str(config),
                     "--order", "sft,rl", "--lora-rank", "4", "--budget-usd", "2", "--delta", "0.1", *url])
    assert made.exit_code == 0, made.output
    fw_id, alias = made.output.split()
    assert alias == "ft:tiny:default:cli:production"
    shown = json.loads(run(app, ["flywheels", "show", fw_id, *url]).output)
    assert shown["training"]["order"] == ["sft", "rl"] and shown["training"]["sft"]["steps"] == 3
    assert shown["training"]["lora"]["rank"] == 4 and shown["trigger"]["min_new_failures"] == 10_000
    assert shown["gate"]["delta"] == 0.1 and shown["budget_usd"] == 2 and "add" in shown["eval"]["suites"]
    listed = run(app, ["flywheels", "list", *url])
    assert listed.exit_code == 0 and f"{fw_id}  active  tiny  {alias}  v1" in listed.output

    started = run(app, ["flywheels", "run", fw_id, *url])
    assert started.exit_code == 0 and " 1 queued ftjob" in started.output.replace("  ", " "), started.output
    again = run(app, ["flywheels", "run", fw_id, *url])
    assert again.exit_code == 1 and "has a cycle that has not finished" in again.output
    table = run(app, ["flywheels", "cycles", fw_id, *url])
    assert table.exit_code == 0, table.output
    header, row = table.output.splitlines()
    assert header.split() == ["#", "status", "outcome", "reason", "version", "cost", "gate"]
    assert row.split()[:3] == ["1", "queued", "-"] and "requested through the API" in row
    back = run(app, ["flywheels", "rollback", fw_id, *url])
    assert back.exit_code == 1 and "nothing to roll back to" in back.output

    bad = tmp_path / "bad.yaml"
    bad.write_text("trigger:\n  min_new_failures: 10000\ngate:\n  epsilon: 0.1\n  delta: 2\n")
    refused = run(app, ["flywheels", "create", "--model", "tiny", "--suffix", "bad", "--config", str(bad), *url])
    assert refused.exit_code == 1 and f"{bad}: line 5:" in refused.output and "(param: gate.delta)" in refused.output
    flagged = run(app, ["flywheels", "create", "--model", "tiny", "--suffix", "bad", "--epsilon", "3", *url])
    assert flagged.exit_code == 1 and "(param: gate.epsilon)" in flagged.output and "line" not in flagged.output
    as_json = tmp_path / "bad.json"
    as_json.write_text('{"model": "tiny",\n "suffix": "bad",\n "training": {"order": ["sft", "ppo"]}}')
    refused = run(app, ["flywheels", "create", "--config", str(as_json), *url])
    assert refused.exit_code == 1 and f"{as_json}: line 3:" in refused.output and "training.order" in refused.output

    broken = tmp_path / "broken.yaml"
    broken.write_text("gate:\n  delta: [0.1\ntrigger: {}\n")
    unread = run(app, ["flywheels", "create", "--model", "tiny", "--config", str(broken), *url])
    assert unread.exit_code == 2 and f"{broken}: line" in unread.output and "invalid YAML" in unread.output
    unread = run(app, ["flywheels", "create", "--model", "tiny", "--config", str(tmp_path / "absent.yaml"), *url])
    assert unread.exit_code == 2 and f"{tmp_path / 'absent.yaml'}: cannot read it" in unread.output
    broken = tmp_path / "broken.json"
    broken.write_text('{"gate":\n {"delta": 0.1,}}')
    unread = run(app, ["flywheels", "create", "--model", "tiny", "--config", str(broken), *url])
    assert unread.exit_code == 2 and f"{broken}: line 2: invalid JSON" in unread.output
    listy = tmp_path / "list.yaml"
    listy.write_text("- model: tiny\n")
    assert "the top level must be a mapping" in run(app, ["flywheels", "create", "--config", str(listy), *url]).output
    both = run(app, ["flywheels", "create", "--model", "tiny", "--lora-rank", "4", "--full", *url])
    assert both.exit_code == 2 and "choose one" in both.output
    assert run(app, ["flywheels", "create", *url]).exit_code == 2  # no model anywhere
