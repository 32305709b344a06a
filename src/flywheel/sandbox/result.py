"""What an execution returns, and the errors the sandbox itself raises.

A failure of the code inside (non-zero exit, a limit hit, a timeout) is never raised: it comes
back as an `ExecResult` with `error` set. Only a failure of the sandbox machinery (bwrap missing,
a mount that cannot be made, a server that cannot start) raises `SandboxError`.
"""

from __future__ import annotations

from dataclasses import dataclass

# `ExecResult.error` values: the sandbox-level reason an execution was stopped or failed.
TIMEOUT = "timeout"
MEMORY = "memory limit"
CPU = "cpu limit"
FILE_SIZE = "file size limit"
PROCESSES = "too many processes"
OUTPUT = "output limit"
KILLED = "killed"
QUOTA = "workspace quota exceeded"  # the run ended with its workspace full: nothing was copied back
COPY_BACK = "workspace copy-back timeout"  # no time left to copy the workspace back: left as it was
REASONS = (TIMEOUT, MEMORY, CPU, FILE_SIZE, PROCESSES, OUTPUT, KILLED, QUOTA, COPY_BACK)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the code inside it)."""


class SandboxUnavailable(SandboxError):
    """No usable isolation here (bwrap missing or unable to run) and no unsafe opt-in given."""


class UnsafeSandboxWarning(UserWarning):
    """Untrusted code is about to run WITHOUT isolation (the explicit unsafe opt-in)."""


class SandboxDirtyWarning(RuntimeWarning):
    """A warm pool's sandbox cannot get clean between requests, so each request restarts it."""


@dataclass
class ExecResult:
    """One execution. `returncode` is None when the sandbox killed the code (timeout, output
    limit) or the sandbox died under it; a negative value is the signal that ended it.
    stdout/stderr are decoded as UTF-8 with replacement and each capped at
    `Limits.output_bytes` (`truncated` says a cap was hit)."""

    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    timed_out: bool = False
    truncated: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.error is None
