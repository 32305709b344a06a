"""Asynchronous RL: worker processes, the staleness bound, a killed worker, a killed run."""

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from flywheel.config import RLConfig, validate
from flywheel.envs import load_env
from flywheel.models import TinySpec, build_tiny_model
from flywheel.rollout.data_order import DataOrder
from flywheel.train.metrics import read_metrics
from flywheel.train.rl import run_rl
from flywheel.errors import TrainError


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinySpec(hidden=64, layers=2, heads=4, ffn=128))


def cfg(model, out, **over):
    base = dict(model=str(model), output_dir=str(out), env={"name": "arithmetic"},
                train={"steps": 6, "groups_per_step": 2, "group_size": 4},
                sampling={"max_tokens": 4}, eval={"tasks": 8}, checkpoint={"every": 2},
                log={"progress": False}, threads=1, max_off_policy_steps=1, rollout={"workers": 1},
                # every group trains: these are tests of data order and staleness, on an untrained
                # model whose groups are all flat (dynamic sampling would discard them)
                algo={"dynamic_sampling": False})
    base.update(over)
    return validate(base, RLConfig)


def trained_tasks(out: Path) -> dict[int, list[int]]:
    """step -> task indices trained at that step (the last record wins: a resumed run retrains
    the steps after its checkpoint)."""
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    return {r["step"]: r["tasks"] for r in rows}


def expected_tasks(steps: int, per_step: int, seed: int = 0) -> dict[int, list[int]]:
    order = DataOrder(len(load_env("arithmetic").tasks("train", seed=seed)), seed)
    return {s: order.take(per_step) for s in range(1, steps + 1)}


def test_one_step_off_policy_trains_in_data_order_with_bounded_staleness(model, tmp_path):
    out = tmp_path / "run"
    run_rl(cfg(model, out), log=lambda m: None)
    train = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert all(0 <= s <= 1 for r in rows for s in r["staleness"])
    assert rows[0]["staleness"] == [0, 0]  # step 1 trains version 0's samples at version 0
    assert trained_tasks(out) == expected_tasks(6, 2)
    last = train[-1]
    assert {"mismatch_kl", "is_weight_mean", "time/rollout_wait_s", "time/train_s", "time/weight_sync_s",
            "rollout/generate_s", "rollout/weight_load_s", "rollout/kernel_rebuild_s", "buffer/dropped_groups",
            "staleness_mean", "rollout/worker_restarts"} <= set(last)
    assert sum(v for k, v in last.items() if k.startswith("buffer/staleness_")) == pytest.approx(1.0)
    assert not (out / "rollout-weights.shm").exists()  # the segment is gone with the run
    # the worker's start-up is waited for before step 1's clock, and recorded once
    assert [r["step"] for r in train if "time/startup_wait_s" in r] == [1]
    assert train[0]["time/startup_wait_s"] >= 0.0


@pytest.mark.slow  # processes killed and restarted, or the whole flow end to end: make test-all
def test_a_killed_worker_is_restarted_and_its_tasks_regenerated(model, tmp_path):
    out = tmp_path / "run"
    errors = []

    def target():
        try:
            run_rl(cfg(model, out, train={"steps": 8, "groups_per_step": 2, "group_size": 4}), log=lambda m: None)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline and not (out / "rollouts.jsonl").exists() or \
            not (out / "rollouts.jsonl").read_text().count("\n") >= 2:
        time.sleep(0.05)
    workers = _children_running("flywheel.orchestrate.worker")
    assert len(workers) == 1
    os.kill(workers[0], signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive() and not errors
    last = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r][-1]
    assert last["step"] == 8 and last["rollout/worker_restarts"] == 1.0
    assert last["rollout/duplicate_results"] == 0.0
    assert trained_tasks(out) == expected_tasks(8, 2)  # nothing lost, nothing twice


