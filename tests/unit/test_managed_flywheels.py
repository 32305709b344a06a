"""The parts of managed flywheels below the HTTP face: the request's refusals name the field;
the request becomes the loop config a cycle runs; a flywheel has at most one unfinished cycle;
the trigger queues a cycle once enough failures of its own scope arrive (and counts afresh
after production moves); an alias switches only once its new target loaded, and stays where
it was when the target does not load."""

from __future__ import annotations

import pytest

from flywheel.jobs import JobStore
from flywheel.jobs.flywheel_request import FlywheelRequest, FlywheelSpec
from flywheel.jobs.flywheels import Flywheels
from flywheel.jobs.requests import RequestError
from flywheel.jobs.store import data_file_url
from flywheel.loop.loop_config import check_stages
from flywheel.finetuning.managed_config import managed_config
from flywheel.serve.aliases import ProductionAliases
from flywheel.finetuning.flywheel_trigger import FlywheelTrigger
from flywheel.traces import TraceStore


@pytest.mark.parametrize("body, param, words", [
    ({}, "model", "Field required"),
    ({"model": "m", "suffix": "a b"}, "suffix", "pattern"),
    ({"model": "m", "gate": {"delta": 2}}, "gate.delta", "less than or equal to 1"),
    ({"model": "m", "training": {"order": ["ppo"]}}, "training.order.0", "'sft'"),
    ({"model": "m", "training": {"sft": {"data": "/etc/passwd"}}}, "training.sft.data", "Extra inputs"),
    ({"model": "m", "eval": {"suites": {"s": {"env": "evil.py:load"}}}}, "eval.suites.s.env", "built-in"),
    ({"model": "m", "eval": {"suites": {"s": {"env": "arithmetic", "settings": {"path": "/etc"}}}}},
     "eval.suites.s.settings", "short names"),
    ({"model": "m", "trigger": {"every_seconds": 1}}, "trigger.every_seconds", "greater than or equal to 60"),
    ({"model": "m", "anchor_data": ["x"]}, "anchor_data", "Extra inputs"),
    ({"model": "m", "eval": {"suites": {"s": {"file": "file-1"}}}}, "eval.suites.s", "needs its grader"),
    ({"model": "m", "eval": {"suites": {"new_failures": {"env": "arithmetic"}}}}, "eval.suites", "new-failure suite"),
    ({"model": "m", "curation": {"fail_below": 2, "pass_at": 0.1}}, "curation", "must not exceed"),
    ({"model": "m", "curation": {"failure_labels": ["Bad"], "success_labels": ["bad"]}}, "curation", "both"),
    ({"model": "m", "training": {"lora": {"rank": 0}}}, "training.lora.rank", "greater than or equal to 1"),
    ({"model": "m", "eval": {"suites": {"s": {"env": "arithmetic", "file": "file-1", "grader": {}}}}},
     "eval.suites.s", "not both"),
])
def test_bad_requests_name_the_field(body, param, words):
    with pytest.raises(RequestError) as info:
        FlywheelRequest.parse(body)
    assert info.value.param == param and words in str(info.value), (info.value.param, str(info.value))


def test_the_request_becomes_the_loop_config_a_cycle_runs():
    spec = FlywheelRequest.parse({"model": "m", "training": {"order": ["sft", "rl"], "rl": {"batch_size": 2}},
                                  "gate": {"min_new_failures": 50}, "budget_usd": 0.5,
                                  "eval": {"suites": {"add": {"env": "arithmetic", "tasks": 10}}}}).spec()
    cfg = managed_config(spec, data_dir="/d", traces_url="sqlite:///t.db", hardware="cpu-2core")
    check_stages(cfg)
    assert cfg.train.order == ["sft", "rl"] and cfg.train.max_usd == 0.5 and cfg.serve.enabled is False
    assert cfg.train.sft.train.lora.rank == 16  # LoRA by default, at ten times the full rate
    assert cfg.train.sft.optim.lr == pytest.approx(1e-3) and cfg.train.rl.optim.lr == pytest.approx(1e-4)
    assert cfg.train.rl.train.groups_per_step == 2
    assert cfg.eval.new_failures_max == 200 and cfg.eval.suites["add"].tasks == 10
    graded = FlywheelSpec.model_validate({**spec.model_dump(), "eval": {"suites": {"house": {
        "file": "file-1", "grader": {"type": "string_check"}, "tasks": 5, "path": "/data/files/file-1.jsonl"}}}})
    suite = managed_config(graded, data_dir="/d", traces_url="sqlite:///t.db", hardware="cpu-2core").eval.suites["house"]
    assert suite.env == "flywheel.envs.graded:load" and suite.tasks == 5
    assert suite.settings == {"train": "/data/files/file-1.jsonl", "test": "/data/files/file-1.jsonl",
                              "grader": {"type": "string_check"}}
    full = managed_config(spec.model_copy(update={"training": spec.training.model_copy(update={"lora": "full"})}),
                          data_dir="/d",
                          traces_url="sqlite:///t.db", hardware="cpu-2core")
    assert full.train.sft.train.lora is None and full.train.sft.optim.lr == pytest.approx(1e-4)


@pytest.fixture
def stores(tmp_path):
    jobs = JobStore(data_file_url(tmp_path), tmp_path / "files")
    traces = TraceStore(f"sqlite:///{tmp_path / 'traces.db'}")
    yield Flywheels(jobs.engine), jobs, traces
    traces.close()
    jobs.close()


