"""`rollout.backend: ray` on a two-node cluster simulated on this machine (Ray's own cluster
utilities: a head node and a second node that alone has the custom resource `env_cpu`):
environment actors land on the env-labelled node and the run says so; arithmetic GRPO on Ray
lands in the same held-out accuracy band as on local processes with the same seed and steps;
a rollout actor and an environment actor killed mid-run (in-flight updates on) lose no step
and train no task twice;
a run whose driver is killed resumes exactly."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from flywheel.config import RLConfig, validate
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.metrics import read_metrics
from flywheel.train.rl import run_rl

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from test_rl_async import expected_tasks, trained_tasks  # noqa: E402  (tests/integration is on sys.path)

pytestmark = pytest.mark.slow  # a Ray cluster per module, RL runs: make test-all


def each_once(out: Path, steps: int, per_step: int) -> None:
    """Nothing lost, nothing twice: every task trained at most once, `per_step` a step, drawn
    from the front of the data order; and each task of the first `steps` steps either trained
    or still due (the final checkpoint's untrained tasks). With two actors and one step
    off-policy a step takes whichever fresh groups arrive first, so a task may move to a
    neighbouring step (as with two local worker processes), and one sent again after a
    failure comes back later still."""
    from flywheel.train.checkpoint import load_state

    trained = trained_tasks(out)
    assert sorted(trained) == list(range(1, steps + 1))
    assert all(len(tasks) == per_step for tasks in trained.values())
    got = [t for tasks in trained.values() for t in tasks]
    assert len(set(got)) == len(got), "a task trained twice"
    front = [t for tasks in expected_tasks(steps + 3, per_step).values() for t in tasks]
    assert set(got) <= set(front)
    final = sorted((out / "checkpoints").iterdir())[-1]
    due = set(load_state(final)["feeder"]["untrained"])
    assert set(front[:steps * per_step]) <= set(got) | due, "a task lost"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                      "resources": {"learner_node": 2}})
    env_node = c.add_node(num_cpus=2, resources={"env_cpu": 2})
    ray.init(address=c.address, namespace="flywheel-tests")
    c.wait_for_nodes()
    try:
        yield c, env_node.node_id
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinySpec(hidden=64, layers=2, heads=4, ffn=128))


def ray_config(model, out: Path, address: str | None = None, rollout_on: str = "learner_node", **over) -> dict:
    """Two rollout actors on the node holding `rollout_on` (learner_node: the head, where they
    read the shared-memory segment; env_cpu: the other node, where they read the object
    store) and two environment actors on the env_cpu node."""
    raw = dict(model=str(model), output_dir=str(out), env={"name": "arithmetic"},
               train={"steps": 6, "groups_per_step": 2, "group_size": 4}, sampling={"max_tokens": 4},
               eval={"tasks": 8}, checkpoint={"every": 2, "keep": 5}, log={"progress": False}, threads=1,
               max_off_policy_steps=1,
               algo={"dynamic_sampling": False},  # every group trains: an untrained model's are all flat
               rollout={"workers": 2, "backend": "ray", "ray": {
                   "address": address, "worker_cpus": 0.5, "worker_resources": {rollout_on: 0.5},
                   "env_actors": 2, "env_cpus": 0.5, "env_resources": {"env_cpu": 0.5}}})
    raw.update(over)
    return raw


def test_env_actors_run_on_the_env_node_and_the_run_says_where(cluster, model, tmp_path):
    """Rollout actors on the env node too: off the learner's node, they read the object store
    (in-flight updates on: from the board, between decode steps)."""
    _, env_node = cluster
    out = tmp_path / "run"
    logs: list[str] = []
    raw = ray_config(model, out, rollout_on="env_cpu")
    raw["rollout"]["in_flight_updates"] = True
    result = run_rl(validate(raw, RLConfig), log=logs.append)
    assert result.steps == 6 and result.final_model is not None
    placement = json.loads((out / "placement.json").read_text())
    assert [a["node_id"] for a in placement["env"]] == [env_node, env_node]
    assert all(a["resources"].get("env_cpu") == 0.5 for a in placement["env"])
    assert [(a["node_id"], a["weights"]) for a in placement["rollout"]] == [(env_node, "object_store")] * 2
    assert placement["learner"][0]["pid"] == os.getpid()
    assert sum("ray: env actor" in m and env_node[:12] in m for m in logs) == 2, logs
    each_once(out, 6, 2)
    rows = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert all(0 <= s <= 1 for r in rows for s in r["staleness"])  # the staleness bound holds


def test_killed_rollout_and_env_actors_lose_no_step(cluster, model, tmp_path):
    out = tmp_path / "run"
    errors: list[Exception] = []

    def target():
        try:
            raw = ray_config(model, out, train={"steps": 10, "groups_per_step": 2, "group_size": 4})
            raw["rollout"]["in_flight_updates"] = True  # the actors on the learner's node take them
            run_rl(validate(raw, RLConfig), log=lambda m: None)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "rollouts.jsonl").exists() or \
            (out / "rollouts.jsonl").read_text().count("\n") < 2:
        time.sleep(0.05)
    placement = json.loads((out / "placement.json").read_text())
    assert [a["weights"] for a in placement["rollout"]] == ["shared_memory"] * 2  # on the learner's node
    os.kill(placement["rollout"][0]["pid"], signal.SIGKILL)
    os.kill(placement["env"][1]["pid"], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive() and not errors, errors
    last = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r][-1]
    assert last["step"] == 10
    assert last["rollout/worker_restarts"] >= 1 and last["rollout/env_restarts"] == 1
    assert last["rollout/duplicate_results"] == 0.0
    each_once(out, 10, 2)  # nothing lost, nothing twice


def test_the_run_resumes_exactly_after_its_driver_is_killed(cluster, model, tmp_path, forked_cli):
    c, _ = cluster
    out = tmp_path / "run"
    raw = ray_config(model, out, address=c.address, checkpoint={"every": 3, "keep": 5})
    config = tmp_path / "rl.yaml"
    config.write_text(json.dumps(raw))
    proc = forked_cli(["rl", config])
    deadline = time.time() + 180
    while time.time() < deadline and not (out / "checkpoints" / "step_00000003" / "trainer_state.pt").exists() \
            and proc.poll() is None:
        time.sleep(0.05)
    proc.kill_group()
    assert proc.wait() == -signal.SIGKILL, proc.output[-2000:]
    logs: list[str] = []
    run_rl(validate({**raw, "resume": True}, RLConfig), log=logs.append)
    assert any("resumed from" in m and "step 3" in m for m in logs), logs
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r] == list(range(1, 7))
    each_once(out, 6, 2)


def test_grpo_on_ray_lands_in_the_band_of_local_processes(cluster, arith_warm_start, tmp_path):
    """The same learning run (seed, steps, one step off-policy, one rollout worker) on both
    backends: each lifts held-out accuracy by >= 10 points, and they end within 10 points.
    60 steps: at 40 the Ray run's lift was 9.5 to 14.5 points on 200 tasks (its groups depend
    on timing), too near the bar when the suite loads the machine."""
    finals = {}
    for backend in ("local", "ray"):
        cfg = validate(dict(
            model=str(arith_warm_start), output_dir=str(tmp_path / backend), env={"name": "arithmetic"},
            train={"steps": 60, "groups_per_step": 8, "group_size": 8, "seed": 0},
            sampling={"temperature": 1.0, "max_tokens": 6}, optim={"lr": 1e-4},
            eval={"tasks": 200}, log={"progress": False}, threads=2, max_off_policy_steps=1,
            rollout={"workers": 1, "backend": backend}), RLConfig)
        result = run_rl(cfg, log=lambda m: None)
        before, after = result.evals[0]["eval/greedy_accuracy"], result.evals[-1]["eval/greedy_accuracy"]
        print(f"{backend}: held-out accuracy {before:.3f} -> {after:.3f} in {result.steps} steps")
        assert after >= before + 0.10, (backend, before, after)
        finals[backend] = after
    assert abs(finals["ray"] - finals["local"]) <= 0.10, finals


def test_the_learner_runs_as_ray_actors_where_its_resources_say(cluster, model, tmp_path):
    """`rollout.ray.learner: actors` with two FSDP2 ranks placed on the env node (by the
    env_cpu resource) while rollouts run on the head: placement.json says so; a learner actor
    SIGKILLed after the first checkpoint stops the run naming its rank, and resume=true ends
    it with nothing lost and nothing trained twice."""
    _, env_node = cluster
    out = tmp_path / "run"
    raw = ray_config(model, out, train={"steps": 8, "groups_per_step": 2, "group_size": 4, "strategy": "fsdp2",
                                        "world_size": 2})
    raw["rollout"]["ray"].update(learner="actors", learner_cpus=0.5, learner_resources={"env_cpu": 0.25})
    failure: list[BaseException] = []

    def target():
        try:
            run_rl(validate(raw, RLConfig), log=lambda m: None)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            failure.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.time() + 180
    while time.time() < deadline and not (out / "checkpoints").exists() and thread.is_alive():
        time.sleep(0.05)
    placement = json.loads((out / "placement.json").read_text())
    assert [(a["rank"], a["node_id"]) for a in placement["learner"]] == [(0, env_node), (1, env_node)]
    assert all(a["resources"].get("env_cpu") == 0.25 for a in placement["learner"])
    assert all(a["node_id"] != env_node for a in placement["rollout"])
    os.kill(placement["learner"][1]["pid"], signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert failure and "learner rank 1" in str(failure[0]), failure
    assert not (out / "final").exists()
    logs: list[str] = []
    result = run_rl(validate({**raw, "resume": True}, RLConfig), log=logs.append)
    assert result.steps == 8 and result.final_model is not None
    assert any("resumed from" in m for m in logs), logs
    each_once(out, 8, 2)


def test_board_weights_take_a_newer_version_between_decode_steps_without_waiting(cluster, model):
    """BoardWeights (actors off the learner's node, in-flight updates): a step with nothing newer
    on the board neither waits nor loads; once a version is published the next step loads it."""
    from flywheel.inference import LocalEngine
    from flywheel.models import load
    from flywheel.orchestrate.ray_rollouts import BoardWeights, WeightBoard, to_arrays

    net, tok = load(str(model))
    engine = LocalEngine(net, tok, version=-1)
    board = WeightBoard.remote()
    weights = BoardWeights(board, engine, in_flight=True)
    assert engine.between_steps == weights.take_if_published
    v0 = {k: v.detach().clone() for k, v in net.named_parameters()}
    ray.get(board.set.remote(0, [ray.put(to_arrays(v0))]))
    wait_s, _ = weights.take(0)
    assert engine.version == 0
    started = time.perf_counter()
    for _ in range(3):
        engine.between_steps()
    assert engine.version == 0 and time.perf_counter() - started < 1.0
    v1 = {k: v + 0.5 for k, v in v0.items()}
    ray.get(board.set.remote(1, [ray.put(to_arrays(v1))]))
    deadline = time.time() + 10
    while engine.version == 0 and time.time() < deadline:
        engine.between_steps()
        time.sleep(0.01)
    assert engine.version == 1
    name = next(iter(v1))
    assert torch.equal(dict(net.named_parameters())[name].detach(), v1[name])
    ray.kill(board)


def test_weights_by_broadcast_reach_actors_on_another_node_and_survive_a_death(cluster, model, tmp_path):
    """`rollout.ray.weights: broadcast`: one gloo group from the driver to two rollout actors on
    the other node (in-flight updates on); one actor SIGKILLed mid-run is replaced, the group
    formed again with it, and the run ends with nothing lost and nothing trained twice."""
    _, env_node = cluster
    out = tmp_path / "run"
    raw = ray_config(model, out, rollout_on="env_cpu", train={"steps": 10, "groups_per_step": 2, "group_size": 4})
    raw["rollout"]["in_flight_updates"] = True
    raw["rollout"]["ray"]["weights"] = "broadcast"
    logs: list[str] = []
    errors: list[BaseException] = []

    def target():
        try:
            run_rl(validate(raw, RLConfig), log=logs.append)
        except BaseException as e:  # noqa: BLE001 - the test reads it
            errors.append(e)

    thread = threading.Thread(target=target)
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline and (not (out / "rollouts.jsonl").exists()
                                      or (out / "rollouts.jsonl").read_text().count("\n") < 3):
        time.sleep(0.05)
    placement = json.loads((out / "placement.json").read_text())
    assert [(a["weights"], a["node_id"]) for a in placement["rollout"]] == [("broadcast", env_node)] * 2
    os.kill(placement["rollout"][1]["pid"], signal.SIGKILL)
    thread.join(timeout=300)
    assert not thread.is_alive() and not errors, errors
    last = [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r][-1]
    assert last["step"] == 10 and last["rollout/worker_restarts"] >= 1
    assert last["rollout/duplicate_results"] == 0.0
    each_once(out, 10, 2)
    assert any("rollout actor 1 died" in m for m in logs), logs
