"""Learning-rate schedule: linear warm-up, then a decay to a floor (cosine, linear or none)."""

from __future__ import annotations

import math

from flywheel.config import Decay


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_ratio: float,
                  decay: Decay = "cosine") -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based: the lr used by the
    step-th update).

    warm-up: (step + 1) / warmup_steps for step < warmup_steps (never 0, so the first
    update already moves); then, with progress in [0, 1] reaching 1 at the last step:
    - cosine:   min_ratio + (1 - min_ratio) * (1 + cos(pi * progress)) / 2
    - linear:   min_ratio + (1 - min_ratio) * (1 - progress)   (TRL's default, to min_ratio 0)
    - constant: 1
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if decay == "linear":
        return min_ratio + (1.0 - min_ratio) * (1.0 - progress)
    if decay == "constant":
        return 1.0
    raise ValueError(f"unknown lr decay {decay!r}: use cosine, linear or constant")
