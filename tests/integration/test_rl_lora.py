"""LoRA RL (train.lora on the RL recipe): the learner trains an adapter through peft while the
rollout engines, in process or in worker processes, run the merged weights. On-policy tokens
are sampled with the learner's own logprobs (mismatch KL ~ 0), the KL reference is the model
with its adapter off (0 at the first step, where B = 0), checkpoints and the final model are
adapter folders, and a resumed run continues the adapter."""

import json

import pytest

from flywheel.config import RLConfig, validate
from flywheel.inference.lora import is_adapter_folder
from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.metrics import read_metrics
from flywheel.train.rl import run_rl

peft = pytest.importorskip("peft")


ODD_ENV = '''
from flywheel.envs.arithmetic import ArithmeticEnvironment
from flywheel.envs.rubric import RewardFn, Rubric


class OddFirstCharacter(ArithmeticEnvironment):
    """A reward a random tiny model earns about half the time: a learning signal from step 1."""

    def __init__(self):
        super().__init__()
        self.rubric = Rubric([RewardFn(lambda st: float(bool(st.final_text) and ord(st.final_text[0]) % 2 == 1),
                                       name="odd", inline=True)])


def load():
    return OddFirstCharacter()
'''


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinySpec(hidden=64, layers=2, heads=4, ffn=128))


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "odd_env.py"  # a file path: worker processes load it too
    path.write_text(ODD_ENV)
    return f"{path}:load"


def cfg(model, out, env, **over):
    base = dict(model=str(model), output_dir=str(out), env={"name": env},
                train={"steps": 3, "groups_per_step": 2, "group_size": 4, "lora": {"rank": 4, "alpha": 8}},
                sampling={"max_tokens": 4}, eval={"tasks": 8}, checkpoint={"every": 2},
                algo={"kl_beta": 0.05}, optim={"lr": 1e-2}, log={"progress": False}, threads=1)
    base.update(over)
    return validate(base, RLConfig)


def train_records(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if "reward_mean" in r]


def test_lora_rl_in_process_samples_the_learners_policy_and_saves_adapters(model, env_file, tmp_path):
    logs = []
    result = run_rl(cfg(model, tmp_path / "run", env_file), log=logs.append)
    assert any("LoRA: training" in m for m in logs)
    records = train_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["mismatch_kl"] < 1e-6 for r in records)  # engine and learner agree on the adapted weights
    assert records[0]["kl_ref"] < 1e-9  # the reference is the model with its adapter off; B starts at 0
    assert records[-1]["kl_ref"] > 0  # the adapter moved the policy
    assert is_adapter_folder(result.final_model) and is_adapter_folder(tmp_path / "run/checkpoints/step_00000002")
    saved = json.loads((result.final_model / "adapter_config.json").read_text())
    assert saved["r"] == 4 and saved["base_model_name_or_path"] == str(model.resolve())

    resumed = run_rl(cfg(model, tmp_path / "run", env_file, resume=True, train={
        "steps": 4, "groups_per_step": 2, "group_size": 4, "lora": {"rank": 4, "alpha": 8}}), log=lambda m: None)
    assert resumed.steps == 4 and train_records(tmp_path / "run")[-1]["step"] == 4
    from transformers import AutoModelForCausalLM
    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), resumed.final_model)
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in loaded.named_parameters())


@pytest.mark.slow  # a worker process (~11 s); the shared-memory path is also tests/unit/test_lora_rollout_weights.py's
def test_lora_rl_with_worker_processes_runs_the_published_adapter(model, env_file, tmp_path):
    result = run_rl(cfg(model, tmp_path / "run", env_file, max_off_policy_steps=1, rollout={"workers": 1}), log=lambda m: None)
    records = train_records(tmp_path / "run")
    fresh = [r for r in records if r["staleness_mean"] == 0]
    assert fresh and all(r["mismatch_kl"] < 1e-6 for r in fresh)  # the worker's engine is the learner's policy
    assert is_adapter_folder(result.final_model)


@pytest.mark.slow  # a LoRA run, then one from its adapter with a worker process (~15 s)
def test_a_run_from_an_adapter_folder_evaluates_the_adapted_model_at_step_0(model, env_file, tmp_path, monkeypatch):
    """The evaluation engine is built from the adapter's base; before the first evaluation it
    must take the learner's (merged) weights, also when rollouts run in worker processes and
    so never write into it."""

    from flywheel.models import load
    from flywheel.train import rl as rl_module
    from flywheel.train.lora import merged_folder

    adapter = run_rl(cfg(model, tmp_path / "first", env_file, train={
        "steps": 2, "groups_per_step": 2, "group_size": 4, "lora": {"rank": 4, "alpha": 8}}),
        log=lambda m: None).final_model
    seen: list[dict] = []
    real = rl_module._eval_record

    def spy(env, engine, renderer, config):
        seen.append({k: v.detach().clone() for k, v in engine.model.named_parameters()})
        return real(env, engine, renderer, config)

    monkeypatch.setattr(rl_module, "_eval_record", spy)
    run_rl(cfg(adapter, tmp_path / "second", env_file, max_off_policy_steps=1, rollout={"workers": 1}, train={
        "steps": 1, "groups_per_step": 2, "group_size": 4, "lora": {"rank": 4, "alpha": 8}}), log=lambda m: None)
    merged, _ = load(merged_folder(adapter, tmp_path / "merged"))
    base, _ = load(str(model))
    want, old = dict(merged.named_parameters()), dict(base.named_parameters())
    assert max(float((want[k] - old[k]).detach().abs().max()) for k in want) > 1e-4  # the adapter moved some weight
    assert max(float((seen[0][k] - want[k]).detach().abs().max()) for k in want) < 1e-5
