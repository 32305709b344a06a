"""ComputeThread: one thread runs every caller's work, in order, inline when re-entered; it
ends when idle and a forked child starts without it (inference/compute_thread.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from flywheel.inference.compute_thread import COMPUTE, ComputeThread


def test_calls_from_many_threads_run_on_one_thread_in_arrival_order():
    compute = ComputeThread(idle_exit_s=5)
    ran: list[tuple[int, threading.Thread]] = []
    gate = threading.Event()

    def first():
        assert gate.wait(10)
        ran.append((0, threading.current_thread()))

    callers = [threading.Thread(target=compute.run, args=(first,))]
    callers[0].start()
    while compute.calls == 0:  # the first call is running and holds the thread
        time.sleep(0.001)
    for i in (1, 2, 3):
        t = threading.Thread(target=compute.run, args=(lambda i=i: ran.append((i, threading.current_thread())),))
        callers.append(t)
        t.start()
        while len(compute._queue) < i:  # queued in this order
            time.sleep(0.001)
    gate.set()
    for t in callers:
        t.join(10)
    assert [i for i, _ in ran] == [0, 1, 2, 3]
    assert {th for _, th in ran} == {compute.thread}
    assert compute.thread is not threading.current_thread()


def test_results_and_exceptions_reach_the_caller_and_reentry_runs_inline():
    compute = ComputeThread(idle_exit_s=5)
    assert compute.run(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    # a call made on the compute thread itself runs there at once (queued, it would wait forever)
    assert compute.run(lambda: compute.run(lambda: threading.current_thread())) is compute.thread
    assert compute.calls == 3  # the inner call was not queued


def test_an_idle_thread_ends_and_the_next_call_starts_another():
    """A thread that ran torch's parallel ops keeps an OpenMP team while it lives
    (flywheel/threads.py): an idle compute thread lets its thread go."""
    compute = ComputeThread(idle_exit_s=0.05)
    first = compute.run(threading.current_thread)
    first.join(5)
    assert not first.is_alive() and compute.thread is None
    second = compute.run(threading.current_thread)
    assert second is not first and second.is_alive()
    with pytest.raises(ValueError, match="idle_exit_s"):
        ComputeThread(idle_exit_s=0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_starts_its_own_compute_thread():
    """The job worker's zygote forks per job: the parent's thread does not exist in the child,
    and a child that still believed in it would queue its first call forever."""
    COMPUTE.run(lambda: None)
    assert COMPUTE.thread is not None
    pid = os.fork()
    if pid == 0:  # the child: exit 0 when its call ran on a thread of its own
        ok = False
        try:
            threading.Timer(10, lambda: os._exit(3)).start()
            ran_on = COMPUTE.run(threading.current_thread)
            ok = ran_on.is_alive() and ran_on is not threading.main_thread()
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
