"""Forward KL from the base model, the demo's measure of forgetting (demo/forgetting.py)."""

import json
import math

import pytest
import torch

from flywheel.demo.forgetting import forward_kl
from flywheel.train.losses import token_kl
from flywheel.models import TinySpec, build_tiny_model


def test_token_kl_by_hand():
    base = torch.tensor([[0.0, 0.0], [1.0, 2.0]])  # p = (1/2, 1/2) at position 0
    model = torch.tensor([[math.log(3.0), 0.0], [1.0, 2.0]])  # q = (3/4, 1/4); position 1 identical
    # 1/2 ln(1/2 / 3/4) + 1/2 ln(1/2 / 1/4) = 1/2 ln(2/3) + 1/2 ln 2
    assert token_kl(base, model).tolist() == pytest.approx([0.5 * math.log(2 / 3) + 0.5 * math.log(2), 0.0], abs=1e-6)


def test_forward_kl_is_zero_for_the_base_and_positive_for_another_model(tmp_path):
    base = build_tiny_model(tmp_path / "base", TinySpec(hidden=32, layers=1, heads=2, ffn=64, seed=0))
    other = build_tiny_model(tmp_path / "other", TinySpec(hidden=32, layers=1, heads=2, ffn=64, seed=1))
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + 1?"},
                                                     {"role": "assistant", "content": str(a + 1)}]}) + "\n"
                            for a in range(5)))
    assert forward_kl(base, base, rows) == pytest.approx(0.0, abs=1e-6)
    assert forward_kl(base, other, rows) > 0.01
