"""The weights a LoRA learner's rollout engines run (train/lora.py MergedWeights): after the
adapter trains, an engine given the merged weights samples each token with the logprob the
PEFT model's own forward gives it (within 1e-4), through the in-process swap and through the
shared-memory transport the worker processes read."""

from __future__ import annotations

import pytest
import torch

from flywheel.config import LoraSettings
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import TinySpec, build_tiny_model, load
from flywheel.train.lora import MergedWeights, load_trainable, merged_model

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    base = build_tiny_model(tmp_path_factory.mktemp("lora-rl") / "base",
                            TinySpec(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64))
    model, tokenizer = load_trainable(base, LoraSettings(rank=4, alpha=8), dtype="float32", device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: peft starts B at zero, which would hide a wrong merge
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return base, model, tokenizer


def peft_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def sampled(engine: LocalEngine, prompt: list[int]):
    return engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, n=3))[0]


def test_merged_weights_keep_the_plain_models_names_and_shapes(learner):
    base, model, _ = learner
    plain, _ = load(base)
    weights = MergedWeights(model).refresh()
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in plain.named_parameters()}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert (weights[q] - dict(plain.named_parameters())[q]).abs().max() > 1e-2  # the adapter is in


def test_an_engine_on_the_merged_weights_samples_the_peft_models_logprobs(learner):
    base, model, tokenizer = learner
    engine = LocalEngine(load(base)[0], tokenizer, version=-1)
    merged = MergedWeights(model)
    engine.update_weights(merged.refresh(), 0)
    prompt = [5, 9, 13, 2, 7]
    model.eval()
    for s in sampled(engine, prompt):
        want = peft_logprobs(model, prompt, s.token_ids)
        assert (torch.tensor(s.logprobs) - want).abs().max() < 1e-4
    with torch.no_grad():  # a training step later, refresh() carries the new adapter
        for name, p in model.named_parameters():
            if "lora_A" in name:
                p.add_(0.3)
    engine.update_weights(merged.refresh(), 1)
    for s in sampled(engine, prompt):
        assert (torch.tensor(s.logprobs) - peft_logprobs(model, prompt, s.token_ids)).abs().max() < 1e-4


def test_the_shared_memory_transport_carries_the_merged_weights(learner):
    from flywheel.orchestrate.pool import rollout_transport

    base, model, tokenizer = learner
    transport = rollout_transport(merged_model(model), workers=1)
    try:
        transport.publish(MergedWeights(model).refresh(), 3)
        reader = transport.reader()  # what a rollout worker claims (orchestrate/worker.py)
        try:
            engine = LocalEngine(load(base)[0], tokenizer, version=-1)
            engine.receive(reader)
            assert engine.version == 3
            prompt = [4, 8, 15, 16]
            model.eval()
            for s in sampled(engine, prompt):
                assert (torch.tensor(s.logprobs) - peft_logprobs(model, prompt, s.token_ids)).abs().max() < 1e-4
        finally:
            reader.close()
    finally:
        transport.close()
