"""One learner update on trajectory groups (GRPO family), as a pure-ish function of the model.

Batch layout: trajectories right-padded to T tokens; position t of the logits predicts token
t + 1, so every per-token tensor below is (B, T - 1) and aligned with `ids[:, 1:]`.
The forward runs the tokens that rows share (a group's prompt, duplicate completions) once and
projects logits only where the next token is a loss token (train/shared_prefix.py); the N
per-position results are scattered back to (B, T - 1) with zeros elsewhere (every consumer
masks them).
A step may split its groups into `minibatches` (whole groups each) with one optimizer update
per minibatch, as PPO's minibatches or TRL's steps_per_generation: more updates per sample.
The proximal policy of every update is the learner's weights at the step's start (the PPO
ratio is 1 in the first minibatch; the clip, or CISPO's clipped weight, bounds how far the
later ones move from it); the sampler's logprobs are the behaviour policy, corrected by
truncated importance sampling (train/losses.py) — the decoupled form AReaL and prime-rl use
for asynchronous training. With one minibatch a step the ratio is 1 throughout: the clip never
binds and eps_low / eps_high / objective change nothing, as in TRL with num_iterations=1.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from flywheel.config import AlgoConfig, RLConfig
from flywheel.rollout.advantages import BATCH_ESTIMATORS, ESTIMATORS, informative
from flywheel.train.forward import set_learner_mode
from flywheel.train.losses import policy_loss
from flywheel.train.shared_prefix import PlainPlan, attention_cost, plan_batch, plan_kinds
from flywheel.types import TrajectoryGroup


# The learner's settings RLConfig holds outside its `algo` section, by section (its `algo` is
# carried whole). LEARNER_ONLY settings are not in RLConfig: they keep their defaults.
FROM_SECTIONS = {"sampling": ("max_tokens", "temperature"), "optim": ("grad_clip",), "train": ("minibatches",)}
LEARNER_ONLY = ("shared_prefix", "autocast_bf16", "one_forward")


@dataclass
class RLStepConfig:
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # the objective, clip, advantages, IS cap, KL
    max_tokens: int | None = None  # for algo.aggregation="constant"
    grad_clip: float | None = 1.0
    minibatches: int = 1  # optimizer updates per step, each on len(groups) / minibatches whole groups
    # compute the tokens trajectories share (the group's prompt, duplicate completions) once:
    # same numbers as the plain forward up to float noise (train/shared_prefix.py)
    shared_prefix: bool = True
    # the sampling temperature T: the policy trained is softmax(logits / T), the distribution the
    # rollouts were drawn from (whose logprobs the sampler reports in "processed" mode), as
    # verl and prime-rl do; training the T = 1 policy on T < 1 samples would bias the gradient
    temperature: float = 1.0
    # bf16 autocast for the learner's forward. Off: on the tiny bench model (CPU) it is no
    # faster and moves logprobs by up to ~0.2 nats (mean ~0.008), which the IS ratio sees
    autocast_bf16: bool = False
    # only plans of one model call per update (plain or the prefix tree, not the KV-cache prefix
    # plan, whose suffix call depends on the rows): every rank of a sharded learner then makes
    # the same module calls, which FSDP's collectives need (train/learner/fsdp2_rl.py)
    one_forward: bool = False

    @classmethod
    def from_config(cls, cfg: RLConfig) -> RLStepConfig:
        """`cfg.algo` as it is, and the settings FROM_SECTIONS names."""
        values = {name: getattr(getattr(cfg, section), name) for section, names in FROM_SECTIONS.items()
                  for name in names}
        return cls(algo=cfg.algo, **values)


def assign_advantages(groups: list[TrajectoryGroup], how: str, dynamic_sampling: bool) -> list[TrajectoryGroup]:
    """The groups kept (with dynamic sampling, those whose rewards differ), each with its
    advantages: per group (ESTIMATORS) or over the kept groups together (BATCH_ESTIMATORS)."""
    if how not in ESTIMATORS and how not in BATCH_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {how!r}: use {', '.join([*ESTIMATORS, *BATCH_ESTIMATORS])}")
    kept, rewards = [], []
    for g in groups:
        r = torch.tensor([t.reward for t in g.trajectories], dtype=torch.float32)
        if dynamic_sampling and not informative(r):
            continue
        kept.append(g)
        rewards.append(r)
    advantages = BATCH_ESTIMATORS[how](rewards) if how in BATCH_ESTIMATORS else [ESTIMATORS[how](r) for r in rewards]
    for g, a in zip(kept, advantages):
        g.advantages = a.tolist()
    return kept


def pack(groups: list[TrajectoryGroup], pad_id: int, device) -> dict[str, torch.Tensor]:
    trajs = [t for g in groups for t in g.trajectories]
    advs = [a for g in groups for a in g.advantages]
    T = max(len(t.ids) for t in trajs)
    B = len(trajs)

    def padded(rows, fill, dtype):  # (B, T)
        return torch.tensor([list(r) + [fill] * (T - len(r)) for r in rows], dtype=dtype).reshape(B, T)

    ids = padded((t.ids for t in trajs), pad_id, torch.long)
    attn = padded(([1] * len(t.ids) for t in trajs), 0, torch.long)
    mask = padded((t.loss_mask for t in trajs), 0, torch.float32)
    behavior = padded((t.behavior_logprobs for t in trajs), 0.0, torch.float32)
    return {"ids": ids.to(device), "attention_mask": attn.to(device), "mask": mask[:, 1:].to(device),
            "behavior": behavior[:, 1:].to(device), "advantages": torch.tensor(advs, device=device)}


def token_logprobs(model, ids_B_T: torch.Tensor, attention_mask_B_T: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(ids[:, 1:]), entropy) under the model, each (B, T - 1), fp32."""
    logits = model(input_ids=ids_B_T, attention_mask=attention_mask_B_T).logits[:, :-1].float()
    return logprobs_entropy(logits, ids_B_T[:, 1:])


