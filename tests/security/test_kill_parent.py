"""Code that kills its parent, or everything it can (`kill -9 -1`), only reaches processes of its
own sandbox: the host (this test process, a sentinel process, the other pool sandbox) survives,
and the pool's server, pid 1 of its sandbox, survives too."""

from __future__ import annotations

import os
import subprocess

import pytest
from sandbox_helpers import assert_pool_clean, descendants, host_responsive, wait_gone

KILL = """
import os, signal
try:
    os.kill({target}, signal.SIGKILL)
except OSError as e:  # kill(-1) finds nobody to signal in a cold sandbox: ESRCH
    pass
print('alive')
"""
KILLERS = {"kill-parent": KILL.format(target="os.getppid()"), "kill-minus-1": KILL.format(target=-1),
           "kill-pid-1": KILL.format(target=1)}


@pytest.fixture
def sentinel():
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


@pytest.mark.parametrize("name", list(KILLERS))
def test_killers_cold(sandbox, sentinel, name):
    before = descendants()
    r = sandbox.run_python(KILLERS[name])
    # pid 1 of the sandbox is bwrap's reaper: signals from inside its namespace cannot kill it
    assert r.returncode in (0, -9), r
    assert sentinel.poll() is None and os.getppid() > 1
    assert wait_gone(lambda: descendants() - before - {sentinel.pid})
    assert host_responsive()


def test_shell_kill_minus_1_cold(sandbox, sentinel):
    r = sandbox.run(["/bin/sh", "-c", "kill -9 -1; echo survived"])
    assert sentinel.poll() is None, r
    assert host_responsive()


@pytest.mark.parametrize("name", list(KILLERS))
def test_killers_in_pool(pool, sentinel, no_strays, name):
    servers = [w.init_pid for w in pool._workers]
    r = pool.run_python(KILLERS[name])
    # the server is pid 1 of its sandbox: signals from inside cannot kill it, so nothing dies
    assert r.ok and r.stdout == "alive\n", r
    assert [w.init_pid for w in pool._workers] == servers  # no sandbox had to be replaced
    assert sentinel.poll() is None
    assert_pool_clean(pool)
    assert host_responsive()
