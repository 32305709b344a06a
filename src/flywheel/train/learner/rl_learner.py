"""The RL learner: the policy being trained, its optimizer and schedule, and the four things
run_rl (train/rl.py) asks of it. run_rl knows nothing of where the learner runs.

    update(groups) -> metrics       one RL update (train/rl_step.py) then a scheduler step;
                                    metrics["lr"] is the rate the update used
    weights() -> {name: tensor}     the current policy under the plain model's parameter names
                                    (a LoRA learner's merged), what rollout engines load
    save_checkpoint(step, extra)    model + optimizer + scheduler + RNG + `extra` (the driver's
                                    data order and feeder state) -> the checkpoint folder
    save_final(dest)                the trained model (an adapter folder for LoRA)

`RLLearner` is one in this process (`rank=None`), or one rank of a sharded learner
(`rank`: ranks.py's Rank): its update is fsdp2_rl.py's rl_step_fsdp2 on the same groups as
every other rank, its weights and checkpoints are gathered to rank 0 (every rank must make the
same calls in the same order; the others return {} / None). group.py runs `world_size` ranks
of it as local processes or Ray actors behind the same calls (protocol.py's Learner).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Callable, Mapping

import torch

from flywheel.config import RLConfig
from flywheel.inference.lora import is_adapter_folder
from flywheel.train.checkpoint import save_checkpoint, save_model_folder
from flywheel.train.lora import MergedWeights, is_peft, load_trainable, trainable_count
from flywheel.train.rl_step import RLStepConfig, rl_step
from flywheel.train.run_state import restore_trainer_state, trainer_state
from flywheel.train.schedule import lr_multiplier


class RLLearner:
    """One learner (or one rank of it), built from cfg.model or the checkpoint `ckpt`
    (its optimizer, scheduler and RNG restored)."""

    def __init__(self, cfg: RLConfig, ckpt: Path | None, rank=None, log: Callable[[str], None] = print):
        self.cfg, self.rank = cfg, rank
        self.device = device = rank.device if rank is not None else cfg.device
        model, self.tokenizer = load_trainable(ckpt or cfg.model, cfg.train.lora, dtype="float32", device=device)
        self.lora = is_peft(model)
        if self.lora:
            trained, total = trainable_count(model)
            log(f"LoRA: training {trained:,} of {total:,} parameters")
        if rank is not None:  # (start.check_sharded has refused what a rank cannot run)
            model = rank.wrap(model, seed=cfg.train.seed)
        self.model = model
        self.module = model.get_base_model() if self.lora else model  # LoRA layers injected: what rl_step runs
        self.ref_model, self.ref_context = self._reference(model)
        oc = cfg.optim
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=oc.lr,
                                           betas=oc.betas, eps=oc.eps, weight_decay=oc.weight_decay,
                                           fused=True)  # one kernel for every parameter: ~20 % of a tiny step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_multiplier(s, oc.warmup_steps, cfg.train.steps, oc.min_lr_ratio, oc.decay))
        self.algo = RLStepConfig.from_config(cfg)
        if ckpt is not None:  # (run_rl says it resumed)
            if rank is None:
                restore_trainer_state(ckpt, self.optimizer, self.scheduler, None, lambda m: None)
            else:
                rank.restore(ckpt, model, self.optimizer, self.scheduler, None, lambda m: None)
        if self.lora:
            self._weights = MergedWeights(model).refresh  # () -> plain names -> current merged weights
        elif rank is None:
            params = dict(model.named_parameters())
            self._weights = lambda: params
        else:
            names = [n for n, _ in model.named_parameters()]  # a tied weight once, as an engine has it
            self._weights = lambda: _pick(rank.full_model_state(model), names)

    def _reference(self, model):
        """(reference model, the context it runs under) for the KL term: the starting model. A
        fresh adapter's is the learner with its adapter off; else a frozen copy of cfg.model
        (an adapter folder: its base with that adapter)."""
        cfg = self.cfg
        if not cfg.algo.kl_beta:
            return None, contextlib.nullcontext
        if self.lora and not is_adapter_folder(cfg.model):
            return self.module, model.disable_adapter
        reference, _ = load_trainable(cfg.model, None, dtype="float32", device=self.device)
        reference.requires_grad_(False)
        return (reference.get_base_model() if is_peft(reference) else reference), contextlib.nullcontext

    def update(self, groups: list) -> dict[str, float]:
        lr = self.scheduler.get_last_lr()[0]
        pad = self.tokenizer.pad_token_id
        if self.rank is None:
            m = rl_step(self.module, self.optimizer, groups, self.algo, pad, self.ref_model, self.ref_context)
        else:
            from flywheel.train.learner.fsdp2_rl import rl_step_fsdp2

            m = rl_step_fsdp2(self.module, self.optimizer, groups, self.algo, pad, self.rank)
        with warnings.catch_warnings():  # a skipped update still advances the schedule, by design
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        return {**m, "lr": lr}

    def weights(self) -> Mapping[str, torch.Tensor]:
        return self._weights()

    def save_checkpoint(self, step: int, extra: dict) -> Path | None:
        state = {**trainer_state(step, self.optimizer, self.scheduler, None, self.cfg), **extra}
        out, keep = Path(self.cfg.output_dir), self.cfg.checkpoint.keep
        if self.rank is None:
            return save_checkpoint(out, step, self.model, self.tokenizer, state, keep=keep)
        return self.rank.save_checkpoint(out, step, self.model, self.optimizer, self.tokenizer, state, keep)

    def save_final(self, dest: Path) -> None:
        if self.rank is None:
            save_model_folder(self.model, self.tokenizer, Path(dest))
        else:
            self.rank.save_model_folder(self.model, self.tokenizer, Path(dest))

    def placement(self) -> list[dict]:
        return []  # in the driver's process (or a rank, whose group says where)

    def close(self) -> None:
        pass


def _pick(state: dict, names: list[str]) -> dict:
    """`names` of a gathered full state dict ({} on ranks other than 0)."""
    return {n: state[n] for n in names} if state else {}
