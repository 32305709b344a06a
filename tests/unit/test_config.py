"""Config loading: dotted overrides, unknown-key errors that name the valid keys, and every
shipped config under configs/ validating against the class of the command that runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from flywheel.config import (
    DPOConfig,
    RLConfig,
    Config,
    ConfigError,
    SFTConfig,
    SFTDataConfig,
    SFTTrainConfig,
    load_config,
    parse_overrides,
    validate,
)
from flywheel.loop.loop_config import LoopConfig, check_stages

REPO = Path(__file__).resolve().parents[2]

# The command named on a config's first line -> the config class that command validates.
# A new command with configs under configs/ must be registered here.
COMMAND_CONFIGS: dict[str, type[Config]] = {"sft": SFTConfig, "rl": RLConfig, "dpo": DPOConfig,
                                            "loop run": LoopConfig, "loop cycle": LoopConfig}

MINIMAL = "model: runs/tiny\ndata:\n  train: [a.jsonl]\n"


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(fn, *args, **kw) -> str:
    with pytest.raises(ConfigError) as info:
        fn(*args, **kw)
    return str(info.value)


# ---------------------------------------------------------------- overrides


def test_overrides_nest_on_dots_and_parse_values_as_yaml():
    assert parse_overrides([
        "train.steps=100", "resume=true", "data.train=[a.jsonl,b.jsonl]",
        "eval.evaluator=null", "optim.betas=[0.8, 0.95]", "output_dir=", "train.seed=3",
        "eval.evaluator2=pkg.mod:fn", "device=cuda:0", "note=a=b",
    ]) == {
        "train": {"steps": 100, "seed": 3},
        "resume": True,
        "data": {"train": ["a.jsonl", "b.jsonl"]},
        "eval": {"evaluator": None, "evaluator2": "pkg.mod:fn"},
        "optim": {"betas": [0.8, 0.95]},
        "output_dir": "",
        "device": "cuda:0",
        "note": "a=b",
    }


def test_overrides_deeper_than_two_levels_and_later_wins():
    assert parse_overrides(["a.b.c=1", "a.b.d=x", "a.b.c=2"]) == {"a": {"b": {"c": 2, "d": "x"}}}


@pytest.mark.parametrize("bad", ["resume", "=3", ".lr=1", "train.=1", "train..lr=1", ""])
def test_override_without_key_sub_value_form_is_rejected(bad):
    msg = error_of(parse_overrides, ["resume=true", bad])
    assert msg == f"override {bad!r} is not of the form key.sub=value"


def test_override_with_invalid_yaml_value_is_rejected():
    msg = error_of(parse_overrides, ["data.train=[a.jsonl"])
    assert msg.startswith("override 'data.train=[a.jsonl': value is not valid YAML")


def test_override_below_a_scalar_override_is_a_conflict():
    msg = error_of(parse_overrides, ["train=3", "train.steps=2"])
    assert msg == "override 'train.steps=2' conflicts with another override of 'train'"


def test_overrides_merge_into_the_file_without_dropping_siblings():
    cfg = load_config(REPO / "configs" / "sft_arithmetic.yaml", SFTConfig,
                      ["train.steps=5", "optim.lr=1.0e-4", "resume=true", "data.val=[]"])
    assert cfg.train.steps == 5
    assert cfg.train.batch_size == 128  # sibling from the file survives
    assert cfg.optim.lr == 1e-4 and cfg.optim.warmup_steps == 50
    assert cfg.resume is True
    assert cfg.data.val == [] and cfg.data.train == ["runs/data/arithmetic_train.jsonl"]


def test_config_from_overrides_alone():
    cfg = load_config(None, SFTConfig, ["model=m", "data.train=[x.jsonl]", "dtype=bfloat16"])
    assert (cfg.model, cfg.data.train, cfg.dtype) == ("m", ["x.jsonl"], "bfloat16")
    assert cfg.train == SFTTrainConfig()  # defaults fill the rest


# ---------------------------------------------------------------- validation errors


def test_unknown_top_level_key_is_named_with_the_valid_keys(tmp_path):
    msg = error_of(load_config, write(tmp_path, MINIMAL + "bogus: 1\n"), SFTConfig)
    valid = ", ".join(sorted(SFTConfig.model_fields))
    assert f"  bogus: unknown key; valid keys here are: {valid}" in msg.splitlines()
    assert msg.startswith(f"{tmp_path / 'c.yaml'}: invalid SFTConfig:")
    for key in ("model", "data", "train", "optim", "output_dir", "resume"):
        assert key in valid


def test_unknown_nested_key_lists_the_keys_of_that_section(tmp_path):
    msg = error_of(load_config, write(tmp_path, MINIMAL + "train:\n  stepz: 3\n"), SFTConfig)
    lines = msg.splitlines()
    assert lines[1] == ("  train.stepz: unknown key; valid keys here are: "
                        "activation_checkpointing, batch_size, dropout, epochs, lora, micro_batch_size, seed, steps, "
                        "strategy, world_size")
    assert len(lines) == 2


def test_unknown_nested_key_from_an_override():
    msg = error_of(load_config, None, SFTConfig, ["model=m", "data.train=[a]", "data.shuffle=true"])
    valid = ", ".join(sorted(SFTDataConfig.model_fields))
    assert msg == f"command line: invalid SFTConfig:\n  data.shuffle: unknown key; valid keys here are: {valid}"
    assert "output_dir" not in msg  # the data section's keys, not the top level's


def test_wrong_type_names_the_field_and_the_value(tmp_path):
    msg = error_of(load_config, write(tmp_path, MINIMAL + "train:\n  steps: many\n"), SFTConfig)
    (line,) = msg.splitlines()[1:]
    assert line.startswith("  train.steps: Input should be a valid integer")
    assert line.endswith("(got 'many')")


def test_out_of_bounds_and_bad_choice_name_their_fields():
    msg = error_of(validate, {"model": "m", "data": {"train": ["a"]}, "optim": {"lr": 0},
                              "dtype": "float64"}, SFTConfig)
    lines = msg.splitlines()
    assert lines[0] == "config: invalid SFTConfig:"
    assert lines[1].startswith("  optim.lr: Input should be greater than 0") and lines[1].endswith("(got 0)")
    assert lines[2] == "  dtype: Input should be 'float32' or 'bfloat16' (got 'float64')"


def test_rl_minibatches_beyond_the_groups_of_a_step_are_named():
    msg = error_of(load_config, None, RLConfig, ["model=m", "env.name=arithmetic", "train.groups_per_step=4",
                                                 "train.minibatches=8"])
    assert "train:" in msg and "minibatches=8 exceeds groups_per_step=4" in msg


def test_missing_required_fields_are_named(tmp_path):
    msg = error_of(load_config, write(tmp_path, ""), SFTConfig)
    assert msg.splitlines()[1:] == ["  model: Field required (got {})", "  data: Field required (got {})"]


def test_invalid_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "model: runs/tiny\nresume: true\n  threads: 2\n")
    msg = error_of(load_config, path, SFTConfig)
    assert msg == f"{path}: line 3: invalid YAML: mapping values are not allowed here"


def test_unclosed_list_names_the_line_where_yaml_notices(tmp_path):
    path = write(tmp_path, "model: x\ndata:\n  train: [a.jsonl\nresume: true\n")
    msg = error_of(load_config, path, SFTConfig)
    assert msg.startswith(f"{path}: line 4: invalid YAML:")


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("just words\n", "str"), ("42\n", "int")])
def test_top_level_must_be_a_mapping(tmp_path, text, kind):
    path = write(tmp_path, text)
    msg = error_of(load_config, path, SFTConfig)
    assert msg == f"{path}: the top level must be a mapping of keys, got {kind}"


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    assert error_of(load_config, path, SFTConfig) == f"config file {str(path)!r} does not exist"


# ---------------------------------------------------------------- shipped configs


def _shipped_configs() -> list[Path]:
    return sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert _shipped_configs(), "configs/ holds no *.yaml files"


@pytest.mark.parametrize("path", _shipped_configs(), ids=lambda p: p.name)
def test_every_shipped_config_validates_for_its_command(path):
    first = path.read_text().splitlines()[0]
    m = re.match(r"#\s*flywheel\s+(loop\s+\S+|\S+)\s+(\S+)", first)
    assert m, f"{path.name}: first line must be '# flywheel <command> configs/{path.name} ...', got {first!r}"
    command, named = m.groups()
    if command not in COMMAND_CONFIGS:
        pytest.fail(f"{path.name}: command {command!r} has no config class registered in "
                    f"COMMAND_CONFIGS of {Path(__file__).name}; add it there")
    assert named == f"configs/{path.name}", f"{path.name}: first line runs {named!r}, not this file"
    cfg = load_config(path, COMMAND_CONFIGS[command])
    assert isinstance(cfg, COMMAND_CONFIGS[command])
    if isinstance(cfg, LoopConfig):
        check_stages(cfg)  # the stage configs inside it too


def test_rl_greedy_sampling_is_named():
    msg = error_of(load_config, None, RLConfig, ["model=m", "env.name=arithmetic", "sampling.temperature=0"])
    assert "sampling.temperature must be > 0 for RL" in msg and "got 0.0" in msg


def test_sft_stop_at_without_periodic_evaluations_is_named():
    msg = error_of(load_config, None, SFTConfig, ["model=m", "data.train=[a.jsonl]", "eval.stop_at={val_loss: 1.0}"])
    assert "needs eval.every > 0" in msg


def test_rl_optim_defaults_hold_when_the_section_is_partly_set():
    """RL's schedule defaults (linear to 0, bench/rl_ablation.py's winner) apply whether `optim`
    is left out or only its lr is given; SFT keeps its cosine."""
    from flywheel.config import RLConfig, SFTConfig

    left_out = validate(dict(model="m", env={"name": "arithmetic"}), RLConfig).optim
    partly = validate(dict(model="m", env={"name": "arithmetic"}, optim={"lr": 1e-4}), RLConfig).optim
    assert (left_out.decay, left_out.min_lr_ratio, left_out.lr) == ("linear", 0.0, 1e-5)
    assert (partly.decay, partly.min_lr_ratio, partly.lr) == ("linear", 0.0, 1e-4)
    assert validate(dict(model="m", data={"train": ["t.jsonl"]}), SFTConfig).optim.decay == "cosine"


def test_activation_checkpointing_is_refused_under_fsdp2_naming_both():
    base = dict(model="m", data={"train": ["d.jsonl"]})
    validate({**base, "train": {"activation_checkpointing": True}}, SFTConfig)
    with pytest.raises(ConfigError, match="activation_checkpointing is not supported with strategy: fsdp2"):
        validate({**base, "train": {"activation_checkpointing": True, "strategy": "fsdp2"}}, SFTConfig)


# ---------------------------------------------------------------- overrides of a config (a cycle's stages)


def test_overrides_check_each_given_value_and_dump_only_what_was_given():
    from flywheel.config import RLConfig, overrides_of

    stage = overrides_of(RLConfig, "Stage", ("model", "env"), "set by the cycle")
    given = validate({"train": {"steps": 5, "lora": None}, "optim": {"grad_clip": None}}, stage)
    assert given.model_dump(mode="json") == {"train": {"steps": 5, "lora": None}, "optim": {"grad_clip": None}}
    assert validate(given.model_dump(mode="json"), stage) == given  # a dump reads back the same
    assert stage().model_dump() == {}
    with pytest.raises(ConfigError, match=r"train.rl: invalid Stage:\n  optim.lr: Input should be greater than 0"):
        validate({"optim": {"lr": -1}}, stage, where="train.rl")
    with pytest.raises(ConfigError, match=r"train.stepz: unknown key; valid keys here are: draw_limit, "):
        validate({"train": {"stepz": 5}}, stage)
    with pytest.raises(ConfigError, match=r"  env: set by the cycle"):
        validate({"env": {"name": "arithmetic"}}, stage)
