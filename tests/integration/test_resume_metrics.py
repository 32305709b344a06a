"""A resumed run's metrics read as one run: rows a killed process logged past its last
checkpoint are moved aside, in SFT, DPO and RL alike.

The kill is made deterministic: a finished 4-step run loses its step-4 checkpoint and final
model, which leaves exactly what SIGKILL after step 4's log but before its checkpoint leaves."""

from __future__ import annotations

import json
import shutil

import pytest

from flywheel.config import DPOConfig, RLConfig, SFTConfig, validate
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.checkpoint import list_checkpoints
from flywheel.train.dpo import run_dpo
from flywheel.train.metrics import drop_rows_after, read_metrics
from flywheel.train.rl import run_rl
from flywheel.train.sft import run_sft

QUIET = {"log": {"progress": False}, "threads": 1, "checkpoint": {"every": 2, "keep": 3}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), TinySpec(hidden=32, layers=2, heads=4, ffn=64))


def _data(tmp_path):
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "completion": str(a + b)}) + "\n"
                           for a in range(4) for b in range(4)))
    dpo = tmp_path / "dpo.jsonl"
    dpo.write_text("".join(json.dumps({
        "input": {"messages": [{"role": "user", "content": f"{a}+{b}?"}]},
        "preferred_output": [{"role": "assistant", "content": str(a + b)}],
        "non_preferred_output": [{"role": "assistant", "content": str(a + b + 1)}]}) + "\n"
        for a in range(4) for b in range(4)))
    return sft, dpo


def _configs(model, tmp_path):
    sft, dpo = _data(tmp_path)
    common = dict(model=str(model), **QUIET)
    return {
        "sft": (run_sft, validate({**common, "output_dir": str(tmp_path / "sft"), "data": {"train": [str(sft)]},
                                   "train": {"steps": 4, "batch_size": 4, "micro_batch_size": 4}}, SFTConfig)),
        "dpo": (run_dpo, validate({**common, "output_dir": str(tmp_path / "dpo"), "data": {"train": [str(dpo)]},
                                   "train": {"steps": 4, "batch_size": 2}}, DPOConfig)),
        "rl": (run_rl, validate({**common, "output_dir": str(tmp_path / "rl"), "env": {"name": "arithmetic"},
                                 "train": {"steps": 4, "groups_per_step": 2, "group_size": 2},
                                 "sampling": {"max_tokens": 4}, "eval": {"tasks": 4},
                                 "rollout": {"workers": 0}}, RLConfig)),
    }


@pytest.mark.parametrize("recipe", ["sft", "dpo", "rl"])
def test_resume_after_a_kill_logs_each_step_once(model, tmp_path, recipe):
    run, cfg = _configs(model, tmp_path)[recipe]
    out = tmp_path / recipe
    run(cfg, log=lambda m: None)
    before = read_metrics(out / "metrics.jsonl")
    shutil.rmtree(list_checkpoints(out)[-1])  # "killed" after step 4 was logged, before its checkpoint
    shutil.rmtree(out / "final")
    assert list_checkpoints(out)[-1].name == "step_00000002"

    logs: list[str] = []
    run(cfg.model_copy(update={"resume": True}), log=logs.append)
    assert any("(step 2)" in m for m in logs)
    rows = read_metrics(out / "metrics.jsonl")
    train_steps = [r["step"] for r in rows if "loss" in r or "reward_mean" in r]
    assert train_steps == [1, 2, 3, 4]
    assert [r["step"] for r in rows] == sorted(r["step"] for r in rows)  # no plot doubles back
    moved = read_metrics(out / "metrics.superseded.jsonl")
    assert moved == [r for r in before if r["step"] > 2]  # set aside, not lost
    if recipe == "rl":
        assert [r["step"] for r in read_metrics(out / "rollouts.jsonl")] == [1, 2, 3, 4]


def test_drop_rows_after_keeps_order_and_moves_torn_lines(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1, "a": 1}\n{"step": 3}\n{"step": 2}\n{"step": 2, "b"')
    assert drop_rows_after(log, 2) == 2
    assert log.read_text() == '{"step": 1, "a": 1}\n{"step": 2}\n'
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == '{"step": 3}\n{"step": 2, "b"\n'
    assert drop_rows_after(log, 2) == 0 and drop_rows_after(tmp_path / "absent.jsonl", 0) == 0


def test_a_fresh_start_sets_aside_an_earlier_process_s_step_0_rows(tmp_path):
    """RL logs its step-0 evaluation before any checkpoint: a run killed then restarted fresh
    (no checkpoint to resume) must not show step 0 twice."""
    from flywheel.train.metrics import MetricsWriter

    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 0, "eval/success": 0.1}\n{"step": 1, "loss": 2.0}\n')
    writer = MetricsWriter(log, start_step=0)
    writer.log(0, **{"eval/success": 0.2})
    writer.close()
    assert [r["eval/success"] for r in read_metrics(log)] == [0.2]
    assert len(read_metrics(tmp_path / "metrics.superseded.jsonl")) == 2
