"""The oversubscription warning: a training loop whose threads wait for a CPU.

The signal is the kernel's run-queue delay of this process's threads (/proc/self/task/*/
schedstat: nanoseconds on a CPU, nanoseconds runnable but waiting for one). Waiting is exactly
what oversubscription is, whatever the cause (another busy process, sibling flywheel processes,
more torch threads than cores), and reading it costs a few small files per check, no extra work.
The alternatives are worse: CPU time per wall second (os.times) falls for a loop's serial
Python parts and I/O as much as for a starved thread pool, and counts OpenMP threads that spin
at a barrier as working; a single-thread calibration run costs steps and measures the machine
at another moment. On an idle machine waiting stays near 0%; a 2-thread pool beside one busy
process on 2 cores waits about a third of its runnable time (docs/benchmarks.md).

`CpuWait.after_step()` is called once per optimizer step; after `first_steps` steps, and then
for each `window_s` of wall time, it compares the window's waiting with its runnable time and
warns once per run (warnings.warn, category CpuOversubscribed, so it shows even when a caller
silences the loop's log). Where schedstat is missing it never warns.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

TASKS = Path("/proc/self/task")


class CpuOversubscribed(RuntimeWarning):
    """This process's threads waited for a CPU a large share of the time they were ready to run."""


def thread_times(tasks: Path = TASKS) -> tuple[int, int] | None:
    """(ns on a CPU, ns waiting for one) summed over this process's threads; None without schedstat."""
    run = wait = 0
    try:
        names = os.listdir(tasks)
    except OSError:
        return None
    found = False
    for name in names:
        try:
            fields = (tasks / name / "schedstat").read_text().split()
        except OSError:  # the thread ended since the listing, or no schedstat in this kernel
            continue
        run, wait, found = run + int(fields[0]), wait + int(fields[1]), True
    return (run, wait) if found else None


def wait_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of runnable time spent waiting between two thread_times: wait / (run + wait).
    ((0, 0), (300, 100)) -> 0.25; no time at all -> 0.0."""
    run, wait = after[0] - before[0], after[1] - before[1]
    return wait / (run + wait) if run + wait > 0 else 0.0


def advice(share: float, threads: int, cpus: int, steps: tuple[int, int]) -> str:
    """The warning's text: what was measured and what to do about it."""
    head = (f"the CPUs are oversubscribed: over steps {steps[0]}-{steps[1]} this process's threads waited for a "
            f"CPU {share:.0%} of the time they were ready to run ({threads} torch threads, {cpus} CPUs allowed), "
            "so each step runs slower than the machine allows")
    if threads > 1:
        return head + (f"; other busy processes share these cores: run with fewer threads (--threads "
                       f"{max(1, threads // 2)}, threads={max(1, threads // 2)} in a config, or OMP_NUM_THREADS) "
                       "or stop the other processes")
    return head + "; other busy processes share this core: stop them or give this process a CPU of its own"


class CpuWait:
    """Watches a training loop's CPU waiting; `threshold`: the wait share that warns."""

    def __init__(self, first_steps: int = 10, window_s: float = 60.0, threshold: float = 0.2,
                 tasks: Path = TASKS, clock=time.monotonic):
        self.first_steps, self.window_s, self.threshold = first_steps, window_s, threshold
        self._tasks, self._clock = tasks, clock
        self._start = thread_times(tasks)
        self._t0, self._step0, self._steps = clock(), 0, 0
        self.warned: float | None = None  # the wait share it warned at

    def after_step(self, step: int) -> None:
        """`step`: the loop's step number after this step (for the message)."""
        self._steps += 1
        if self._start is None or self.warned is not None:
            return
        if self._steps < self.first_steps or (self._steps > self.first_steps and
                                              self._clock() - self._t0 < self.window_s):
            return
        now = thread_times(self._tasks)
        if now is None:
            self._start = None
            return
        share = wait_share(self._start, now)
        steps = (max(1, step - (self._steps - self._step0) + 1), step)
        self._start, self._t0, self._step0 = now, self._clock(), self._steps
        if share >= self.threshold:
            import torch

            from flywheel.threads import affinity_cpus

            self.warned = share
            warnings.warn(advice(share, torch.get_num_threads(), len(affinity_cpus()), steps),
                          CpuOversubscribed, stacklevel=2)
