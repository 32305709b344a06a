"""flywheel's SDK: `Flywheel` (sync) and `AsyncFlywheel` over a flywheel server's HTTP API:
files, fine-tuning jobs (with `wait()`), events, checkpoints, models, traces and feedback.
Imports nothing of the server: httpx and rich only."""

from flywheel.client.client import AsyncFlywheel, Flywheel, Page
from flywheel.client.http import FlywheelError
from flywheel.client.objects import Checkpoint, File, Job, JobEvent, Model

__all__ = ["AsyncFlywheel", "Checkpoint", "File", "Flywheel", "FlywheelError", "Job", "JobEvent", "Model", "Page"]
