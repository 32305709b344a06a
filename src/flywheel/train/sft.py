"""Supervised fine-tuning recipe.

Reads top to bottom: load the model and data -> AdamW with linear warm-up and cosine decay
-> for each optimizer step, `batch_size` examples in micro-batches of `micro_batch_size`
(gradient accumulation), loss = mean negative log-likelihood over the *trained* tokens of
the whole step (assistant turns / completions; see sft_data.py), the forward KL to the model
with its adapter off at a distilled row's tokens (`"distill": true`) -> clip -> step.

Departures from a textbook loop, all for continuous post-training:
- the loss is a token mean over the step, not a mean of micro-batch means, so accumulation
  gives the same gradient as one big batch;
- the LM head runs only on positions that predict a trained token (forward.py);
- checkpoints carry everything needed to continue bit-for-bit: weights, optimizer,
  scheduler, step, RNG states and the data cursor; `resume=true` continues from the newest
  complete one, and a killed run resumed follows the uninterrupted loss curve.
"""

from __future__ import annotations

import importlib
import math
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from flywheel.config import SFTConfig
from flywheel.train.lora import is_adapter_folder, load_trainable, trainable_count
from flywheel.rollout.data_order import DataOrder
from flywheel.train.checkpoint import save_checkpoint, save_model_folder
from flywheel.train.forward import distill_loss, set_learner_mode, sft_loss
from flywheel.train.metrics import MetricsWriter
from flywheel.train.padding import pad_batch
from flywheel.train.progress import StepProgress
from flywheel.errors import TrainError
from flywheel.train.run_state import restore_trainer_state, start_run, trainer_state
from flywheel.train.stop import Deadline, interrupted, interrupted_message
from flywheel.cpu_wait import CpuWait
from flywheel.train.schedule import lr_multiplier
from flywheel.train.sft_data import Example, load_sft_examples
from flywheel.train.shared_prefix import shared_nll_sum

if TYPE_CHECKING:
    from flywheel.train.learner.ranks import Rank

Evaluator = Callable[[object, object], dict]


@dataclass
class SFTResult:
    output_dir: Path
    final_model: Path | None  # None when interrupted
    steps: int
    resumed_from: int | None
    last: dict = field(default_factory=dict)  # last logged train / eval metrics
    # loss tokens (the targets predicted: loss_mask[1:] of each example) summed over every
    # optimizer step this call ran, a skipped non-finite update included (it was computed);
    # validation and evaluator tokens are not. A resumed run counts only the steps after its
    # checkpoint, so the ledger records of a run's pieces add up to the run, never twice.
    tokens_trained: int = 0
    interrupted: bool = False  # a stop request ended it early: checkpointed, no final model (train.stop)


