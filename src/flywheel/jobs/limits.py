"""What one tenant may ask of the fine-tuning service at once (the server checks the ones a
request can break; workers skip the jobs of a tenant at `max_running`)."""

from __future__ import annotations

from dataclasses import dataclass

from flywheel.jsonl import MAX_LINE_BYTES


@dataclass(frozen=True)
class TenantLimits:
    max_running: int = 2  # jobs of one tenant training at once; its further jobs wait in the queue
    max_unfinished: int = 20  # jobs validating, queued, running or paused: past it a create is a 429
    max_file_bytes: int = 512 * 2 ** 20  # one upload: past it a 413
    max_line_bytes: int = MAX_LINE_BYTES  # one line (row) of an upload: past it a 400 naming the line
    max_job_tokens: int = 50_000_000  # training-file tokens x epochs of one job: past it the job fails validation

    def __post_init__(self) -> None:
        for name in ("max_running", "max_unfinished", "max_file_bytes", "max_line_bytes", "max_job_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"TenantLimits.{name} must be >= 1, got {getattr(self, name)}")
