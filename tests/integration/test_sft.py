"""SFT end to end on the tiny model: it learns, accumulates exactly, and resumes after SIGKILL."""

import json
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from flywheel.config import SFTConfig, validate
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.checkpoint import list_checkpoints
from flywheel.train.metrics import read_metrics
from flywheel.errors import TrainError
from flywheel.train.sft import run_sft

ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    data = root / "digits.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    model = build_tiny_model(root / "model", TinySpec(hidden=64, layers=2, heads=4, ffn=256, seed=0))
    return root, model, data


def make_cfg(model, data_file, out, **over):
    cfg = dict(model=str(model), output_dir=str(out), data={"train": [str(data_file)]},
               train={"steps": 150, "batch_size": 32, "micro_batch_size": 32},
               optim={"lr": 3e-3, "warmup_steps": 10}, log={"progress": False}, threads=1)
    for k, v in over.items():
        cfg[k] = {**cfg.get(k, {}), **v} if isinstance(v, dict) else v
    return cfg


def accuracy(model_dir) -> float:
    e = LocalEngine.from_path(str(model_dir))
    out = e.generate([e.encode(r["prompt"]) for r in ROWS], SamplingParams(temperature=0, max_tokens=4))
    return sum(o[0].text == r["completion"] for o, r in zip(out, ROWS)) / len(ROWS)


def losses(out_dir) -> dict[int, float]:
    """step -> train loss; a resumed run rewrites steps after its checkpoint (last wins)."""
    return {r["step"]: r["loss"] for r in read_metrics(Path(out_dir) / "metrics.jsonl") if "loss" in r}


@pytest.mark.slow  # a learning outcome: make test-all
def test_sft_learns_single_digit_addition(setup, tmp_path):
    root, model, data = setup
    calls = []

    def evaluator(m, tok):
        calls.append(m.training)
        return {"calls": len(calls)}

    cfg = validate(make_cfg(model, data, tmp_path / "run", eval={"every": 50}, checkpoint={"every": 50, "keep": 2}),
                   SFTConfig)
    result = run_sft(cfg, evaluator=evaluator, log=lambda m: None)
    curve = losses(result.output_dir)
    assert sorted(curve) == list(range(1, 151))
    assert sum(list(curve.values())[-10:]) / 10 < 0.5 * sum(list(curve.values())[:10]) / 10
    assert accuracy(model) == 0.0
    assert accuracy(result.final_model) >= 0.9  # 0.99-1.00 over seeds 0-2 (docs/benchmarks.md)
    assert calls == [False, False, False]  # steps 50, 100, then the end; model in eval mode
    assert [p.name for p in list_checkpoints(result.output_dir)] == ["step_00000100", "step_00000150"]


def test_gradient_accumulation_gives_the_same_steps(setup, tmp_path):
    root, model, data = setup
    runs = []
    for micro in (16, 4):
        cfg = validate(make_cfg(model, data, tmp_path / f"m{micro}",
                                train={"steps": 5, "batch_size": 16, "micro_batch_size": micro}), SFTConfig)
        runs.append(losses(run_sft(cfg, log=lambda m: None).output_dir))
    assert runs[0].keys() == runs[1].keys()
    assert all(abs(runs[0][s] - runs[1][s]) < 1e-5 for s in runs[0])


def test_existing_checkpoints_are_not_overwritten(setup, tmp_path):
    root, model, data = setup
    cfg = validate(make_cfg(model, data, tmp_path / "run", train={"steps": 2}), SFTConfig)
    run_sft(cfg, log=lambda m: None)
    with pytest.raises(TrainError, match="resume=true"):
        run_sft(cfg, log=lambda m: None)
    # resuming a finished run changes nothing
    cfg = validate(make_cfg(model, data, tmp_path / "run", train={"steps": 2}, resume=True), SFTConfig)
    assert run_sft(cfg, log=lambda m: None).resumed_from == 2


