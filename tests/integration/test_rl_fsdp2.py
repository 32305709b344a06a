"""A whole RL run under `train.strategy: fsdp2` (two gloo ranks in local processes, driven by
run_rl through train/learner/group.py): it follows the single-process run step for step, a
SIGKILLed rank stops the run with its name and the run resumes, and what the sharded learner
does not run is refused before any rank starts.

The environment rewards the share of digits in a completion, so an untrained tiny model gets
rewards that differ within a group and every step moves the weights."""

from __future__ import annotations

import json
import os

import pytest
import torch

from flywheel.config import RLConfig, validate
from flywheel.errors import TrainError
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.train.metrics import read_metrics
from flywheel.train.rl import run_rl

from test_fsdp2 import kill_rank_1_after_a_checkpoint  # noqa: E402  (tests/integration is on sys.path)

DIGITS_ENV = '''
from flywheel.envs.arithmetic import ArithmeticEnvironment
from flywheel.envs.rubric import RewardFn, Rubric


def digit_share(state):
    text = state.final_text
    return sum(c.isdigit() for c in text) / max(1, len(text))


class DigitShare(ArithmeticEnvironment):
    def __init__(self):
        super().__init__()
        self.rubric = Rubric([RewardFn(digit_share, name="digits", inline=True)])


def load():
    return DigitShare()
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_fsdp2")
    (root / "digits_env.py").write_text(DIGITS_ENV)
    model = build_tiny_model(root / "model", TinySpec(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64))
    return root, model


@pytest.fixture(autouse=True)
def env_on_path(setup, monkeypatch):
    root, _ = setup
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))


def cfg(model, out, **over):
    raw = dict(model=str(model), output_dir=str(out), env={"name": "digits_env:load"},
               train={"steps": 4, "groups_per_step": 2, "group_size": 4}, sampling={"max_tokens": 6},
               optim={"lr": 1e-3}, eval={"tasks": 8}, checkpoint={"every": 2}, log={"progress": False},
               threads=1)
    for k, v in over.items():
        raw[k] = {**raw.get(k, {}), **v} if isinstance(v, dict) else v
    return validate(raw, RLConfig)


def params(folder) -> dict[str, torch.Tensor]:
    model, _ = load(str(folder))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow  # a whole RL run over two ranks (~13 s); the two-rank update itself stays in make test (test_fsdp2.py)
def test_an_fsdp2_run_follows_the_single_process_run(setup, tmp_path):
    """Synchronous (rollouts in the driver): the same rollouts step for step, so the same tasks
    and rewards, parameters within float noise, and the single-process checkpoint format."""
    _, model = setup
    single = run_rl(cfg(model, tmp_path / "single"), log=lambda m: None)
    logs: list[str] = []
    sharded = run_rl(cfg(model, tmp_path / "fsdp2", train={"strategy": "fsdp2", "world_size": 2}), log=logs.append)
    assert sharded.steps == 4 and sharded.final_model is not None
    rows = [(tmp_path / r / "rollouts.jsonl").read_text() for r in ("single", "fsdp2")]
    assert rows[0] == rows[1]  # tasks, rewards and staleness of every step
    assert len({r for line in rows[0].splitlines() for g in json.loads(line)["rewards"] for r in g}) > 2
    start, a, b = params(model), params(single.final_model), params(sharded.final_model)
    moved = max(float((a[k] - start[k]).abs().max()) for k in a)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"RL run, 2 ranks vs 1: max |dparam| {worst:.3g}, moved {moved:.3g}")
    assert moved > 1e-3 and worst < 1e-5, (moved, worst)
    m1, m2 = (read_metrics(tmp_path / r / "metrics.jsonl") for r in ("single", "fsdp2"))
    for r1, r2 in zip((r for r in m1 if "loss" in r), (r for r in m2 if "loss" in r)):
        assert r1["trained_tokens"] == r2["trained_tokens"] and abs(r1["loss"] - r2["loss"]) < 1e-5, (r1, r2)
        assert r1["lr"] == r2["lr"]
    assert [e["eval/greedy_accuracy"] for e in single.evals] == [e["eval/greedy_accuracy"] for e in sharded.evals]
    ranks = json.loads((tmp_path / "fsdp2" / "fsdp2" / "ranks.json").read_text())
    assert sorted(ranks) == ["0", "1"]
    assert not (tmp_path / "fsdp2" / "learner-weights.shm").exists()  # the weights' hand-off segment is gone
    # a single-process run resumes the sharded run's checkpoint (the same format)
    resumed = run_rl(cfg(model, tmp_path / "fsdp2", resume=True, train={"steps": 6}), log=logs.append)
    assert resumed.steps == 6 and any("(step 4)" in m for m in logs)


@pytest.mark.slow  # a run killed and resumed (the slow marker's kind): ~50 s of make test's 3 minutes
def test_a_sigkilled_rank_stops_the_run_by_name_and_it_resumes(setup, tmp_path):
    """Rollouts on a worker process one step ahead (the asynchronous path), rank 1 SIGKILLed
    after the first checkpoint: TrainError names it, no final model; resume=true ends the run
    with every step trained once, in data order."""
    _, model = setup
    over = dict(train={"steps": 12, "strategy": "fsdp2", "world_size": 2}, max_off_policy_steps=1,
                rollout={"workers": 1}, checkpoint={"every": 2, "keep": 3})
    out = tmp_path / "run"
    killed_at = kill_rank_1_after_a_checkpoint(lambda: run_rl(cfg(model, out, **over), log=lambda m: None), out)
    assert not (out / "learner-weights.shm").exists()  # removed on the failure too
    assert killed_at < 12
    logs: list[str] = []
    result = run_rl(cfg(model, out, resume=True, **over), log=logs.append)
    assert result.steps == 12 and result.final_model is not None
    assert any(f"(step {killed_at})" in m for m in logs), logs
    steps = [json.loads(line)["step"] for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))  # the rows after the checkpoint were dropped, then written again


@pytest.mark.parametrize("over, message", [
    ({"train": {"lora": {"rank": 4}}}, "does not train LoRA adapters"),
    ({"algo": {"kl_beta": 0.1}}, r"does not run the KL reference model \(algo.kl_beta=0.1\)"),
])
def test_what_the_sharded_learner_does_not_run_is_refused_first(setup, tmp_path, over, message):
    _, model = setup
    train = {"strategy": "fsdp2", "world_size": 2, **over.pop("train", {})}
    with pytest.raises(TrainError, match=message):
        run_rl(cfg(model, tmp_path / "run", train=train, **over), log=lambda m: None)
    assert not (tmp_path / "run" / "fsdp2").exists()  # no rank was started