@pytest.mark.slow  # processes killed and restarted, or the whole flow end to end: make test-all
def test_sigkill_of_the_whole_run_then_resume(model, tmp_path, forked_cli):
    """The killed run (`flywheel rl`) is a session of its own, learner and worker; the resume
    runs here, from the newest checkpoint the killed run left (the kill lands once step 3's
    exists; twelve steps leave it room to land before the end)."""
    out = tmp_path / "run"
    config = tmp_path / "rl.yaml"
    raw = dict(model=str(model), output_dir=str(out), env={"name": "arithmetic"},
               train={"steps": 12, "groups_per_step": 2, "group_size": 4}, sampling={"max_tokens": 4},
               eval={"tasks": 8}, checkpoint={"every": 3, "keep": 5}, log={"progress": False}, threads=1,
               max_off_policy_steps=1, algo={"dynamic_sampling": False})
    config.write_text(json.dumps(raw))
    proc = forked_cli(["rl", config])
    deadline = time.time() + 90
    while time.time() < deadline and not (out / "checkpoints" / "step_00000003" / "trainer_state.pt").exists() \
            and proc.poll() is None:
        time.sleep(0.05)
    proc.kill_group()
    assert proc.wait() == -signal.SIGKILL, proc.output[-2000:]
    assert (out / "rollout-weights.shm").exists()  # left behind by the kill
    newest = max(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*")
                 if (p / "trainer_state.pt").exists())
    assert 3 <= newest < 12
    deadline = time.time() + 10
    while _children_running("flywheel.orchestrate.worker") and time.time() < deadline:
        time.sleep(0.05)
    assert not _children_running("flywheel.orchestrate.worker")  # workers die with the learner
    logs: list[str] = []
    run_rl(validate({**raw, "resume": True}, RLConfig), log=logs.append)
    assert any("resumed from" in m and f"(step {newest})" in m for m in logs), logs
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert steps == list(range(1, 13))  # each once: the killed run's rows past its checkpoint moved aside
    assert [r["step"] for r in read_metrics(out / "rollouts.jsonl")] == list(range(1, 13))
    assert trained_tasks(out) == expected_tasks(12, 2)


def test_async_needs_worker_processes(model, tmp_path):
    with pytest.raises(TrainError, match="rollout.workers >= 1"):
        run_rl(cfg(model, tmp_path / "x", rollout={"workers": 0}), log=lambda m: None)


def test_a_worker_that_cannot_start_is_a_clear_error(model):
    from flywheel.orchestrate import ProcessRollouts, RolloutError, WorkerSpec
    from flywheel.models import load
    from flywheel.weights import SharedMemoryTransport

    m, _ = load(model)
    transport = SharedMemoryTransport.create(dict(m.named_parameters()))
    try:
        spec = WorkerSpec(model="/no/such/model", env_name="arithmetic", env_settings={},
                          transport_name=transport.name, sampling={"max_tokens": 4}, group_size=2, threads=1)
        pool = ProcessRollouts(spec, 1, max_restarts=3, log=lambda m: None)
        try:  # what run_rl waits on before step 1 (poll() reports it the same way)
            with pytest.raises(RolloutError, match="failed to start(.|\n)*/no/such/model"):
                pool.ready()
        finally:
            pool.close()
        assert pool.restarts == 0  # a start-up failure is reported, not retried
    finally:
        transport.close()


def test_ready_waits_until_the_worker_has_started(model):
    """`ready()` returns once the worker's engine is built (what a run waits for before its step
    clock), and at once after that."""
    from flywheel.orchestrate import ProcessRollouts, WorkerSpec
    from flywheel.models import load
    from flywheel.weights import SharedMemoryTransport

    m, _ = load(model)
    transport = SharedMemoryTransport.create(dict(m.named_parameters()))
    try:
        good = WorkerSpec(model=str(model), env_name="arithmetic", env_settings={}, transport_name=transport.name,
                          sampling={"max_tokens": 4}, group_size=2, threads=1)
        pool = ProcessRollouts(good, 1, log=lambda m: None)
        try:
            assert pool.startup_s() == []
            assert pool.ready() > 0.0
            assert len(pool.startup_s()) == 1 and pool.startup_s()[0] > 0.0
            assert pool.ready() < 0.01  # nothing left to wait for
        finally:
            pool.close()
    finally:
        transport.close()


def _children_running(marker: str) -> list[int]:
    """Pids of live processes whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


def test_in_flight_updates_tag_tokens_and_keep_the_staleness_bound(model, tmp_path):
    """rollout.in_flight_updates: the worker takes newer weights between decode steps (the
    run's plumbing; whether an update lands mid-sample depends on timing, so the exactness of
    the tokens after one is test_decode_batch's). The run trains in data order with the bound
    held and reports the tokens sampled after an update."""
    out = tmp_path / "run"
    run_rl(cfg(model, out, sampling={"max_tokens": 24}, train={"steps": 8, "groups_per_step": 2, "group_size": 8},
               rollout={"workers": 1, "in_flight_updates": True}), log=lambda m: None)
    train = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]
    assert [r["step"] for r in train] == list(range(1, 9))
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert all(0 <= s <= 1 for r in rows for s in r["staleness"])
    assert trained_tasks(out) == expected_tasks(8, 2)
    assert all("rollout/in_flight_tokens" in r for r in train)
    with pytest.raises(TrainError, match="in_flight_updates needs rollout worker processes"):
        run_rl(cfg(model, tmp_path / "x", max_off_policy_steps=0, rollout={"workers": 0, "in_flight_updates": True}),
               log=lambda m: None)
