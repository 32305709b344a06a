"""Advantages for a group of G attempts at one task (pure functions on (G,) tensors).

- GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): A_i = (r_i - mean(r)) / (std(r) + eps),
  std over the group (population std, as in the paper's formula; TRL uses the sample std).
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783):
  A_i = r_i - mean(r); no std normalisation (it over-weights easy and hard groups).
- RLOO (Ahmadian et al. 2024, arXiv:2402.14740): A_i = r_i - mean_{j != i} r_j
  = G / (G - 1) * (r_i - mean(r)).
- Batch-normalised GRPO (ScaleRL, Khatri et al. 2025, arXiv:2510.13786): each group's rewards
  centred on the group's mean, all scaled by one std, that of every centred reward of the
  step's batch: a group with 1 success in 8 weighs no more than one with 4 (per-group std
  scales the first's advantages up 1.5x), and no group's advantages blow up when its std is tiny.
- DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476): a group whose rewards are all
  equal has zero advantage everywhere and teaches nothing; `informative` says which to keep.
"""

from __future__ import annotations

import torch


def grpo_advantages(rewards_G: torch.Tensor, eps: float = 1e-6, normalize_std: bool = True) -> torch.Tensor:
    centered = rewards_G - rewards_G.mean()
    if not normalize_std:
        return centered
    return centered / (rewards_G.std(unbiased=False) + eps)


def dr_grpo_advantages(rewards_G: torch.Tensor) -> torch.Tensor:
    return grpo_advantages(rewards_G, normalize_std=False)


def rloo_advantages(rewards_G: torch.Tensor) -> torch.Tensor:
    G = rewards_G.shape[0]
    if G < 2:
        raise ValueError("RLOO needs at least 2 samples per group")
    return (rewards_G - rewards_G.mean()) * (G / (G - 1))


def batch_normalized_advantages(rewards_per_group: list[torch.Tensor], eps: float = 1e-6) -> list[torch.Tensor]:
    """[(G_i,) rewards] -> [(G_i,) advantages]: r - mean(group), over the population std of all
    those centred values together."""
    centered = [r - r.mean() for r in rewards_per_group]
    if not centered:
        return []
    std = torch.cat(centered).std(unbiased=False)
    return [c / (std + eps) for c in centered]


def informative(rewards_G: torch.Tensor, atol: float = 1e-9) -> bool:
    """False when every reward in the group is the same (DAPO dynamic sampling drops it)."""
    return bool((rewards_G - rewards_G[0]).abs().max() > atol)


ESTIMATORS = {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}  # per group
BATCH_ESTIMATORS = {"grpo_batch": batch_normalized_advantages}  # over a step's groups together
