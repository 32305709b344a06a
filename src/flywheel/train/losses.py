"""Loss functions: pure, shapes documented, each returns (loss, metrics)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_nll_sum(logits_N_V: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Sum over N predicted tokens of -log p(target). logits are for the N positions that
    predict a trained token (already gathered), in any float dtype; computed in fp32."""
    return F.cross_entropy(logits_N_V.float(), targets_N, reduction="sum")


def sft_loss(model, input_ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor,
             target_mask_B_T: torch.Tensor, normalizer: float) -> tuple[torch.Tensor, dict]:
    """Next-token loss on trained tokens only, divided by `normalizer` (the number of trained
    tokens in the whole optimizer step, so gradient accumulation gives a token mean).

    The LM head runs only on positions that predict a trained token: position t predicts
    token t + 1, so we take hidden[:, :-1] where target_mask[:, 1:] is set.
    """
    hidden_B_T_H = model.model(input_ids=input_ids_B_T, attention_mask=attention_mask_B_T).last_hidden_state
    predict_B_Tm1 = target_mask_B_T[:, 1:].bool()
    hidden_N_H = hidden_B_T_H[:, :-1][predict_B_Tm1]
    targets_N = input_ids_B_T[:, 1:][predict_B_Tm1]
    nll = token_nll_sum(model.lm_head(hidden_N_H), targets_N)
    n = int(targets_N.numel())
    return nll / normalizer, {"nll_sum": float(nll.detach()), "tokens": n}
