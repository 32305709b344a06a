"""One RL run's moving parts: rollout sources (in-process or worker processes), the feeder
that keeps the staleness bound, and the worker process itself."""

from flywheel.orchestrate.feeder import RolloutFeeder, StepRollouts
from flywheel.orchestrate.pool import InProcessRollouts, ProcessRollouts, RolloutError
from flywheel.orchestrate.worker import WorkerSpec, WorkItem, WorkResult

__all__ = ["InProcessRollouts", "ProcessRollouts", "RolloutError", "RolloutFeeder", "StepRollouts",
           "WorkItem", "WorkResult", "WorkerSpec"]
