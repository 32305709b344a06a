"""The learner's forward on every family the tiny factory builds: SFT's loss equals the model's
own labelled loss, and an on-policy RL step on a model with dropout sees no mismatch."""

import pytest
import torch

from flywheel.config import AlgoConfig
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.models.tiny import ARCHITECTURES
from flywheel.train.forward import sft_loss
from flywheel.train.rl_step import RLStepConfig, rl_step
from flywheel.types import Trajectory, TrajectoryGroup

SPEC = dict(hidden=32, layers=2, heads=4, ffn=64, max_positions=256)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {arch: build_tiny_model(root / arch, TinySpec(**SPEC, arch=arch)) for arch in ARCHITECTURES}


def test_the_factory_builds_each_family_as_itself(folders):
    for arch, folder in folders.items():
        model, tok = load(folder)
        assert model.config.model_type == arch
        assert tok.decode(tok.encode("é 12+3")) == "é 12+3"
    with pytest.raises(ValueError, match="arch 'bert' is not one of qwen2, llama"):
        build_tiny_model(folders["qwen2"].parent / "x", TinySpec(**SPEC, arch="bert"))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sft_loss_equals_the_models_own_labelled_loss(folders, arch):
    """GPT-2 keeps its decoder as `transformer` and Gemma scales its embeddings: the loss goes
    through the model's forward, so it is Hugging Face's cross-entropy on the same tokens."""
    model, _ = load(folders[arch])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    target = torch.tensor([[0, 0, 1, 1, 0, 1], [0, 1, 1, 1, 0, 0]])
    loss, m = sft_loss(model, ids, attn, target, normalizer=1.0)
    labels = ids.masked_fill(target == 0, -100)
    reference = model(input_ids=ids, attention_mask=attn, labels=labels).loss  # mean over 6 targets
    assert m["tokens"] == 6
    assert loss.item() == pytest.approx(6 * reference.item(), rel=1e-5)
    loss.backward()
    assert model.get_input_embeddings().weight.grad is not None


def _group(prompt, completions, behavior_rows):
    trajs = []
    for completion, reward, logps in zip(completions, (1.0, 0.0), behavior_rows):
        ids = prompt + completion
        mask = [0] * len(prompt) + [1] * len(completion)
        trajs.append(Trajectory("t", ids, mask, [0.0] * len(prompt) + logps, [0 if m else -1 for m in mask], reward))
    return TrajectoryGroup("t", trajs)


def test_on_policy_step_on_a_dropout_model_sees_no_mismatch(folders):
    """GPT-2's config has dropout 0.1: a learner in train mode computes other logprobs than
    the sampler (mismatch KL ~0.005, IS weights != 1); in the sampler's mode they agree."""
    model, tok = load(folders["gpt2"])
    assert model.config.resid_pdrop == 0.1
    engine = LocalEngine(model, tok, seed=0)  # the learner's own model, as in-process RL shares it
    prompt = tok.encode("12+3=")
    samples = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=4, n=2))[0]
    group = _group(prompt, [s.token_ids for s in samples], [list(s.logprobs) for s in samples])
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = RLStepConfig(algo=AlgoConfig(dynamic_sampling=False), shared_prefix=False)
    metrics = rl_step(model, opt, [group], cfg, pad_id=tok.pad_token_id)
    assert metrics["skipped"] == 0.0
    assert metrics["mismatch_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    assert not model.training


@pytest.mark.parametrize("dropout", [True, False])
def test_sft_follows_the_dropout_setting(folders, tmp_path, monkeypatch, dropout):
    import json

    import flywheel.train.sft as sft
    from flywheel.config import SFTConfig, validate

    modes = []
    real = sft.sft_loss  # rows this short share too little: the plain loss
    monkeypatch.setattr(sft, "sft_loss", lambda model, *a, **k: (modes.append(model.training), real(model, *a, **k))[1])
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "1+1=", "completion": "2"}) + "\n")
    cfg = validate({"model": str(folders["gpt2"]), "output_dir": str(tmp_path / "run"), "data": {"train": [str(data)]},
                    "train": {"steps": 2, "batch_size": 1, "micro_batch_size": 1, "dropout": dropout},
                    "log": {"progress": False}, "threads": 1}, SFTConfig)
    sft.run_sft(cfg, log=lambda m: None)
    assert modes == [dropout, dropout]
