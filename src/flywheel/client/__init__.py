"""flywheel's SDK: `Flywheel` (sync) and `AsyncFlywheel` over a flywheel server's HTTP API:
files, fine-tuning jobs (with `wait()`), events, checkpoints, models, traces and feedback, and
managed flywheels (`flywheels`: their cycles and rollback). Imports nothing of the server:
httpx and rich only."""

from flywheel.client.client import AsyncFlywheel, Flywheel, Page
from flywheel.client.http import FlywheelError
from flywheel.client.objects import Checkpoint, File, FlywheelCycle, Job, JobEvent, ManagedFlywheel, Model

__all__ = ["AsyncFlywheel", "Checkpoint", "File", "Flywheel", "FlywheelCycle", "FlywheelError", "Job", "JobEvent",
           "ManagedFlywheel", "Model", "Page"]
