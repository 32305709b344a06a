"""Resolving a job's "auto" hyperparameters (pure; the rules OpenAI documents only loosely,
written down here so a job records exactly what it trained with).

- batch_size: n_rows // 32, between 1 and 32 (a 10-row file: 1; 1,000 rows: 31; 5,000: 32).
- n_epochs: enough epochs to see about 3,000 examples, between 1 and 10 (100 rows: 10;
  1,000 rows: 3; 3,000 or more: 1).
- learning_rate_multiplier: 1.0 (times the service's base learning rate for the method).
- beta (dpo): 0.1. reinforcement: eval_interval 10 steps, eval_samples 1, compute_multiplier
  1.0, reasoning_effort "default".
- lora (flywheel's extension): a rank-16 adapter (alpha 32, no dropout, all seven
  projections), for every method.
Given values pass through unchanged (requests.py has checked their ranges).
"""

from __future__ import annotations

import math
from typing import Any

from flywheel.config import LoraSettings
from flywheel.jobs.requests import HYPERPARAMETERS

BASE_LR = {"supervised": 1e-4, "dpo": 5e-6, "reinforcement": 1e-5}  # times the job's learning_rate_multiplier
LORA_LR_FACTOR = 10.0  # a LoRA adapter trains best at about ten times full fine-tuning's rate
EXAMPLES_SEEN = 3000
MAX_AUTO_EPOCHS = 10
MAX_AUTO_BATCH = 32
FIXED_AUTO: dict[str, Any] = {"learning_rate_multiplier": 1.0, "beta": 0.1, "eval_interval": 10, "eval_samples": 1,
                              "compute_multiplier": 1.0, "reasoning_effort": "default"}


def auto_batch_size(n_rows: int) -> int:
    return min(MAX_AUTO_BATCH, max(1, n_rows // 32))


def auto_epochs(n_rows: int) -> int:
    return min(MAX_AUTO_EPOCHS, max(1, math.ceil(EXAMPLES_SEEN / max(1, n_rows))))


def auto_lora() -> dict[str, Any]:
    return LoraSettings().model_dump()


def resolve(method_type: str, given: dict[str, Any], n_rows: int) -> dict[str, Any]:
    """Every hyperparameter of `method_type`, "auto" (or absent) replaced by its rule above."""
    if n_rows < 1:
        raise ValueError(f"a job needs at least one training row, got {n_rows}")
    out = {}
    for name in HYPERPARAMETERS[method_type]:
        value = given.get(name, "auto")
        if value == "auto":
            value = {"batch_size": lambda: auto_batch_size(n_rows), "n_epochs": lambda: auto_epochs(n_rows),
                     "lora": auto_lora}.get(name, lambda: FIXED_AUTO[name])()
        out[name] = value
    return out


def optimizer_steps(n_rows: int, batch_size: int, n_epochs: int) -> int:
    """Steps of a job: every epoch sees every row once, the last batch of an epoch may be short
    of rows only in the sense that the data order wraps (train/sft.py's DataOrder)."""
    return max(1, math.ceil(n_epochs * n_rows / batch_size))


def micro_batch(batch_size: int, most: int = 8) -> int:
    """The largest divisor of batch_size that is at most `most` (examples per forward)."""
    return max(d for d in range(1, min(batch_size, most) + 1) if batch_size % d == 0)
