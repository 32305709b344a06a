"""Infinite loops and sleeps past the deadline: the wall clock kills the whole tree; CPU time is
capped separately by RLIMIT_CPU. A pool server that stops answering is killed host-side."""

from __future__ import annotations

import os
import signal
import threading
import time

from sandbox_helpers import assert_pool_clean, descendants, host_responsive, wait_gone

from flywheel.sandbox import Limits, SandboxPool
from flywheel.sandbox.worker import GRACE_S

LOOP = "while True: pass"
SLEEP = "import time; time.sleep(60)"
# the loop runs in a grandchild too, so killing only the main process would not be enough
LOOP_IN_CHILD = "import os\nif os.fork() == 0:\n    while True: pass\nwhile True: pass"


def test_infinite_loop_cold_hits_wall_clock(sandbox):
    before = descendants()
    t = time.monotonic()
    r = sandbox.run_python(LOOP_IN_CHILD, limits=sandbox.limits.with_(wall_s=1.0, cpu_s=30))
    assert r.error == "timeout" and r.timed_out and r.returncode is None, r
    assert time.monotonic() - t < 3.0
    assert wait_gone(lambda: descendants() - before)
    assert host_responsive()


def test_sleep_past_timeout_cold(sandbox):
    t = time.monotonic()
    r = sandbox.run_python(SLEEP, limits=sandbox.limits.with_(wall_s=0.5))
    assert r.error == "timeout" and r.timed_out, r
    assert 0.5 <= r.duration_s < 2.0 and time.monotonic() - t < 3.0


def test_cpu_limit_cold(sandbox):
    r = sandbox.run_python(LOOP, limits=sandbox.limits.with_(wall_s=10.0, cpu_s=1))
    assert r.error == "cpu limit", r
    assert r.returncode == -24  # SIGXCPU
    assert r.duration_s < 5.0


def test_cpu_limit_ignored_sigxcpu_still_killed(sandbox):
    code = "import signal; signal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True: pass"
    r = sandbox.run_python(code, limits=sandbox.limits.with_(wall_s=10.0, cpu_s=1))
    assert r.error == "cpu limit" and r.returncode == -9, r  # the hard limit (cpu_s + 1) sends SIGKILL


def test_infinite_loop_and_sleep_in_pool(pool, no_strays):
    for code, timeout in ((LOOP_IN_CHILD, 1.0), (LOOP, 0.5), (SLEEP, 0.5)):
        t = time.monotonic()
        r = pool.run_python(code, timeout_s=timeout)
        assert r.error == "timeout" and r.timed_out, r
        # answered by the server right after the deadline, not by the host's backstop (GRACE_S later)
        assert time.monotonic() - t < timeout + 1.0, (code, time.monotonic() - t)
    assert_pool_clean(pool)


def test_cpu_limit_in_pool():
    with SandboxPool(1, Limits(wall_s=10.0, cpu_s=1)) as pool:
        r = pool.run_python(LOOP)
        assert r.error == "cpu limit" and r.returncode == -24, r
        assert pool.run_python("print('next')").stdout == "next\n"


def test_request_cannot_stop_the_server(pool, no_strays):
    code = "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(60)"
    t = time.monotonic()
    r = pool.run_python(code, timeout_s=0.5)
    assert r.error == "timeout" and r.timed_out, r
    assert time.monotonic() - t < 1.5  # the server stayed in charge and answered at the deadline
    assert_pool_clean(pool)


def test_unresponsive_server_is_killed_host_side(no_strays):
    # a server that stops answering (frozen here from the host, which can signal it) is killed with
    # its sandbox once the request's deadline plus the host's grace period has passed, then replaced
    with SandboxPool(1, Limits(wall_s=5.0)) as small:
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("r", small.run_python("import time; time.sleep(60)",
                                                                                  timeout_s=0.5)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.2)
        os.kill(small._workers[0].init_pid, signal.SIGSTOP)
        t.join(15)
        r = box["r"]
        assert r.error == "timeout" and r.timed_out and r.returncode is None, r
        assert 0.5 + GRACE_S - 0.5 < time.monotonic() - t0 < 0.5 + GRACE_S + 3.0
        assert small.run_python("print('fresh')").stdout == "fresh\n"
