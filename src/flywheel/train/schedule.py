"""Learning-rate schedule: linear warm-up, then cosine decay to a floor."""

from __future__ import annotations

import math


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based: the lr used by the
    step-th update).

    warm-up: (step + 1) / warmup_steps for step < warmup_steps (never 0, so the first
    update already moves); then cosine from 1 down to min_ratio at the last step:
    min_ratio + (1 - min_ratio) * (1 + cos(pi * progress)) / 2, progress in [0, 1].
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
