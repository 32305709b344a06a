"""Loss functions: pure, shapes documented, each returns (loss, metrics); sft_loss runs the
model's own forward (train/forward.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flywheel.train.forward import logits_at


def token_nll_sum(logits_N_V: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Sum over N predicted tokens of -log p(target). logits are for the N positions that
    predict a trained token (already gathered), in any float dtype; computed in fp32."""
    return F.cross_entropy(logits_N_V.float(), targets_N, reduction="sum")


def sft_loss(model, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor,
             target_mask_B_T: torch.Tensor, normalizer: float) -> tuple[torch.Tensor, dict]:
    """Next-token loss on trained tokens only, divided by `normalizer` (the number of trained
    tokens in the whole optimizer step, so gradient accumulation gives a token mean).

    Position t predicts token t + 1, so the kept positions are keep[:, :-1] = target_mask[:, 1:];
    the model's own forward projects only those where it can (train/forward.py).
    """
    predict_B_Tm1 = target_mask_B_T[:, 1:].bool()
    keep_B_T = torch.cat([predict_B_Tm1, predict_B_Tm1.new_zeros(len(predict_B_Tm1), 1)], dim=1)
    targets_N = input_ids_B_T[:, 1:][predict_B_Tm1]
    logits_N_V = logits_at(model, keep_B_T, input_ids=input_ids_B_T, attention_mask=attention_mask_B_T,
                           use_cache=False)
    nll = token_nll_sum(logits_N_V, targets_N)
    n = int(targets_N.numel())
    return nll / normalizer, {"nll_sum": float(nll.detach()), "tokens": n}
