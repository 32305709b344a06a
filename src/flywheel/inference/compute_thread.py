"""The compute thread: the one thread of a process that runs its local engines' forwards.

torch's CPU ops run on libgomp (OpenMP), which keeps a team of worker threads for each thread
that ever ran a parallel op; a second team in the process makes every parallel op of both pay a
wake-up (flywheel/threads.py). A server that serves several engines at once (adapters over
another base, full fine-tunes: serve/served_models.py) has a batch scheduler per engine, each
with its own thread; were each to run its engine's forwards itself, the process would hold a
team per busy engine. So every scheduler hands its LocalEngine work (a prefill, a decode step,
a whole-batch generate) to the process's `COMPUTE` thread and waits for the result: the
schedulers' threads only queue and wait, and the process keeps one team however many engines
it serves.

Contract of `ComputeThread.run(fn, *args, **kwargs)`:
- runs `fn` on the compute thread and returns its result or raises its exception, in the
  caller's thread; calls run one at a time in the order they arrived (two busy schedulers take
  turns, step by step);
- called from the compute thread itself, `fn` runs inline (no deadlock);
- the thread ends after `idle_exit_s` with nothing to run, taking its team along (a loop
  training on its main thread beside an idle server then keeps the only team), and the next
  call starts another;
- a forked child starts with no compute thread and an empty queue (the job worker's zygote
  forks per job).
"""

from __future__ import annotations

import os
import threading
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

IDLE_EXIT_S = 1.0  # the compute thread, with nothing to run this long, ends


class ComputeThread:
    """One thread that runs the callables handed to `run`, one at a time (the module doc)."""

    def __init__(self, idle_exit_s: float = IDLE_EXIT_S, name: str = "flywheel-compute"):
        if idle_exit_s <= 0:
            raise ValueError(f"idle_exit_s must be > 0, got {idle_exit_s}")
        self.idle_exit_s = idle_exit_s
        self.name = name
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[tuple[Future, Callable[..., Any], tuple, dict]] = deque()
        self._thread: threading.Thread | None = None  # while it lives (guarded by _cond)
        self.calls = 0  # callables run on the thread (not the inline ones)

    @property
    def thread(self) -> threading.Thread | None:
        """The compute thread while it lives, else None."""
        with self._cond:
            return self._thread

    def run(self, fn: Callable[..., Any], /, *args, **kwargs) -> Any:
        """fn(*args, **kwargs) on the compute thread; blocks for its result (the module doc)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        future: Future = Future()
        with self._cond:
            self._queue.append((future, fn, args, kwargs))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify()
        return future.result()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if not self._cond.wait(self.idle_exit_s) and not self._queue:
                        self._thread = None  # idle: end, and this thread's OpenMP team with it
                        return
                future, fn, args, kwargs = self._queue.popleft()
                self.calls += 1
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - raised again in the caller's thread
                future.set_exception(e)
            else:
                future.set_result(result)


COMPUTE = ComputeThread()  # the process's compute thread: every BatchScheduler's by default

if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=COMPUTE._reset)
