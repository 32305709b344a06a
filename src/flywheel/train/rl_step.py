"""One learner update on trajectory groups (GRPO family), as a pure-ish function of the model.

Batch layout: trajectories right-padded to T tokens; position t of the logits predicts token
t + 1, so every per-token tensor below is (B, T - 1) and aligned with `ids[:, 1:]`.
The proximal policy is the learner's own weights before this update (one update per batch,
so the PPO ratio starts at 1); the sampler's logprobs are the behaviour policy, corrected by
truncated importance sampling (train/rl_losses.py) — the decoupled form AReaL and prime-rl
use for asynchronous training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flywheel.rollout.advantages import ESTIMATORS, informative
from flywheel.train.rl_losses import Aggregation, policy_loss
from flywheel.types import TrajectoryGroup


@dataclass
class RLStepConfig:
    advantage: str = "grpo"  # grpo | dr_grpo | rloo
    eps_low: float = 0.2
    eps_high: float = 0.2  # > eps_low: DAPO clip-higher
    aggregation: Aggregation = "token"
    max_tokens: int | None = None  # for aggregation="constant"
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal
    is_cap: float = 2.0
    kl_beta: float = 0.0
    grad_clip: float | None = 1.0


def assign_advantages(groups: list[TrajectoryGroup], how: str, dynamic_sampling: bool) -> list[TrajectoryGroup]:
    if how not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {how!r}: use {', '.join(ESTIMATORS)}")
    kept = []
    for g in groups:
        rewards = torch.tensor([t.reward for t in g.trajectories], dtype=torch.float32)
        if dynamic_sampling and not informative(rewards):
            continue
        g.advantages = ESTIMATORS[how](rewards).tolist()
        kept.append(g)
    return kept


def pack(groups: list[TrajectoryGroup], pad_id: int, device) -> dict[str, torch.Tensor]:
    trajs = [t for g in groups for t in g.trajectories]
    advs = [a for g in groups for a in g.advantages]
    T = max(len(t.ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T)
    behavior = torch.zeros(B, T)
    for b, t in enumerate(trajs):
        n = len(t.ids)
        ids[b, :n] = torch.tensor(t.ids)
        attn[b, :n] = 1
        mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        behavior[b, :n] = torch.tensor(t.behavior_logprobs, dtype=torch.float32)
    return {"ids": ids.to(device), "attention_mask": attn.to(device), "mask": mask[:, 1:].to(device),
            "behavior": behavior[:, 1:].to(device), "advantages": torch.tensor(advs, device=device)}


def token_logprobs(model, ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(ids[:, 1:]), entropy) under the model, each (B, T - 1), fp32."""
    logits = model(input_ids=ids_B_T, attention_mask=attention_mask_B_T).logits[:, :-1].float()
    logz = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, ids_B_T[:, 1:, None]).squeeze(-1) - logz
    with torch.no_grad():
        probs = torch.softmax(logits, -1)
        entropy = logz - (probs * logits).sum(-1)
    return logp, entropy


def rl_step(model, optimizer, groups: list[TrajectoryGroup], cfg: RLStepConfig, pad_id: int,
            ref_model=None) -> dict[str, float]:
    """Advantages, loss, backward, clip and optimizer step. Returns metrics; a non-finite
    loss or gradient skips the update (metrics["skipped"] = 1)."""
    groups = assign_advantages(groups, cfg.advantage, cfg.dynamic_sampling)
    if not groups:
        return {"skipped": 1.0, "groups": 0.0}
    device = next(model.parameters()).device
    batch = pack(groups, pad_id, device)
    model.train()
    logp, entropy = token_logprobs(model, batch["ids"], batch["attention_mask"])
    ref = None
    if ref_model is not None and cfg.kl_beta:
        with torch.no_grad():
            ref, _ = token_logprobs(ref_model, batch["ids"], batch["attention_mask"])
    loss, metrics = policy_loss(logp, logp.detach(), batch["advantages"], batch["mask"],
                                eps_low=cfg.eps_low, eps_high=cfg.eps_high, aggregation=cfg.aggregation,
                                max_tokens=cfg.max_tokens, ref_logp_B_T=ref, kl_beta=cfg.kl_beta,
                                behavior_logp_B_T=batch["behavior"], is_cap=cfg.is_cap)
    optimizer.zero_grad(set_to_none=True)
    if not torch.isfinite(loss):
        return {"skipped": 1.0, "loss": loss.item()}
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip or math.inf)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": 1.0, "grad_norm": float(grad_norm)}
    optimizer.step()
    mask = batch["mask"]
    n = mask.sum().clamp_min(1)
    rewards = [t.reward for g in groups for t in g.trajectories]
    return {**metrics, "loss": loss.item(), "grad_norm": float(grad_norm), "skipped": 0.0,
            "entropy": float((entropy * mask).sum() / n), "groups": float(len(groups)),
            "reward_mean": sum(rewards) / len(rewards), "trained_tokens": float(n)}
