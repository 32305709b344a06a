"""Facts about local processes that several parts need (shared-memory leases, sandbox
cgroups, the registry's half-copied folders), pausing the cycle collector, and the one way
flywheel starts helper process pools (`worker_context`)."""

from __future__ import annotations

import ctypes
import gc
import multiprocessing
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


# What the one forkserver of a flywheel process imports before it forks pool workers: the trace
# ingestion workers' code (light: pydantic, orjson, no torch). The preload is the forkserver's,
# shared by every pool of the process and fixed by whichever pool starts it first, so every
# pool asks for the same one through worker_context().
FORKSERVER_PRELOAD = ("flywheel.traces.batch",)


def worker_context() -> multiprocessing.context.BaseContext:
    """The start method of flywheel's process pools: a forkserver (a clean interpreter that has
    imported FORKSERVER_PRELOAD, not the parent with its model, torch and threads), else spawn.
    A worker holds only what its own functions import: keep them in modules that import
    nothing heavy (a package's __init__ counts)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    return ctx


def start_pool_worker() -> None:
    """A pool worker's initializer: Ctrl-C (sent to the whole process group) is the parent's to
    handle, and what the worker imported is frozen out of the cycle collector (~10^5 objects
    of pydantic and SQLAlchemy that a full collection would otherwise walk every time)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.collect()
    gc.freeze()
