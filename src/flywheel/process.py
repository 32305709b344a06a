"""Facts about local processes that several parts need (shared-memory leases, sandbox
cgroups, the registry's half-copied folders)."""

from __future__ import annotations

import ctypes
import os
import signal


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists in this pid namespace (signal 0 probes without sending;
    a process of another user answers PermissionError, and is alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (even by SIGKILL), so a killed worker
    leaves no orphans; elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
