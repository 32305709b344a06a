"""The fine-tuning service's state: uploaded files, jobs, their events and checkpoints, per
tenant (`JobStore`), the job request as OpenAI's API defines it (`JobRequest`), the checks of
uploaded rows per method, and the objects the API returns. Training itself is not here: a
worker (flywheel.worker.job_worker) claims a job and runs flywheel's recipes."""

from flywheel.jobs.requests import JobRequest, RequestError
from flywheel.jobs.store import Conflict, JobStore, JobStoreError, LeaseLost, NotFound

__all__ = ["Conflict", "JobRequest", "JobStore", "JobStoreError", "LeaseLost", "NotFound", "RequestError"]
