"""Facts about local processes that several parts need (shared-memory leases, sandbox
cgroups, the registry's half-copied folders), and pausing the cycle collector."""

from __future__ import annotations

import ctypes
import gc
import os
import signal
from contextlib import contextmanager
from typing import Iterator


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


@contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block, then back as it was. For work that
    builds many long-lived, acyclic containers (a batch of episodes, a result being pickled
    or unpickled): each allocation counts toward a collection, and every full collection
    walks every live container, so their cost grows with what the block holds. Reference
    counting still frees everything acyclic; cycles made in the block wait for the next
    collection after it."""
    if not gc.isenabled():  # the caller turned it off: leave it so
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
