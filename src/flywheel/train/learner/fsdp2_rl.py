"""The RL update on a sharded learner (train/learner/ranks.py).

The batch. Every rank builds the same global batch (same data order, same groups), takes its
contiguous share (`Rank.share`) and scales its loss so that the reduce-scatter, run as a plain
SUM (`set_gradient_divide_factor(1.0)` + `set_force_sum_reduction_for_comms`: gloo has no
AVG / PREMUL_SUM), yields the gradient of the single-process loss on the whole batch:
- SFT: the loss is nll_sum / (trained tokens of the *whole* step), a normaliser every rank
  counts from the global batch, so no reduction is needed (train/sft.py);
- RL (`rl_step_fsdp2`): a minibatch's trajectories are split across ranks (partial groups;
  advantages are assigned on whole groups first, on every rank alike); rl_step's `update`
  normalises by the rank's own tokens (aggregation "token") or rows ("sequence",
  "constant"), so the gradient reaching the logits is multiplied by local / global of that
  normaliser. A rank left without a trajectory runs one with weight 0 (FSDP's collectives
  need every rank in every forward and backward).
The update then equals the single-process update up to float summation order, which AdamW
can turn into steps of up to lr on parameters whose gradient is noise-level
(tests/integration/test_fsdp2.py holds the bounds). The device mesh is given explicitly ("cpu" or "cuda"):
fully_shard's default mesh is CUDA wherever CUDA exists.

RL: run_rl drives `train.world_size` ranks of rl_learner.py's RLLearner through
group.py (`RankProcesses(channels=True)`: a socket per rank to the driver), each
updating with `rl_step_fsdp2`; `run_rl_updates` runs the update alone on given groups.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch

from flywheel.train.checkpoint import save_model_folder
from flywheel.train.learner.rank_processes import launch
from flywheel.train.learner.ranks import Rank
from flywheel.train.rl_step import (assign_advantages, merge_minibatches, proximal_logprobs, rl_step, split_groups,
                                    update)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@contextlib.contextmanager
def _scaled_logit_gradients(model, scale: float):
    """Multiply every gradient that reaches `model`'s output logits by `scale` (so every
    parameter gradient: the loss depends on the parameters only through the logits)."""
    if scale == 1.0:
        yield
        return

    def hook(module, args, output):
        output.logits = _ScaleGrad.apply(output.logits, scale)
        return output

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def rl_share(groups: list, rank: Rank, aggregation: str) -> tuple[list, float]:
    """(this rank's partial groups, its gradient scale) for one RL update on `groups`
    (advantages assigned): the update's trajectories split contiguously across ranks, and
    local / global of the normaliser `aggregation` divides by (loss tokens or rows)."""
    trajs = [(gi, t, a) for gi, g in enumerate(groups) for t, a in zip(g.trajectories, g.advantages)]
    mine = rank.share(trajs)
    empty = not mine
    if empty:  # fewer trajectories than ranks: run one with weight 0
        mine = trajs[:1]
    parts: dict[int, Any] = {}
    for gi, t, a in mine:
        if gi not in parts:
            parts[gi] = dataclasses.replace(groups[gi], trajectories=[], advantages=[])
        parts[gi].trajectories.append(t)
        parts[gi].advantages.append(a)
    if empty:
        return list(parts.values()), 0.0
    if aggregation == "token":
        def count(rows):
            return sum(sum(t.loss_mask[1:]) for _, t, _ in rows)
        local, total = max(1, count(mine)), max(1, count(trajs))
    else:  # "sequence" and "constant" divide by rows
        local, total = len(mine), len(trajs)
    return list(parts.values()), local / total


def rl_step_fsdp2(model, optimizer, groups: list, cfg, pad_id: int, rank: Rank, ref_model=None,
                  ref_context=contextlib.nullcontext) -> dict[str, float]:
    """train/rl_step.rl_step on a sharded learner: every rank passes the same `groups`; each
    runs rl_step's `update` on its share of every minibatch with its gradient scale
    (`rl_share`), and the reduce-scatter sums the shares into the single-process gradient.
    Metrics: loss summed over ranks (the global loss), trained_tokens summed, the other
    means weighted by each rank's tokens; grad_norm is already global. Plans of one model
    call only (RLStepConfig.one_forward); a non-finite loss on any rank skips the update on all."""
    groups = assign_advantages(groups, cfg.algo.advantage, cfg.algo.dynamic_sampling)
    if not groups:
        return {"skipped": 1.0, "groups": 0.0}
    # one model call per update on every rank (plain or prefix-tree plans): the KV-cache prefix
    # plan makes one or two from each rank's rows, and ranks whose module calls differ wait on
    # each other's all-gathers and reduce-scatters forever
    cfg = dataclasses.replace(cfg, one_forward=True)
    parts = []
    shares = [rl_share(chunk, rank, cfg.algo.aggregation) for chunk in split_groups(groups, cfg.minibatches)]
    # every rank makes the same calls: a proximal pass per later minibatch (rl_step.rl_step's rule)
    proximal = [None] + [proximal_logprobs(model, mine, cfg, pad_id, ref_model) for mine, _ in shares[1:]]
    for (mine, scale), before in zip(shares, proximal):
        with _scaled_logit_gradients(model, scale):
            m = update(model, optimizer, mine, cfg, pad_id, ref_model, ref_context,
                       all_finite=lambda finite: rank.sum([float(not finite)])[0] == 0, proximal_N=before)
        parts.append(_global_metrics(m, scale, rank))
    return merge_minibatches(groups, parts)


def _global_metrics(m: dict, scale: float, rank: Rank) -> dict:
    if m.get("skipped"):
        return m
    n = m["trained_tokens"] if scale else 0.0
    keys = sorted(k for k in m if k not in ("loss", "trained_tokens", "grad_norm", "skipped", "shared_prefix"))
    sums = rank.sum([m["loss"] * scale, n] + [m[k] * n for k in keys])
    out = dict(m, loss=sums[0], trained_tokens=sums[1])
    out.update({k: v / max(sums[1], 1.0) for k, v in zip(keys, sums[2:])})
    return out


def run_rl_updates(model: str | Path, batches: list[list], step_cfg, out_dir: str | Path, lr: float,
                   world_size: int = 1, device: str = "cpu", weight_decay: float = 0.0,
                   log: Callable[[str], None] = print) -> tuple[Path, list[dict]]:
    """Offline RL updates: `rl_step` on each list of trajectory groups in `batches`, from the
    model folder `model` with AdamW(lr), under FSDP2 on `world_size` ranks (world_size 1: in
    this process, unsharded). Writes the trained model to out_dir/final; returns (that
    folder, each step's metrics)."""
    payload = {"model": str(model), "batches": batches, "step_cfg": step_cfg, "out": str(out_dir), "lr": lr,
               "weight_decay": weight_decay}
    if world_size == 1:
        return _rl_updates(payload, None)
    return launch("flywheel.train.learner.fsdp2_rl:_rl_updates", payload, world_size, device, out_dir, log)


def _rl_updates(payload: dict, rank: Rank | None):
    from flywheel.models import load

    model, tokenizer = load(payload["model"], dtype="float32", device=rank.device if rank else "cpu")
    if rank is not None:
        model = rank.wrap(model, seed=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=payload["lr"],
                            weight_decay=payload["weight_decay"])
    history = []
    for groups in payload["batches"]:
        groups = [dataclasses.replace(g, advantages=[]) for g in groups]
        if rank is None:
            history.append(rl_step(model, opt, groups, payload["step_cfg"], tokenizer.pad_token_id))
        else:
            history.append(rl_step_fsdp2(model, opt, groups, payload["step_cfg"], tokenizer.pad_token_id, rank))
    final = Path(payload["out"]) / "final"
    if rank is None:
        save_model_folder(model, tokenizer, final)
    else:
        rank.save_model_folder(model, tokenizer, final)
    return final, history
