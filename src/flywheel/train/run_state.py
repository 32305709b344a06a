"""What every training recipe (SFT, DPO, RL) does around its loop: prepare the run (threads,
seeds, the output folder's checkpoints) and save / restore the state that lets a resumed run
continue exactly where the last complete checkpoint left it."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from flywheel.errors import TrainError
from flywheel.rollout.data_order import DataOrder
from flywheel.train.checkpoint import latest_checkpoint, list_checkpoints, load_state, rng_state, set_rng_state


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def start_run(output_dir: str | Path, resume: bool, threads: int | None, seed: int,
              log: Callable[[str], None]) -> Path | None:
    """Set threads and seeds; return the checkpoint to resume from (None: start fresh).
    An output folder that already holds checkpoints is never overwritten without resume."""
    if threads:
        torch.set_num_threads(threads)
    seed_everything(seed)
    out = Path(output_dir)
    if not resume:
        if list_checkpoints(out):
            raise TrainError(f"{out} already holds checkpoints of an earlier run; pass resume=true to "
                             "continue it, or choose another output_dir")
        return None
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        log(f"resume=true but {out} has no complete checkpoint: starting from step 0")
    return ckpt


def trainer_state(step: int, optimizer, scheduler, order: DataOrder | None, config) -> dict:
    """Everything besides the weights that a checkpoint holds (the data order: where the caller
    keeps it; None: a learner apart from its data, train/learner/rl_learner.py, whose driver adds it)."""
    state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
             "rng": rng_state(), "config": config.model_dump()}
    if order is not None:
        state["data_order"] = order.state_dict()
    return state


def restore_trainer_state(ckpt: Path, optimizer, scheduler, order: DataOrder | None,
                          log: Callable[[str], None]) -> int:
    """Load a checkpoint's trainer state into the live objects (order None: left to the
    caller); returns its step."""
    state = load_state(ckpt)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if order is not None:
        order.load_state_dict(state["data_order"])
    set_rng_state(state["rng"])
    log(f"resumed from {ckpt} (step {state['step']})")
    return state["step"]