def logprobs_entropy(logits_B_T_V: torch.Tensor, targets_B_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) from fp32 logits (..., V); entropy carries no gradient."""
    logz = torch.logsumexp(logits_B_T_V, -1)
    logp = logits_B_T_V.gather(-1, targets_B_T[..., None]).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (torch.softmax(logits_B_T_V, -1) * logits_B_T_V).sum(-1)
    return logp, entropy


def loss_position_logprobs(model, plan, autocast_bf16: bool = False, temperature: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logp_N, entropy_N) of softmax(logits / temperature) at the plan's N loss positions
    (train/shared_prefix.py), fp32. The plan's Nn node logits are normalised once per node,
    then gathered per position."""
    if not temperature > 0:
        raise ValueError(f"the learner's temperature must be > 0, got {temperature!r}")
    device = next(model.parameters()).device
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
        logits = plan.logits(model)  # (Nn, V)
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logz_Nn = torch.logsumexp(logits, -1)
    logp_N = logits[plan.src_N, plan.targets_N] - logz_Nn[plan.src_N]
    with torch.no_grad():
        entropy_Nn = logz_Nn - (torch.softmax(logits, -1) * logits).sum(-1)
    return logp_N, entropy_Nn[plan.src_N]


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ without its multiply-by-1 pass over every gradient when
    the norm is within bounds (same result: the clamped coefficient is then exactly 1)."""
    if not (hasattr(torch.nn.utils, "get_total_norm") and hasattr(torch.nn.utils, "clip_grads_with_norm_")):
        return torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)  # torch < 2.6
    total = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if max_norm and torch.isfinite(total) and max_norm / (float(total) + 1e-6) < 1.0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def split_groups(groups: list, parts: int) -> list[list]:
    """Contiguous, near-equal chunks of whole groups: 8 groups in 3 parts -> sizes 3, 3, 2."""
    parts = max(1, min(parts, len(groups)))
    size, extra = divmod(len(groups), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + size + (1 if i < extra else 0)
        chunks.append(groups[start:end])
        start = end
    return chunks


def rl_step(model, optimizer, groups: list[TrajectoryGroup], cfg: RLStepConfig, pad_id: int,
            ref_model=None, ref_context=contextlib.nullcontext) -> dict[str, float]:
    """Advantages, then per minibatch: loss, backward, clip and optimizer step. `ref_model`
    runs under `ref_context()` (a LoRA learner is its own reference with its adapter off:
    ref_model = model, ref_context = peft's disable_adapter). Returns metrics
    (means over the minibatches; groups and trained_tokens summed); a non-finite loss or
    gradient skips that update, and metrics["skipped"] = 1 when every update was skipped."""
    groups = assign_advantages(groups, cfg.algo.advantage, cfg.algo.dynamic_sampling)
    if not groups:
        return {"skipped": 1.0, "groups": 0.0}
    chunks = split_groups(groups, cfg.minibatches)
    # the PPO ratio of every minibatch is to the weights at the step's start (ratio 1 for the
    # first), so the clip bounds how far the later updates move from them
    proximal = [None] + [proximal_logprobs(model, chunk, cfg, pad_id, ref_model) for chunk in chunks[1:]]
    parts = [update(model, optimizer, chunk, cfg, pad_id, ref_model, ref_context, proximal_N=before)
             for chunk, before in zip(chunks, proximal)]
    return merge_minibatches(groups, parts)


def merge_minibatches(groups: list[TrajectoryGroup], parts: list[dict[str, float]]) -> dict[str, float]:
    """A step's metrics from its minibatch updates' (`parts`, in order): means over the
    updates applied, trained_tokens summed, the step's groups and mean reward; the last
    update's metrics when every one was skipped."""
    done = [m for m in parts if not m["skipped"]]
    if not done:
        return parts[-1]
    merged = {k: sum(m[k] for m in done) / len(done) for k in done[0]}
    trajs = [t for g in groups for t in g.trajectories]
    merged.update(groups=float(len(groups)), trained_tokens=sum(m["trained_tokens"] for m in done),
                  reward_mean=sum(t.reward for t in trajs) / len(trajs),
                  skipped=0.0, skipped_minibatches=float(len(parts) - len(done)))
    return merged


def _plan(model, groups: list[TrajectoryGroup], cfg: RLStepConfig, pad_id: int, use_ref: bool, ref_model=None):
    """(packed batch, forward plan, keep): keep is (B, T - 1), True at the plan's N loss
    positions in row-major order. Deterministic in its inputs, so the proximal pass and the
    update of the same groups share one plan."""
    device = next(model.parameters()).device
    batch = pack(groups, pad_id, device)
    kinds = plan_kinds(model) if cfg.shared_prefix else ()
    if cfg.one_forward:
        kinds = tuple(k for k in kinds if k == "tree")
    if use_ref:
        kinds = tuple(k for k in kinds if k in plan_kinds(ref_model))
    rows, b = [], 0
    for g in groups:
        rows.append(list(range(b, b + len(g.trajectories))))
        b += len(g.trajectories)
    trajs = [t for g in groups for t in g.trajectories]
    plan = plan_batch([t.ids for t in trajs], [t.loss_mask for t in trajs], rows, pad_id, device, share=bool(kinds),
                      attn_cost=attention_cost(model), kinds=kinds)
    keep = batch["mask"] != 0
    if int(keep.sum()) != plan.targets_N.numel():
        raise ValueError("loss_mask and ids disagree in length for some trajectory")
    return batch, plan, keep


def proximal_logprobs(model, groups: list[TrajectoryGroup], cfg: RLStepConfig, pad_id: int,
                      ref_model=None) -> torch.Tensor:
    """logp_N of `groups` under the model as it is now, no gradient: a step's proximal policy
    (the PPO ratio's denominator) for its second and later minibatches."""
    _, plan, _ = _plan(model, groups, cfg, pad_id, ref_model is not None and bool(cfg.algo.kl_beta), ref_model)
    set_learner_mode(model, dropout=False)
    with torch.no_grad():
        return loss_position_logprobs(model, plan, cfg.autocast_bf16, cfg.temperature)[0]


def update(model, optimizer, groups: list[TrajectoryGroup], cfg: RLStepConfig, pad_id: int,
           ref_model=None, ref_context=contextlib.nullcontext,
           all_finite: Callable[[bool], bool] = lambda finite: finite,
           proximal_N: torch.Tensor | None = None) -> dict[str, float]:
    """One optimizer update on groups whose advantages are assigned; its loss and gradient
    metrics (the step's groups and rewards are rl_step's). all_finite(this loss is finite)
    -> whether to go on: a sharded learner's ranks agree there, so none skips the backward
    that the others' collectives wait for. proximal_N: the PPO ratio's denominator at the
    plan's loss positions (proximal_logprobs before the step's first update); None: the
    weights as they are (ratio 1, the first minibatch's)."""
    use_ref = ref_model is not None and bool(cfg.algo.kl_beta)
    batch, plan, keep = _plan(model, groups, cfg, pad_id, use_ref, ref_model)
    set_learner_mode(model, dropout=False)  # the sampler's mode: on-policy logprobs are equal
    logp_N, entropy_N = loss_position_logprobs(model, plan, cfg.autocast_bf16, cfg.temperature)
    logp = torch.zeros_like(batch["mask"]).masked_scatter(keep, logp_N)
    old = logp.detach() if proximal_N is None else torch.zeros_like(batch["mask"]).masked_scatter(keep, proximal_N)
    ref = None
    if use_ref:
        with torch.no_grad(), ref_context():
            ref_N, _ = loss_position_logprobs(ref_model, plan, cfg.autocast_bf16, cfg.temperature)
        ref = torch.zeros_like(batch["mask"]).masked_scatter(keep, ref_N)
    algo = cfg.algo
    loss, metrics = policy_loss(logp, old, batch["advantages"], batch["mask"],
                                eps_low=algo.eps_low, eps_high=algo.eps_high, aggregation=algo.aggregation,
                                max_tokens=cfg.max_tokens, ref_logp_B_T=ref, kl_beta=algo.kl_beta,
                                behavior_logp_B_T=batch["behavior"], is_cap=algo.is_cap, objective=algo.objective)
    optimizer.zero_grad(set_to_none=True)
    if not all_finite(bool(torch.isfinite(loss))):
        return {"skipped": 1.0, "loss": loss.item()}
    loss.backward()
    grad_norm = clip_grad_norm(list(model.parameters()), cfg.grad_clip)
    if not torch.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        return {"skipped": 1.0, "grad_norm": float(grad_norm)}
    optimizer.step()
    n = batch["mask"].sum().clamp_min(1)
    return {**metrics, "loss": loss.item(), "grad_norm": float(grad_norm), "skipped": 0.0,
            "entropy": float((entropy_N * batch["mask"][keep]).sum() / n), "trained_tokens": float(n),
            "shared_prefix": float(not isinstance(plan, PlainPlan))}
