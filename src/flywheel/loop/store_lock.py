"""One loop process per store: `hold_store(root)` takes an exclusive lock on
`<root>/loop.lock` for as long as the block runs, and refuses with `StoreLocked`, naming the
holder's pid, host and command, when another process holds it.

The lock is the kernel's (flock on an open file), so it is released when the holder exits,
however it exits: a killed daemon leaves no stale lock. The file's contents only describe the
holder; they are not the lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

LOCK_FILE = "loop.lock"


class StoreLocked(RuntimeError):
    """Another process holds the store."""


@contextmanager
def hold_store(root: str | Path, what: str) -> Iterator[None]:
    """Hold `<root>/loop.lock` while the block runs. what: the holder's command, for the message."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = root / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLocked(f"{root} is in use by {_holder(fd)}: one loop process per data_dir "
                              f"(stop that one first; `flywheel loop status --data-dir {root}` shows it)") from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "what": what, "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {h['pid']} on {h['host']} ({h['what']})"
    except (ValueError, KeyError, TypeError):
        return "another process"
