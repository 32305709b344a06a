"""Which learner run_rl drives (the Learner protocol, protocol.py): one in its own process, or
ranks as local processes or Ray actors; and what the sharded ones refuse before any starts."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch

from flywheel.config import RLConfig
from flywheel.errors import TrainError
from flywheel.inference.lora import is_adapter_folder
from flywheel.train.learner.group import ProcessLearner
from flywheel.train.learner.protocol import Learner
from flywheel.train.learner.rl_learner import RLLearner


def start_learner(cfg: RLConfig, ckpt: Path | None, log: Callable[[str], None], threads: int | None,
                  like: Mapping[str, torch.Tensor]) -> Learner:
    """run_rl's learner: in this process (train.strategy single), or `train.world_size` ranks
    (fsdp2) as local processes or, with rollout.ray.learner = actors, Ray actors. `threads`:
    the torch threads the learner may use in all (shared by its local ranks); `like`: the
    plain model's parameters (what `weights()` returns the newest values of)."""
    if cfg.rollout.backend == "ray" and cfg.rollout.ray.learner == "actors":
        if cfg.train.strategy == "fsdp2":
            check_sharded(cfg)
        from flywheel.train.learner.ray_actors import RayLearner  # imports ray: only where asked for

        return RayLearner(cfg, ckpt, log)
    if cfg.train.strategy == "single":
        return RLLearner(cfg, ckpt, None, log)
    check_sharded(cfg)
    return ProcessLearner(cfg, ckpt, like, log, threads=max(1, threads // cfg.train.world_size) if threads else None)


def check_sharded(cfg: RLConfig) -> None:
    """Refuse, before any rank starts, what the sharded learner does not run."""
    if cfg.train.lora is not None:
        raise TrainError("train.strategy=fsdp2 does not train LoRA adapters (train.lora): use train.strategy=single")
    if is_adapter_folder(cfg.model):
        raise TrainError(f"train.strategy=fsdp2 does not train LoRA adapters, and model={cfg.model} is an adapter "
                         "folder: merge it first (flywheel.train.lora.merged_folder) or use train.strategy=single")
    if cfg.algo.kl_beta:
        raise TrainError(f"train.strategy=fsdp2 does not run the KL reference model (algo.kl_beta="
                         f"{cfg.algo.kl_beta}): set algo.kl_beta=0 or train.strategy=single")
