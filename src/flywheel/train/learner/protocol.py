"""What run_rl (train/rl.py) asks of its learner, wherever the learner runs.

Satisfied by rl_learner.py's RLLearner (in the driver's process), group.py's ProcessLearner
(ranks as local processes) and ray_actors.py's RayLearner (ranks as Ray actors);
tests/unit/test_protocols.py checks each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol, runtime_checkable

import torch


@runtime_checkable
class Learner(Protocol):
    def update(self, groups: list) -> dict[str, float]:
        """One RL update on a step's trajectory groups, then a scheduler step; metrics["lr"] is
        the rate the update used."""

    def weights(self) -> Mapping[str, torch.Tensor]:
        """The current policy under the plain model's parameter names (a LoRA learner's
        merged): what rollout engines load. Valid until the next call."""

    def save_checkpoint(self, step: int, extra: dict) -> Path | None:
        """Model, optimizer, scheduler, RNG and `extra` (the driver's data order and feeder
        state) as a checkpoint folder, which it returns."""

    def save_final(self, dest: Path) -> None:
        """The trained model (an adapter folder for LoRA) into `dest`."""

    def placement(self) -> list[dict]:
        """Where each rank runs ({"actor", "rank", "node_id", "ip", "pid", "resources"}); []
        when the learner runs on the driver's machine."""

    def close(self) -> None:
        """Stop its ranks and free what it holds."""