def _flywheel(flywheels: Flywheels, tenant: str = "acme", min_new_failures: int = 3):
    spec = FlywheelRequest.parse({"model": "tiny", "trigger": {"min_new_failures": min_new_failures}}).spec()
    spec.initial_version, spec.trace_models = "v1", ["ft:tiny:acme:x:production"]
    return flywheels.create(tenant, model="tiny", suffix="x", alias=f"ft:tiny:{tenant}:x:production",
                            spec=spec.model_dump(mode="json"),
                            data_dir="/unused", traces_url="sqlite://", production_model="tiny",
                            production_version="v1", cursor=0)


def test_a_flywheel_has_at_most_one_unfinished_cycle(stores):
    flywheels, jobs, _ = stores
    fw = _flywheel(flywheels)
    first = flywheels.queue_cycle(fw["id"], "by hand")
    assert first["number"] == 1 and first["job_status"] == "queued"
    job = jobs.get_job("acme", first["job_id"])
    assert job["method"]["type"] == "flywheel" and job["training_file"] is None
    assert flywheels.queue_cycle(fw["id"], "again") is None  # the first is unfinished
    jobs.cancel("acme", first["job_id"])
    assert flywheels.queue_cycle(fw["id"], "after it ended")["number"] == 2


def test_failed_cycles_in_a_row_and_a_cycle_models_deletion_refused(stores):
    from flywheel.jobs.store import Conflict
    from flywheel.jobs.tables import JobRow
    from sqlalchemy import update

    flywheels, jobs, _ = stores
    fw = _flywheel(flywheels)
    assert flywheels.failed_in_a_row(fw["id"]) == 0
    for status in ("succeeded", "failed", "failed"):
        cycle = flywheels.queue_cycle(fw["id"], "test")
        with jobs.engine.begin() as conn:
            conn.execute(update(JobRow).where(JobRow.id == cycle["job_id"]).values(
                status=status, fine_tuned_model=f"ft:{cycle['job_id']}", model_path="/registry/models/v2"))
    assert flywheels.failed_in_a_row(fw["id"]) == 2
    with pytest.raises(Conflict, match="roll the flywheel back instead"):  # its folder is a registry version
        jobs.delete_model("acme", f"ft:{cycle['job_id']}")


def _failures(traces: TraceStore, tenant: str, model: str, n: int, start: int) -> None:
    traces.add_traces([{"id": f"{tenant}-{model}-{i}", "model": model, "messages": [{"role": "user", "content": "q"}],
                        "response": {"role": "assistant", "content": "a"}} for i in range(start, start + n)],
                      tenant=tenant)
    for i in range(start, start + n):
        traces.add_feedback(f"{tenant}-{model}-{i}", {"score": 0.0}, tenant=tenant)


def test_the_trigger_counts_only_its_scope_and_starts_once(stores):
    flywheels, jobs, traces = stores
    fw = _flywheel(flywheels)
    trigger = FlywheelTrigger(flywheels, traces)
    alias = fw["alias"]
    _failures(traces, "beta", alias, 5, 0)  # another tenant naming the alias
    _failures(traces, "acme", "other", 5, 0)  # the tenant's other model
    _failures(traces, "acme", alias, 2, 0)
    assert trigger.poll() == []
    _failures(traces, "acme", alias, 1, 2)
    assert trigger.poll() == [fw["id"]]
    assert trigger.poll() == []  # its cycle has not finished
    [cycle] = flywheels.cycles("acme", fw["id"])
    assert cycle["reason"].startswith("3 new failures")
    jobs.cancel("acme", cycle["job_id"])
    flywheels.set_cursor(fw["id"], traces.max_seq())  # what a finished cycle read
    assert trigger.poll() == []  # the old failures are behind the cursor
    _failures(traces, "acme", alias, 3, 3)
    assert trigger.poll() == [fw["id"]]


def test_an_alias_switches_after_its_target_loads_and_not_when_it_fails(stores):
    flywheels, _, _ = stores
    fw = _flywheel(flywheels)
    loads, broken = [], set()

    def warm(tenant, model):
        if model in broken:
            raise RuntimeError("cannot load")
        loads.append((tenant, model))

    aliases = ProductionAliases(flywheels, warm)
    assert aliases("acme", fw["alias"]) == "tiny"  # a new flywheel: looked up when first asked
    assert aliases("beta", fw["alias"]) is None and aliases("acme", "tiny") is None
    flywheels.set_production(fw["id"], "ft:tiny:acme:x:job1", "v2", 10)
    assert aliases("acme", fw["alias"]) == "tiny"  # not before the next refresh
    aliases.refresh()
    assert loads == [("acme", "ft:tiny:acme:x:job1")] and aliases("acme", fw["alias"]) == "ft:tiny:acme:x:job1"
    broken.add("ft:tiny:acme:x:job2")
    flywheels.set_production(fw["id"], "ft:tiny:acme:x:job2", "v3", 11)
    aliases.refresh()
    assert aliases("acme", fw["alias"]) == "ft:tiny:acme:x:job1"  # still what works
    broken.clear()
    aliases.refresh()
    assert aliases("acme", fw["alias"]) == "ft:tiny:acme:x:job2"
