"""Fork bombs are contained by the process-count limit, even though the host user is root
(RLIMIT_NPROC alone would not bind root; the pids cgroup does)."""

from __future__ import annotations


import pytest
from sandbox_helpers import assert_pool_clean, descendants, host_responsive, wait_gone

BOMB = """
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
"""

SHELL_BOMB = "b() { b | b & }; b; sleep 10"  # the main shell stays, so the bomb has time to grow

COUNT = """
import os, time
n = 0
for _ in range({tries}):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(5)
        os._exit(0)
    n += 1
print(n)
"""


def test_python_fork_bomb_cold(sandbox):
    before = descendants()
    r = sandbox.run_python(BOMB, limits=sandbox.limits.with_(wall_s=2.0))
    assert r.error == "too many processes", r
    assert r.returncode is None and r.timed_out  # it kept trying until the wall clock
    assert wait_gone(lambda: descendants() - before), "fork bomb left processes on the host"
    assert host_responsive()


def test_shell_fork_bomb_cold(sandbox):
    before = descendants()
    r = sandbox.run(["/bin/sh", "-c", SHELL_BOMB], limits=sandbox.limits.with_(wall_s=2.0))
    assert r.error == "too many processes", r
    assert wait_gone(lambda: descendants() - before)
    assert host_responsive()


@pytest.mark.parametrize("processes", [8, 20])
def test_process_count_is_capped_at_the_limit(sandbox, processes):
    # the main process counts too: at most processes - 1 children fit
    r = sandbox.run_python(COUNT.format(tries=3 * processes), limits=sandbox.limits.with_(processes=processes))
    assert r.returncode == 0, r
    assert int(r.stdout) == processes - 1
    assert r.error == "too many processes"  # the refused fork is reported even though it exited 0
    # a count that fits is not flagged
    ok = sandbox.run_python(COUNT.format(tries=processes // 2), limits=sandbox.limits.with_(processes=processes))
    assert ok.ok and int(ok.stdout) == processes // 2, ok


def test_fork_bomb_in_pool_then_clean(pool, no_strays):
    r = pool.run_python(BOMB, timeout_s=2.0)
    assert r.error == "too many processes", r
    assert host_responsive()
    assert_pool_clean(pool)


def test_pool_process_limit_counts_only_the_request(pool):
    r = pool.run_python(COUNT.format(tries=200))
    assert r.returncode == 0, r
    assert int(r.stdout) == pool.limits.processes - 1, r
    assert r.error == "too many processes"