@pytest.mark.slow  # a run killed and resumed (the slow marker's kind); make test kills a cycle mid-RL (test_cycle.py)
def test_sigkill_and_resume_follows_the_uninterrupted_curve(setup, tmp_path, forked_cli):
    """Only the killed run (`flywheel sft`) needs a process of its own: the uninterrupted
    reference and the resume run here, on one thread as the child."""
    root, model, data = setup
    steps = 30
    base = make_cfg(model, data, tmp_path / "x", train={"steps": steps, "batch_size": 32, "micro_batch_size": 16},
                    checkpoint={"every": 10, "keep": 3}, optim={"lr": 3e-3, "warmup_steps": 5})
    # the run, killed with SIGKILL as soon as its first checkpoint exists
    run_dir = tmp_path / "killed"
    cfg = tmp_path / "killed.yaml"
    cfg.write_text(yaml.safe_dump({**base, "output_dir": str(run_dir)}))
    p = forked_cli(["sft", cfg])
    deadline = time.time() + 240
    while not list_checkpoints(run_dir) and p.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert p.returncode == -signal.SIGKILL, "the run finished before it could be killed:\n" + p.output[-2000:]
    assert not (run_dir / "final").exists()
    killed_at = max(losses(run_dir))
    assert killed_at < steps

    reference = losses(run_sft(validate({**base, "output_dir": str(tmp_path / "ref")}, SFTConfig),
                               log=lambda m: None).output_dir)  # uninterrupted
    assert sorted(reference) == list(range(1, steps + 1))
    logs: list[str] = []
    result = run_sft(validate({**base, "output_dir": str(run_dir), "resume": True}, SFTConfig), log=logs.append)
    assert result.resumed_from is not None and result.resumed_from <= killed_at, (result.resumed_from, killed_at)
    assert any("resumed from" in m for m in logs), logs
    resumed = losses(run_dir)
    assert sorted(resumed) == list(range(1, steps + 1))
    logged = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert logged == list(range(1, steps + 1))  # each step once: the killed run's rows past its checkpoint moved aside
    worst = max(abs(resumed[s] - reference[s]) for s in reference)
    assert worst < 1e-5, f"resumed curve departs from the uninterrupted one by {worst}"


def test_tensorboard_without_the_package_stops_before_training_naming_the_extra(setup, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kw):
        if name.startswith("torch.utils.tensorboard"):
            raise ImportError("No module named 'tensorboard'")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    root, model, data = setup
    cfg = validate(make_cfg(model, data, tmp_path / "run", train={"steps": 3},
                            log={"loggers": ["jsonl", "tensorboard"]}), SFTConfig)
    with pytest.raises(TrainError, match=r"log.loggers lists 'tensorboard' but the tensorboard package is not "
                                         r"installed: pip install 'flywheel\[tensorboard\]'"):
        run_sft(cfg, log=lambda m: None)
    assert not list_checkpoints(tmp_path / "run")


def test_val_loss_and_bad_settings(setup, tmp_path):
    root, model, data = setup
    cfg = validate(make_cfg(model, data, tmp_path / "run", train={"steps": 4},
                            data={"val_fraction": 0.2}), SFTConfig)
    logs = []
    result = run_sft(cfg, log=logs.append)
    assert "held out 20 of the train examples for validation" in logs
    assert result.last["val_loss"] > 0
    bad = validate(make_cfg(model, data, tmp_path / "bad", train={"batch_size": 10, "micro_batch_size": 4}), SFTConfig)
    with pytest.raises(TrainError, match=r"batch_size \(10\) must be a multiple of train.micro_batch_size \(4\)"):
        run_sft(bad, log=lambda m: None)
    bad = validate(make_cfg(model, data, tmp_path / "bad2", eval={"evaluator": "nope"}), SFTConfig)
    with pytest.raises(TrainError, match="must look like 'package.module:function'"):
        run_sft(bad, log=lambda m: None)


def test_stop_at_ends_the_run_at_the_first_evaluation_meeting_every_target(setup, tmp_path):
    root, model, data = setup
    scores = iter([0.1, 0.5, 0.9, 0.95])

    def evaluator(m, tok):
        return {"accuracy": next(scores)}

    cfg = validate(make_cfg(model, data, tmp_path / "run", eval={"every": 10, "stop_at": {"eval/accuracy": 0.5}}),
                   SFTConfig)
    logs = []
    result = run_sft(cfg, evaluator=evaluator, log=logs.append)
    assert result.steps == 20 and result.last["eval/accuracy"] == 0.5  # no second evaluation at the end
    assert (result.final_model / "config.json").exists()
    assert [p.name for p in list_checkpoints(result.output_dir)] == ["step_00000020"]
    assert any("eval.stop_at target met" in m for m in logs)
    # a target the evaluation does not report is named, with what it does report
    bad = validate(make_cfg(model, data, tmp_path / "bad", eval={"every": 5, "stop_at": {"eval/acc": 0.5}}),
                   SFTConfig)
    with pytest.raises(TrainError, match=r"names \['eval/acc'\].*reports \['eval/accuracy'\]"):
        run_sft(bad, evaluator=lambda m, t: {"accuracy": 0.0}, log=lambda m: None)


def test_heldout_success_plays_the_environment_on_a_snapshot(setup):
    from flywheel.envs import load_env
    from flywheel.models import load
    from flywheel.train.env_eval import heldout_success

    root, model, data = setup
    m, tok = load(model)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    evaluate = heldout_success(load_env("calculator", chain_prob=0.0, bare_prompt=True), tasks=3, max_tokens=8)
    out = evaluate(m, tok)
    assert out["success"] == 0.0 and out["episode/reward/used_tool"] == 0.0  # an untrained model
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())  # its weights untouched
    with pytest.raises(ValueError, match="no 'test' tasks"):
        heldout_success(load_env("calculator"), tasks=0)
