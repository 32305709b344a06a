"""Forgetting as a distribution shift: the forward KL from the base model to a later one on the
old family's held-out conversations, beside the accuracy (which can hold while the model's
distribution drifts).

    KL(base || model) per assistant token = sum_v p_base(v | ctx) (log p_base(v | ctx) - log p_model(v | ctx))

averaged over every assistant token of scripted conversations (tool call, result, answer) on
problems of the family's test split. Forward (mass-covering) KL: it grows when the model loses
probability on what the base would say. 0 for the base itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from flywheel.config import SFTDataConfig
from flywheel.train.losses import token_kl
from flywheel.train.sft_data import load_sft_examples


@torch.no_grad()
def forward_kl(base_dir: str | Path, model_dir: str | Path, rows_path: str | Path, batch: int = 16) -> float:
    """Mean KL(base || model) over the assistant tokens of the chat rows in `rows_path` (each
    token's KL at the position that predicts it). Both models share the base's tokenizer; a
    LoRA adapter folder is measured merged into its base."""
    from flywheel.models import load
    from flywheel.train.lora import whole_model

    base, tokenizer = load(base_dir)
    model, _ = load(whole_model(model_dir))
    base.eval(), model.eval()
    examples, _ = load_sft_examples([str(rows_path)], tokenizer, SFTDataConfig(train=[str(rows_path)], format="chat"))
    total, tokens = 0.0, 0
    for start in range(0, len(examples), batch):
        part = examples[start:start + batch]
        T = max(len(e.ids) for e in part)
        ids = torch.tensor([e.ids + [tokenizer.pad_token_id] * (T - len(e.ids)) for e in part])
        attn = torch.tensor([[1] * len(e.ids) + [0] * (T - len(e.ids)) for e in part])
        mask = torch.tensor([e.loss_mask + [0] * (T - len(e.ids)) for e in part])[:, 1:].bool()  # (B, T - 1)
        p = base(input_ids=ids, attention_mask=attn).logits[:, :-1][mask]  # (N, V)
        q = model(input_ids=ids, attention_mask=attn).logits[:, :-1][mask]
        total += float(token_kl(p, q).sum())
        tokens += int(mask.sum())
    return total / max(tokens, 1)
