"""The losses, pure: token NLL (SFT), the forward KL to a reference (SFT's distilled rows),
the clipped policy-gradient surrogate (RL) and DPO / IPO
(preference). Each takes tensors and returns a tensor or (loss, metrics).

Shapes: B sequences, T completion positions (right-padded); `mask_B_T` is 1 on tokens the
loss covers (the policy's own tokens; tool and environment tokens are 0).

Clipped surrogate (PPO, Schulman et al. 2017; GRPO, Shao et al. 2024), per token t of sequence b:
    ratio = exp(logp - old_logp)
    l_t = -min(ratio * A_b, clip(ratio, 1 - eps_low, 1 + eps_high) * A_b) * is_weight_t + beta * KL_t
- DAPO clip-higher (Yu et al. 2025): eps_high > eps_low lets low-probability tokens rise.
- CISPO (MiniMax-M1, arXiv:2506.13585), `objective="cispo"`: the clip moves from the update to
  a detached weight, so every token keeps its gradient:
    l_t = -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A_b * logp_t * is_weight_t + beta * KL_t
  At ratio = 1 (one update per batch: the proximal policy is the learner's own weights) its
  gradient equals PPO's; the two differ only from a step's second minibatch on.
- KL to a reference with the k3 estimator (Schulman, "Approximating KL divergence", 2020):
  KL_t = exp(ref - logp) - (ref - logp) - 1, unbiased for KL(pi || ref) and always >= 0.
- Truncated importance sampling for off-policy tokens (Yao et al. 2025, "Your efficient RL
  framework secretly brings you off-policy RL training"): when the sampler's logprobs
  (`behavior_logp`) differ from the learner's at sampling time (`old_logp`, stale weights or
  kernel mismatch), weight each token by min(exp(old_logp - behavior_logp), is_cap).
Aggregation over tokens:
- "sequence": mean over sequences of each sequence's token mean (original GRPO);
- "token": sum over all tokens / number of tokens (DAPO);
- "constant": sum over all tokens / (B * max_tokens) (Dr. GRPO: no length normalisation).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

Aggregation = Literal["sequence", "token", "constant"]
Objective = Literal["ppo", "cispo"]


def token_kl(ref_logits_N_V: torch.Tensor, logits_N_V: torch.Tensor) -> torch.Tensor:
    """KL(softmax(ref) || softmax(logits)) at each of N positions, (N,), in fp32: the forward
    (mass-covering) KL, large where the model loses probability the reference gives."""
    ref = torch.log_softmax(ref_logits_N_V.float(), -1)
    model = torch.log_softmax(logits_N_V.float(), -1)
    return (ref.exp() * (ref - model)).sum(-1)


def token_nll_sum(logits_N_V: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
    """Sum over N predicted tokens of -log p(target). logits are for the N positions that
    predict a trained token (already gathered), in any float dtype; computed in fp32."""
    return F.cross_entropy(logits_N_V.float(), targets_N, reduction="sum")


def k3_kl(logp_B_T: torch.Tensor, ref_logp_B_T: torch.Tensor) -> torch.Tensor:
    d = ref_logp_B_T - logp_B_T
    return torch.exp(d) - d - 1.0


def aggregate(values_B_T: torch.Tensor, mask_B_T: torch.Tensor, how: Aggregation,
              max_tokens: int | None = None) -> torch.Tensor:
    mask = mask_B_T.to(values_B_T.dtype)
    if how == "token":
        return (values_B_T * mask).sum() / mask.sum().clamp_min(1.0)
    if how == "sequence":
        per_seq = (values_B_T * mask).sum(-1) / mask.sum(-1).clamp_min(1.0)
        return per_seq.mean()
    if how == "constant":
        if not max_tokens:
            raise ValueError("'constant' aggregation needs max_tokens (the generation budget)")
        return (values_B_T * mask).sum() / (values_B_T.shape[0] * max_tokens)
    raise ValueError(f"unknown aggregation {how!r}: use sequence, token or constant")


def policy_loss(logp_B_T: torch.Tensor, old_logp_B_T: torch.Tensor, advantages_B: torch.Tensor,
                mask_B_T: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.2,
                aggregation: Aggregation = "token", max_tokens: int | None = None,
                ref_logp_B_T: torch.Tensor | None = None, kl_beta: float = 0.0,
                behavior_logp_B_T: torch.Tensor | None = None, is_cap: float = 2.0,
                objective: Objective = "ppo") -> tuple[torch.Tensor, dict]:
    """Clipped policy-gradient loss (see the module docstring). Returns (loss, metrics)."""
    mask = mask_B_T.to(logp_B_T.dtype)
    ratio = torch.exp(logp_B_T - old_logp_B_T)
    adv = advantages_B[:, None]
    if objective == "ppo":
        unclipped = ratio * adv
        clipped = ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
    elif objective == "cispo":
        per_token = -ratio.clamp(1.0 - eps_low, 1.0 + eps_high).detach() * adv * logp_B_T
    else:
        raise ValueError(f"unknown policy objective {objective!r}: use ppo or cispo")
    metrics = {}
    if behavior_logp_B_T is not None:
        is_weight = torch.exp(old_logp_B_T - behavior_logp_B_T).clamp(max=is_cap).detach()
        per_token = per_token * is_weight
        metrics["is_weight_mean"] = float((is_weight * mask).sum() / mask.sum().clamp_min(1))
        metrics["mismatch_kl"] = float((k3_kl(behavior_logp_B_T, old_logp_B_T) * mask).sum()
                                       / mask.sum().clamp_min(1))
    if ref_logp_B_T is not None and kl_beta:
        kl = k3_kl(logp_B_T, ref_logp_B_T)
        per_token = per_token + kl_beta * kl
        metrics["kl_ref"] = float((kl.detach() * mask).sum() / mask.sum().clamp_min(1))
    loss = aggregate(per_token, mask, aggregation, max_tokens)
    with torch.no_grad():
        was_clipped = ((ratio < 1.0 - eps_low) & (adv < 0)) | ((ratio > 1.0 + eps_high) & (adv > 0))
        n = mask.sum().clamp_min(1)
        metrics.update(clip_fraction=float((was_clipped.to(mask.dtype) * mask).sum() / n),
                       ratio_mean=float((ratio * mask).sum() / n))
    return loss, metrics


def dpo_loss(chosen_logp_B: torch.Tensor, rejected_logp_B: torch.Tensor, ref_chosen_logp_B: torch.Tensor,
             ref_rejected_logp_B: torch.Tensor, beta: float = 0.1,
             loss_type: Literal["sigmoid", "ipo"] = "sigmoid") -> tuple[torch.Tensor, dict]:
    """DPO over B preference pairs; inputs are summed log-probabilities of each response.

    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    sigmoid (Rafailov et al. 2023, arXiv:2305.18290): -log sigmoid(beta * h)
    ipo (Azar et al. 2023, arXiv:2310.12036): (h - 1 / (2 beta))^2
    """
    h = (chosen_logp_B - ref_chosen_logp_B) - (rejected_logp_B - ref_rejected_logp_B)
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "ipo":
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}: use sigmoid or ipo")
    with torch.no_grad():
        chosen_reward = beta * (chosen_logp_B - ref_chosen_logp_B)
        rejected_reward = beta * (rejected_logp_B - ref_rejected_logp_B)
        metrics = {"reward_margin": float((chosen_reward - rejected_reward).mean()),
                   "reward_accuracy": float((chosen_reward > rejected_reward).float().mean())}
    return losses.mean(), metrics
