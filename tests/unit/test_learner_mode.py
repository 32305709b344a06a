"""set_learner_mode with activation checkpointing: the layers really recompute in the backward
pass while dropout stays off (Hugging Face checkpoints only a layer in train mode, and RL, DPO
and SFT without dropout train in eval mode)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from flywheel.models import TinySpec, build_tiny_model
from flywheel.train.forward import set_learner_mode


def _mlp_calls_in_one_step(model) -> int:
    """How often the first layer's MLP runs in one forward + backward (its `forward` wrapped on
    the instance: module hooks do not fire in a checkpoint's recompute)."""
    mlp, calls = model.model.layers[0].mlp, []
    forward = mlp.forward
    mlp.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    ids = torch.randint(3, 60, (2, 9))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    del mlp.forward  # the class's forward again
    return len(calls)


def test_checkpointed_layers_recompute_with_dropout_off(tmp_path):
    path = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=2, heads=4, ffn=64))
    model = AutoModelForCausalLM.from_pretrained(path)
    set_learner_mode(model, dropout=False)
    assert _mlp_calls_in_one_step(model) == 1  # no checkpointing: one forward

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    set_learner_mode(model, dropout=False)
    assert _mlp_calls_in_one_step(model) == 2  # forward, then the recompute in the backward pass
    layer = model.model.layers[0]
    assert layer.training and not layer.self_attn.training and not layer.mlp.training  # dropout stays off
    assert not any(m.training for m in model.modules() if isinstance(m, torch.nn.Dropout))

    set_learner_mode(model, dropout=True)  # SFT with the model's own dropout: everything in train mode
    assert all(m.training for m in model.modules())