def run_sft(cfg: SFTConfig, evaluator: Evaluator | None = None, log: Callable[[str], None] = print,
            dist: Rank | None = None) -> SFTResult:
    """`dist`: this process's rank when run_sft runs inside an FSDP2 learner (train/learner/ranks.py);
    with `train.strategy: fsdp2` and no `dist`, run_sft launches the ranks and returns rank 0's result."""
    if cfg.train.strategy == "fsdp2" and dist is None:
        if evaluator is not None:
            raise TrainError("train.strategy=fsdp2 does not run an evaluator callable; validate with "
                             "data.val / data.val_fraction, or evaluate the checkpoints")
        return launch_sft(cfg, log)
    out = Path(cfg.output_dir)
    ckpt = start_run(out, cfg.resume, cfg.threads, cfg.train.seed, log)
    model, tokenizer = _load_model(cfg, ckpt, dist, log)
    evaluator = evaluator or _import_evaluator(cfg.eval.evaluator)

    examples, val_examples = _load_data(cfg, tokenizer, log)
    reference = _reference(model, examples, dist)
    tc = cfg.train
    total_steps = tc.steps or max(1, math.ceil(tc.epochs * len(examples) / tc.batch_size))

    # ---- optimizer, schedule, data order
    optimizer = _adamw(model, cfg)
    oc = cfg.optim
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_multiplier(s, oc.warmup_steps, total_steps, oc.min_lr_ratio, oc.decay))
    order = DataOrder(len(examples), tc.seed)
    step, resumed_from = 0, None
    if ckpt is not None:
        step = resumed_from = (dist.restore(ckpt, model, optimizer, scheduler, order, log) if dist else
                               restore_trainer_state(ckpt, optimizer, scheduler, order, log))

    metrics = _metrics_writer(out, cfg, dist, step)
    pad_id = tokenizer.pad_token_id
    last: dict = {}

    def checkpoint() -> Path:
        state = trainer_state(step, optimizer, scheduler, order, cfg)
        if dist is not None:
            return dist.save_checkpoint(out, step, model, optimizer, tokenizer, state, keep=cfg.checkpoint.keep)
        return save_checkpoint(out, step, model, tokenizer, state, keep=cfg.checkpoint.keep)

    def evaluate() -> dict:
        record = {}
        if val_examples:
            record["val_loss"] = _val_loss(model, val_examples, tc.micro_batch_size, pad_id, cfg.eval.max_batches)
            set_learner_mode(model, dropout=tc.dropout)
        if evaluator is not None:
            model.eval()
            record.update({f"eval/{k}": v for k, v in evaluator(model, tokenizer).items()})
            set_learner_mode(model, dropout=tc.dropout)
        if record:
            metrics.log(step, **record)
            last.update(record)
            log(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in record.items()))
        return record

    deadline = Deadline(cfg.max_seconds)
    should_stop = (lambda: dist.agree_stop(deadline)) if dist else deadline.passed
    stopped_early = False
    tokens_trained = 0  # SFTResult.tokens_trained
    cpu_wait = CpuWait()  # warns when this process's threads wait for a CPU (oversubscribed)
    # ---- the loop
    with StepProgress(total_steps, start=step, enabled=cfg.log.progress) as progress:
        while step < total_steps and not should_stop():
            batch = [examples[i] for i in order.take(tc.batch_size)]
            record = _train_step(model, optimizer, scheduler, batch, cfg, pad_id, dist, step, reference)
            record["epoch"] = order.epoch + order.cursor / order.size
            step += 1
            tokens_trained += record["trained_tokens"]
            last.update(record)
            if step % cfg.log.every == 0 or step == total_steps:
                metrics.log(step, **record)
            progress.update(step, loss=record["loss"], tokens_per_s=record["tokens_per_s"])
            cpu_wait.after_step(step)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < total_steps:
                if targets_met(evaluate(), cfg.eval.stop_at):
                    log(f"step {step}: every eval.stop_at target met {cfg.eval.stop_at}; stopping")
                    stopped_early = True
                    break
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < total_steps:
                checkpoint()

    if interrupted(step, total_steps):
        log(interrupted_message(step, total_steps, checkpoint()))
        metrics.close()
        return SFTResult(output_dir=out, final_model=None, steps=step, resumed_from=resumed_from, last=last,
                         tokens_trained=tokens_trained, interrupted=True)
    if not stopped_early:  # else the last evaluation was at this very step
        evaluate()
    checkpoint()
    final = out / "final"
    (dist.save_model_folder if dist is not None else save_model_folder)(model, tokenizer, final)
    metrics.close()
    log(f"done: {step} steps; model saved to {final}")
    return SFTResult(output_dir=out, final_model=final, steps=step, resumed_from=resumed_from, last=last,
                     tokens_trained=tokens_trained)


def _load_model(cfg: SFTConfig, ckpt: Path | None, dist: Rank | None, log: Callable[[str], None]):
    """(model in training mode, tokenizer) from the checkpoint or cfg.model: LoRA-wrapped as
    train.lora asks, sharded on an FSDP2 rank, with activation checkpointing if asked."""
    model, tokenizer = load_trainable(ckpt or cfg.model, cfg.train.lora, dtype=cfg.dtype, device=cfg.device)
    if dist is not None:
        model = dist.wrap(model, seed=cfg.train.seed)
    if cfg.train.lora is not None or is_adapter_folder(cfg.model):
        trained, total = trainable_count(model)
        log(f"LoRA: training {trained:,} of {total:,} parameters")
    if cfg.train.activation_checkpointing:  # single-process only (SFTTrainConfig checks)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    set_learner_mode(model, dropout=cfg.train.dropout)  # after: it keeps checkpointed layers in train mode
    return model, tokenizer


def _metrics_writer(out: Path, cfg: SFTConfig, dist: Rank | None, step: int) -> MetricsWriter:
    """metrics.jsonl (and the sinks log.loggers lists) from `step` on; an FSDP2 rank other than
    0 writes its rows (the same numbers) beside its log, to no sink."""
    if dist is None or dist.is_main:
        return MetricsWriter.for_run(out / "metrics.jsonl", cfg.log, start_step=step, config=cfg)
    return MetricsWriter(out / "fsdp2" / f"metrics.rank{dist.rank}.jsonl", start_step=step)


