"""Named places where a crash-safety test may kill the process.

Code that must survive a SIGKILL anywhere calls `crash_point("stage:step")` between its
durable steps. Normally that does nothing; a test's child process calls `kill_at(name)`
first, and the process then SIGKILLs itself when it reaches that point.
"""

from __future__ import annotations

import os
import signal

_kill_at: str | None = None


def crash_point(name: str) -> None:
    """Die here (SIGKILL, no cleanup) if `kill_at(name)` was called in this process."""
    if name == _kill_at:
        os.kill(os.getpid(), signal.SIGKILL)


def kill_at(name: str | None) -> None:
    """Make `crash_point(name)` kill this process; None: no point kills."""
    global _kill_at
    _kill_at = name
