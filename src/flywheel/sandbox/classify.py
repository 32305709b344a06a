"""Turn what was observed about an execution into `ExecResult.error`.

Evidence, strongest first: the sandbox's own actions (output cap, wall clock), cgroup event
counters (pids refused a fork, the memory cap OOM-killed something), a full workspace (statvfs of
its capped tmpfs after the run), the terminating signal
(SIGXCPU = CPU limit, SIGXFSZ = file size limit), and last the tail of stderr, because Python
turns a refused allocation into MemoryError, an over-size write into OSError EFBIG (CPython
ignores SIGXFSZ) and a refused fork into BlockingIOError EAGAIN. The stderr rules only look at
the last lines of a failing run; a program can fake them, but only about itself.
"""

from __future__ import annotations

import re
import signal

from . import result as R

_MEMORY = re.compile(r"^(MemoryError\b|.*\bstd::bad_alloc\b|.*Cannot allocate memory|.*[Oo]ut of memory)", re.M)
_FSIZE = re.compile(r"\[Errno 27\]|File too large", re.M)
_NPROC = re.compile(r"^(BlockingIOError: \[Errno 11\]|.*fork: (retry: )?Resource temporarily unavailable|"
                    r".*can't start new thread|.*Cannot fork)", re.M)


def tail(text: str, n: int = 2000) -> str:
    return text[-n:]


def classify(*, returncode: int | None, timed_out: bool = False, overflow: bool = False,
             stderr: str = "", pids_hits: int = 0, oom_kills: int = 0, cpu_s: float | None = None,
             cpu_limit: int | None = None, duration_s: float | None = None, died: bool = False,
             quota: bool = False) -> str | None:
    """`cpu_s` is the CPU time of the killed process when known; without it, a SIGKILL after at
    least `cpu_limit` seconds of wall time is read as the hard RLIMIT_CPU (CPU time <= wall time,
    so a shorter run cannot have hit it). `quota`: the workspace was full when the run ended
    (quota.Usage.full), which also explains a timeout of code that kept retrying."""
    if overflow:
        return R.OUTPUT
    if oom_kills:
        return R.MEMORY
    if pids_hits:
        return R.PROCESSES
    if quota:
        return R.QUOTA
    if timed_out:
        return R.TIMEOUT
    if returncode is not None and returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:
            return R.CPU
        if sig == signal.SIGXFSZ:
            return R.FILE_SIZE
    if returncode not in (None, 0):
        t = tail(stderr)
        if _MEMORY.search(t):
            return R.MEMORY
        if _FSIZE.search(t):
            return R.FILE_SIZE
        if _NPROC.search(t):
            return R.PROCESSES
    if returncode == -signal.SIGKILL:
        used = cpu_s if cpu_s is not None else duration_s
        if used is not None and cpu_limit is not None and used >= cpu_limit:
            return R.CPU  # passed the hard RLIMIT_CPU after ignoring SIGXCPU
        return R.KILLED
    if died:
        return R.KILLED
    return None


def from_bwrap_exit(code: int) -> int:
    """bwrap's reaper reports death by signal N as exit status 128+N; give it back as -N (the
    subprocess convention). A program that itself exits with 129..192 is misread as a signal."""
    if 128 < code <= 128 + 64:
        return -(code - 128)
    return code