def _load_data(cfg: SFTConfig, tokenizer, log: Callable[[str], None]) -> tuple[list[Example], list[Example]]:
    """(train examples, validation examples): data.val, else data.val_fraction of the train
    rows held out, else none; TrainError when no train example is left or batch sizes clash."""
    examples, report = load_sft_examples(cfg.data.train, tokenizer, cfg.data, log=lambda m: log(f"warning: {m}"))
    log(f"train data: {report.summary()}")
    val_examples: list[Example] = []
    if cfg.data.val:
        val_examples, val_report = load_sft_examples(cfg.data.val, tokenizer, cfg.data,
                                                     log=lambda m: log(f"warning: {m}"))
        log(f"val data: {val_report.summary()}")
    elif cfg.data.val_fraction > 0:
        examples, val_examples = _split(examples, cfg.data.val_fraction, cfg.train.seed)
        log(f"held out {len(val_examples)} of the train examples for validation")
    if not examples:
        raise TrainError("no training examples left")
    tc = cfg.train
    if tc.batch_size % tc.micro_batch_size:
        raise TrainError(f"train.batch_size ({tc.batch_size}) must be a multiple of "
                         f"train.micro_batch_size ({tc.micro_batch_size})")
    return examples, val_examples


def _reference(model, examples: list[Example], dist: Rank | None) -> Callable | None:
    """What distilled rows are trained toward: peft's `disable_adapter` (the model before its
    adapter), or None when no row is distilled. TrainError where there is none to take."""
    distilled = [e for e in examples if e.distill]
    if not distilled:
        return None
    from peft import PeftModel

    if dist is not None or not isinstance(model, PeftModel):
        raise TrainError(f"{distilled[0].source} and {len(distilled) - 1} more rows ask 'distill': true, whose "
                         "reference is the model with its LoRA adapter off; set train.lora (single process), "
                         "or drop 'distill' from the rows")
    return model.disable_adapter


def _train_step(model, optimizer, scheduler, batch: list[Example], cfg: SFTConfig, pad_id: int,
                dist: Rank | None, step: int, reference: Callable | None = None) -> dict:
    """One optimizer step on `batch` (an FSDP2 rank: on its share, normalised by the whole
    batch's trained tokens), micro-batch by micro-batch; a non-finite gradient norm skips the
    update (the schedule still advances). Its metrics row: loss (mean over trained tokens), lr,
    grad_norm, tokens_per_s, trained_tokens (all ranks'), skipped_update when skipped."""
    t0 = time.perf_counter()
    tc = cfg.train
    n_trained = sum(sum(ex.loss_mask[1:]) for ex in batch)  # tokens that get predicted (all ranks')
    nll_sum, n_tokens = 0.0, 0
    mine = dist.share(batch) if dist else batch  # an FSDP2 rank: its share; the same normaliser
    for i in range(0, len(mine), tc.micro_batch_size):
        micro = mine[i:i + tc.micro_batch_size]
        if dist is not None:  # reduce-scatter once per step, after its last micro-batch
            dist.grad_sync(model, i + tc.micro_batch_size >= len(mine))
        nll_sum += _backward(model, micro, pad_id, cfg.device, max(1, n_trained), shareable=dist is None,
                             reference=reference)
        n_tokens += sum(len(e.ids) for e in micro)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip or float("inf"))
    if dist is not None:  # a replicated DTensor: the global norm; the step's numbers, all ranks'
        grad_norm = grad_norm.full_tensor()
        nll_sum, n_tokens = dist.sum([nll_sum, n_tokens])
    finite = bool(torch.isfinite(grad_norm))
    if finite:
        optimizer.step()
    else:
        warnings.warn(f"step {step + 1}: non-finite gradient norm; update skipped")
    optimizer.zero_grad(set_to_none=True)
    lr = scheduler.get_last_lr()[0]
    scheduler.step()
    record = {"loss": nll_sum / max(1, n_trained), "lr": lr, "grad_norm": float(grad_norm),
              "tokens_per_s": n_tokens / (time.perf_counter() - t0), "trained_tokens": n_trained}
    if not finite:
        record["skipped_update"] = 1
    return record


def _backward(model, micro: list[Example], pad_id: int, device, normalizer: int, shareable: bool,
              reference: Callable | None = None) -> float:
    """Backward of a micro-batch's summed next-token loss / `normalizer` (the step's trained
    tokens); returns the sum. Distilled rows take the forward KL to `reference` instead
    (distill_loss, one more forward without gradients). The rows' shared prefixes run once
    where that halves the work (`shareable`: not on FSDP2 ranks, which must all make the same
    calls)."""
    distilled, plain = [e for e in micro if e.distill], [e for e in micro if not e.distill]
    total = 0.0
    if distilled:
        ids_B_T, attn, tmask = (t.to(device) for t in pad_batch([e.ids for e in distilled],
                                                                 [e.loss_mask for e in distilled], pad_id))
        loss, m = distill_loss(model, reference, ids_B_T, attn, tmask, normalizer=normalizer)
        loss.backward()
        total += m["kl_sum"]
    if plain:
        total += _nll_backward(model, plain, pad_id, device, normalizer, shareable)
    return total


