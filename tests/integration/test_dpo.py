"""DPO end to end on a tiny model, and its data errors."""

import json
import math

import pytest

from flywheel.config import DPOConfig, validate
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.dpo import run_dpo
from flywheel.train.sft_data import DataError


def pair(q, good, bad):
    return {"input": {"messages": [{"role": "user", "content": q}]},
            "preferred_output": [{"role": "assistant", "content": good}],
            "non_preferred_output": [{"role": "assistant", "content": bad}]}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m"), TinySpec(hidden=64, layers=2, heads=4, ffn=128))


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def cfg(model, data_file, out, **over):
    base = dict(model=str(model), output_dir=str(out), data={"train": [str(data_file)]},
                train={"steps": 30, "batch_size": 8}, beta=0.5, optim={"lr": 3e-3},
                log={"progress": False}, threads=1)
    base.update(over)
    return validate(base, DPOConfig)


@pytest.mark.slow  # a learning outcome: make test-all
def test_dpo_learns_the_preferences(model, tmp_path):
    rows = [pair(f"{a}+{b}?", str(a + b), str(a + b + 1)) for a in range(4) for b in range(4)]
    data = write(tmp_path / "pairs.jsonl", rows)
    result = run_dpo(cfg(model, data, tmp_path / "run", data={"train": [str(data)], "val": [str(data)]}),
                     log=lambda m: None)
    assert result.steps == 30
    assert result.last["val_reward_accuracy"] == 1.0
    # it starts at log 2 (policy == reference); over seeds 0-2 it ended at 0.49-0.75 log 2
    # (docs/benchmarks.md, "Measurements behind choices"), so the bound leaves room for float drift
    assert result.last["val_loss"] < 0.85 * math.log(2)
    assert (result.final_model / "config.json").exists()


@pytest.mark.parametrize("row, message", [
    ("{not json", "invalid JSON"),
    ({"input": {"messages": []}}, "'input.messages' must be a non-empty list"),
    ({**pair("q", "a", "b"), "preferred_output": [{"role": "user", "content": "x"}]}, "'preferred_output' must be"),
    ({**pair("q", "a", "b"), "non_preferred_output": [{"role": "assistant", "content": ""}]}, "neither content"),
])
def test_bad_pairs_name_file_and_line(model, tmp_path, row, message):
    data = write(tmp_path / "bad.jsonl", [pair("q", "a", "b"), row])
    with pytest.raises(DataError, match=rf"bad.jsonl:2: .*{message}"):
        run_dpo(cfg(model, data, tmp_path / "x"), log=lambda m: None)
    warnings = []
    result = run_dpo(cfg(model, data, tmp_path / "y", train={"steps": 1, "batch_size": 1},
                         data={"train": [str(data)], "on_error": "skip"}), log=warnings.append)
    assert result.steps == 1 and any("bad.jsonl:2" in w for w in warnings)


def test_lora_dpo_starts_at_log_2_and_saves_an_adapter(model, tmp_path):
    """With train.lora the reference is the trained model with its adapter off: at the first
    step the policy is the reference exactly (peft's B starts at zero), so the loss is log 2;
    the saved model is an adapter folder, and continuing it keeps it as its own reference."""
    from flywheel.train.metrics import read_metrics

    rows = [pair(f"{a}+{b}?", str(a + b), str(a + b + 1)) for a in range(4) for b in range(4)]
    data = write(tmp_path / "pairs.jsonl", rows)
    lora = {"steps": 6, "batch_size": 8, "lora": {"rank": 4, "alpha": 8}}
    result = run_dpo(cfg(model, data, tmp_path / "run", train=lora), log=lambda m: None)
    first = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r][0]
    assert abs(first["loss"] - math.log(2)) < 1e-5
    assert result.last["loss"] < math.log(2)  # the adapter moved
    assert (result.final_model / "adapter_config.json").is_file()
    again = run_dpo(cfg(result.final_model, data, tmp_path / "more", train={"steps": 2, "batch_size": 8}),
                    log=lambda m: None)
    assert (again.final_model / "adapter_config.json").is_file()
    first = [r for r in read_metrics(tmp_path / "more" / "metrics.jsonl") if "loss" in r][0]
    assert abs(first["loss"] - math.log(2)) < 1e-5  # its reference: the adapter it started from
