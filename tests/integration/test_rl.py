"""The synchronous RL recipe end to end on a tiny model (smoke: it runs, logs, resumes)."""

import pytest

from flywheel.config import RLConfig, validate
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.metrics import read_metrics
from flywheel.train.rl import run_rl
from flywheel.errors import TrainError


def cfg(model, out, **over):
    base = dict(model=str(model), output_dir=str(out), env={"name": "arithmetic"},
                train={"steps": 4, "groups_per_step": 2, "group_size": 4},
                sampling={"max_tokens": 4}, eval={"tasks": 10, "pass_k": 2}, checkpoint={"every": 2},
                log={"progress": False}, threads=1,
                algo={"dynamic_sampling": False})  # every group trains: an untrained model's are all flat
    base.update(over)
    return validate(base, RLConfig)


def test_rl_runs_logs_and_resumes(tmp_path):
    model = build_tiny_model(tmp_path / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    result = run_rl(cfg(model, tmp_path / "run", train={"steps": 2, "groups_per_step": 2, "group_size": 4}),
                    log=lambda m: None)
    assert result.steps == 2 and (result.final_model / "config.json").exists()
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in records if "reward_mean" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert {"samples_per_s", "time/rollout_wait_s", "time/train_s", "entropy", "clip_fraction"} <= set(train[0])
    assert [r["step"] for r in records if "eval/greedy_accuracy" in r] == [0, 2]
    assert "eval/pass@2" in records[0]
    logs = []
    resumed = run_rl(cfg(model, tmp_path / "run", resume=True), log=logs.append)
    assert resumed.steps == 4 and any("resumed from" in m and "(step 2)" in m for m in logs)


NAN_ENV = '''
from flywheel.envs.arithmetic import ArithmeticEnvironment
from flywheel.envs.rubric import RewardFn, Rubric


class NanRewards(ArithmeticEnvironment):
    def __init__(self):
        super().__init__()
        self.rubric = Rubric([RewardFn(lambda st: float("nan"), name="broken", inline=True)])


def load():
    return NanRewards()
'''


def test_non_finite_updates_are_skipped_then_the_run_stops(tmp_path, monkeypatch):
    (tmp_path / "nan_env.py").write_text(NAN_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_tiny_model(tmp_path / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    config = cfg(model, tmp_path / "run", env={"name": "nan_env:load"}, max_skipped_steps=3,
                 train={"steps": 10, "groups_per_step": 2, "group_size": 4})
    with pytest.raises(TrainError, match="step 3: 3 updates in a row had a non-finite loss"):
        run_rl(config, log=lambda m: None)
    skipped = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "skipped" in r]
    assert [r["skipped"] for r in skipped] == [1.0, 1.0]  # logged before the third stopped the run
