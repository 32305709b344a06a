"""DPO recipe: preference pairs, a frozen reference (the starting model; with `train.lora`, the
trained model with its adapter switched off), the sigmoid or
IPO loss of train/losses.py on summed response log-probabilities.

Per step: `batch_size` pairs -> one forward of the policy over chosen and rejected
sequences together, one no-grad forward of the reference -> loss -> clip -> AdamW with the
warm-up + cosine schedule. Checkpoints and resume as in SFT.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from flywheel.config import DPOConfig
from flywheel.cpu_wait import CpuWait
from flywheel.rollout.data_order import DataOrder
from flywheel.train.checkpoint import save_checkpoint, save_model_folder
from flywheel.train.dpo_data import load_pairs
from flywheel.train.forward import set_learner_mode
from flywheel.train.lora import is_adapter_folder, load_trainable
from flywheel.train.losses import dpo_loss
from flywheel.train.metrics import MetricsWriter
from flywheel.train.padding import pad_batch
from flywheel.train.progress import StepProgress
from flywheel.train.rl_step import token_logprobs
from flywheel.train.run_state import restore_trainer_state, start_run, trainer_state
from flywheel.train.schedule import lr_multiplier
from flywheel.train.stop import Deadline, interrupted, interrupted_message


@dataclass
class DPOResult:
    output_dir: Path
    final_model: Path | None  # None when interrupted
    steps: int
    last: dict
    # loss tokens: the completion tokens of both sides (chosen_mask[1:] + rejected_mask[1:], the
    # positions whose log-probabilities the loss sums) of every pair in every step this call ran;
    # the reference's no-grad forward and validation are not counted. A resumed run counts only
    # the steps after its checkpoint, so the ledger records of a run's pieces never overlap.
    tokens_trained: int = 0
    interrupted: bool = False  # a stop request ended it early: checkpointed, no final model (train.stop)


def sequence_logprobs(model, pairs, pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities of the response tokens: (chosen (B,), rejected (B,))."""
    seqs = [p.chosen_ids for p in pairs] + [p.rejected_ids for p in pairs]
    masks = [p.chosen_mask for p in pairs] + [p.rejected_mask for p in pairs]
    ids, attn, tmask = pad_batch(seqs, masks, pad_id)
    logp, _ = token_logprobs(model, ids.to(device), attn.to(device))  # (2B, T - 1)
    summed = (logp * tmask[:, 1:].to(device)).sum(-1)
    return summed[:len(pairs)], summed[len(pairs):]


def run_dpo(cfg: DPOConfig, log: Callable[[str], None] = print) -> DPOResult:
    out = Path(cfg.output_dir)
    ckpt = start_run(out, cfg.resume, cfg.threads, cfg.train.seed, log)
    model, tokenizer = load_trainable(ckpt or cfg.model, cfg.train.lora, dtype="float32", device=cfg.device)
    # the reference is the starting model: with a fresh adapter, the trained model with its
    # adapter switched off (no second copy); else a frozen copy of cfg.model
    adapter_off = cfg.train.lora is not None and not is_adapter_folder(cfg.model)
    reference = None
    if not adapter_off:
        reference, _ = load_trainable(cfg.model, None, dtype="float32", device=cfg.device)
        reference.requires_grad_(False)
    pairs, skipped = load_pairs(cfg.data.train, tokenizer, cfg.data, log)
    log(f"train data: {len(pairs)} pairs" + (f", {skipped} lines skipped" if skipped else ""))
    val = load_pairs(cfg.data.val, tokenizer, cfg.data, log)[0] if cfg.data.val else []
    total = cfg.train.steps or max(1, math.ceil(cfg.train.epochs * len(pairs) / cfg.train.batch_size))
    oc = cfg.optim
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=oc.lr, betas=oc.betas, eps=oc.eps, weight_decay=oc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_multiplier(s, oc.warmup_steps, total, oc.min_lr_ratio, oc.decay))
    order = DataOrder(len(pairs), cfg.train.seed)
    step = 0
    if ckpt is not None:
        step = restore_trainer_state(ckpt, opt, sched, order, log)
    metrics = MetricsWriter.for_run(out / "metrics.jsonl", cfg.log, start_step=step, config=cfg)
    pad = tokenizer.pad_token_id
    last: dict = {}

    def losses_on(batch, train: bool):
        with torch.no_grad(), (model.disable_adapter() if adapter_off else contextlib.nullcontext()):
            rc, rr = sequence_logprobs(model if adapter_off else reference, batch, pad, cfg.device)
        with torch.set_grad_enabled(train):
            pc, pr = sequence_logprobs(model, batch, pad, cfg.device)
            return dpo_loss(pc, pr, rc, rr, beta=cfg.beta, loss_type=cfg.loss_type)

    def checkpoint() -> Path:
        return save_checkpoint(out, step, model, tokenizer, trainer_state(step, opt, sched, order, cfg),
                               keep=cfg.checkpoint.keep)

    deadline = Deadline(cfg.max_seconds)
    cpu_wait = CpuWait()  # warns when this process's threads wait for a CPU (oversubscribed)
    tokens_trained = 0  # DPOResult.tokens_trained
    with StepProgress(total, start=step, enabled=cfg.log.progress, description="dpo") as progress:
        while step < total and not deadline.passed():
            t0 = time.perf_counter()
            batch = [pairs[i] for i in order.take(cfg.train.batch_size)]
            tokens_trained += sum(sum(p.chosen_mask[1:]) + sum(p.rejected_mask[1:]) for p in batch)
            set_learner_mode(model, dropout=False)  # logprobs as the reference computes them
            loss, m = losses_on(batch, train=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), oc.grad_clip or math.inf)
            if torch.isfinite(grad_norm):
                opt.step()
            lr = sched.get_last_lr()[0]
            sched.step()
            step += 1
            record = {"loss": loss.item(), "lr": lr, "grad_norm": float(grad_norm), **m,
                      "pairs_per_s": len(batch) / (time.perf_counter() - t0)}
            last.update(record)
            metrics.log(step, **record)
            progress.update(step, loss=record["loss"], tokens_per_s=0.0)
            cpu_wait.after_step(step)
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < total:
                checkpoint()
    if interrupted(step, total):
        path = checkpoint()
        metrics.close()
        log(interrupted_message(step, total, path))
        return DPOResult(out, None, step, last, tokens_trained, interrupted=True)
    if val:
        vloss, vm = losses_on(val, train=False)
        record = {"val_loss": vloss.item(), **{f"val_{k}": v for k, v in vm.items()}}
        metrics.log(step, **record)
        last.update(record)
    checkpoint()
    final = out / "final"
    save_model_folder(model, tokenizer, final)
    metrics.close()
    return DPOResult(out, final, step, last, tokens_trained)