def _nll_backward(model, micro: list[Example], pad_id: int, device, normalizer: int, shareable: bool) -> float:
    ids, masks = [e.ids for e in micro], [e.loss_mask for e in micro]
    shared = shared_nll_sum(model, ids, masks, pad_id, device) if shareable else None
    if shared is not None:
        nll, _ = shared
        (nll / normalizer).backward()
        return float(nll.detach())
    ids_B_T, attn, tmask = (t.to(device) for t in pad_batch(ids, masks, pad_id))
    loss, m = sft_loss(model, ids_B_T, attn, tmask, normalizer=normalizer)
    loss.backward()
    return m["nll_sum"]


def _adamw(model, cfg: SFTConfig) -> torch.optim.AdamW:
    """Weight decay on matrices only (not on norms, biases or 1-D parameters)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    oc = cfg.optim
    return torch.optim.AdamW([{"params": decay, "weight_decay": oc.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=oc.lr, betas=oc.betas, eps=oc.eps)


@torch.no_grad()
def _val_loss(model, examples: list[Example], micro: int, pad_id: int, max_batches: int | None) -> float:
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for bi, i in enumerate(range(0, len(examples), micro)):
        if max_batches is not None and bi >= max_batches:
            break
        chunk = examples[i:i + micro]
        ids, attn, tmask = pad_batch([e.ids for e in chunk], [e.loss_mask for e in chunk], pad_id)
        _, m = sft_loss(model, ids.to(device), attn.to(device), tmask.to(device), normalizer=1.0)
        total += m["nll_sum"]
        count += m["tokens"]
    return total / max(1, count)


def _split(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    idx = list(range(len(examples)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(len(examples) * fraction))
    val = set(idx[:n_val])
    return [e for i, e in enumerate(examples) if i not in val], [examples[i] for i in sorted(val)]


def targets_met(record: dict, stop_at: dict[str, float]) -> bool:
    """Whether an evaluation record meets every target: a metric whose name ends in "loss"
    must be <= its target, any other >= (NaN meets nothing). False without targets.
    TrainError when the record lacks a target's metric, naming the ones it has."""
    if not stop_at:
        return False
    missing = sorted(set(stop_at) - set(record))
    if missing:
        raise TrainError(f"eval.stop_at names {missing}, which the evaluation does not report; "
                         f"it reports {sorted(record) or 'nothing (set data.val or eval.evaluator)'}")
    return all((record[k] <= v) if k.endswith("loss") else (record[k] >= v) for k, v in stop_at.items())


def _import_evaluator(spec: str | None) -> Evaluator | None:
    if not spec:
        return None
    module, sep, name = spec.partition(":")
    if not sep:
        raise TrainError(f"eval.evaluator {spec!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise TrainError(f"eval.evaluator {spec!r} cannot be imported: {e}") from None


def launch_sft(cfg, log: Callable[[str], None] = print):
    """run_sft under FSDP2: every rank runs run_sft's loop on its share of each batch."""
    tc = cfg.train
    if tc.batch_size % tc.world_size:
        raise TrainError(f"train.batch_size ({tc.batch_size}) must be a multiple of train.world_size "
                         f"({tc.world_size}) under train.strategy=fsdp2: each rank takes an equal share")
    if tc.lora is not None:
        raise TrainError("train.strategy=fsdp2 does not train LoRA adapters (train.lora); use train.strategy=single")
    if cfg.eval.evaluator:
        raise TrainError(f"train.strategy=fsdp2 does not run eval.evaluator ({cfg.eval.evaluator!r}); validate "
                         "with data.val / data.val_fraction, or evaluate the checkpoints")
    from flywheel.train.learner.rank_processes import launch

    device = "cuda" if cfg.device.startswith("cuda") else cfg.device
    return launch("flywheel.train.sft:_sft_rank", cfg.model_dump(mode="json"), tc.world_size, device,
                  cfg.output_dir, log, threads=cfg.threads)


def _sft_rank(cfg_json: dict, rank: "Rank"):
    cfg = SFTConfig.model_validate(cfg_json)
    cfg = cfg.model_copy(update={"device": rank.device, "log": cfg.log.model_copy(update={"progress": False})})
    return run_sft(cfg, log=lambda m: print(m, flush=True), dist=rank)
