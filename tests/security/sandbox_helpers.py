"""Helpers of the sandbox security suite (imported by its tests and conftest.py).

Stray processes are found by scanning /proc (no psutil): `descendants()` lists every process
below this test process; a test records it before running code and checks that nothing new
survives the execution.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from flywheel.sandbox import Limits, SandboxPool, unavailable_reason

REPO = Path(__file__).resolve().parents[2]  # the project's own checkout: must be invisible inside
REASON = unavailable_reason()
FAST = Limits(wall_s=3.0, cpu_s=3, memory_mb=512)

# When the interpreter or the checkout lives under /tmp (a CI clone, say), the sandbox's private
# /tmp holds the empty directories its read-only mounts of them hang from: not left-overs.
MOUNT_SKELETON = sorted({Path(p).resolve().relative_to("/tmp").parts[0]
                         for p in (sys.prefix, sys.base_prefix, REPO)
                         if Path(p).resolve().is_relative_to("/tmp") and Path(p).resolve() != Path("/tmp")})

# code that inspects the sandbox after an attack: prints "clean" when nothing is left behind
PROBE = r"""
import os
SKELETON = set(%r)
others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid(), os.getppid())]
tmp = [e for e in os.listdir('/tmp') if e not in SKELETON]; shm = os.listdir('/dev/shm'); ws = os.listdir('.')
print('clean' if not (others or tmp or shm or ws) else f'DIRTY others={others} tmp={tmp} shm={shm} ws={ws}')
""" % (MOUNT_SKELETON,)


def _ppid_map() -> dict[int, int]:
    out = {}
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    out[int(p)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def descendants(root: int | None = None) -> set[int]:
    """All live processes below `root` (default: this test process), zombies excluded."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    for pid, ppid in _ppid_map().items():
        children.setdefault(ppid, []).append(pid)
    out, stack = set(), [root]
    while stack:
        for c in children.get(stack.pop(), []):
            try:
                with open(f"/proc/{c}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue
            except OSError:
                continue
            out.add(c)
            stack.append(c)
    return out


def cmdlines_with(token: str) -> list[int]:
    """Host pids whose command line contains `token` (e.g. a daemon's unique sleep time)."""
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) != os.getpid():
            try:
                with open(f"/proc/{p}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        out.append(int(p))
            except OSError:
                pass
    return out


def wait_gone(pred, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pred():
            return True
        time.sleep(0.02)
    return not pred()


def host_responsive(limit_s: float = 5.0) -> bool:
    """A fresh host interpreter still starts and answers quickly."""
    t = time.monotonic()
    out = subprocess.run([sys.executable, "-c", "print(6*7)"], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() == "42" and time.monotonic() - t < limit_s


def assert_pool_clean(pool: SandboxPool) -> None:
    """Both workers answer the probe with a clean sandbox."""
    for _ in range(pool.size):
        r = pool.run_python(PROBE)
        assert r.ok and r.stdout.strip() == "clean", r
