"""What the feeder (feeder.py) asks of a rollout source, wherever its episodes are played.

Satisfied by pool.py's InProcessRollouts (in the learner's process, when polled), pool.py's
ProcessRollouts (worker processes) and ray_rollouts.py's RayRollouts (Ray actors);
tests/unit/test_protocols.py checks each.
"""

from __future__ import annotations

from typing import Mapping, Protocol, runtime_checkable

import torch

from flywheel.orchestrate.worker import WorkItem, WorkResult


@runtime_checkable
class RolloutSource(Protocol):
    def submit(self, item: WorkItem) -> None:
        """Queue a work item (its tasks, spares and keep rule; worker.py)."""

    def poll(self, timeout_s: float = 0.0) -> list[WorkResult]:
        """The results that arrived, waiting at most `timeout_s` for the first (may be [])."""

    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        """Make weights `version` the newest the samplers may use."""

    def ready(self) -> float:
        """Block until every sampler can take work (its engine built and loaded); the seconds
        waited. A run calls it before its first step, so start-up stays off the step clock."""

    def in_flight(self) -> int:
        """Items submitted and not yet returned."""

    def stats(self) -> dict[str, float]:
        """Counters for the step's metrics (restarts, resubmitted items, ...)."""

    def close(self) -> None:
        """Stop the source's workers."""
