"""A daemonized child (double fork + setsid) that would outlive the execution is killed when the
execution ends: it neither survives on the host nor writes into the workspace later."""

from __future__ import annotations

import secrets
import time

from sandbox_helpers import assert_pool_clean, cmdlines_with, wait_gone

DAEMON = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        if os.fork() == 0:  # one that sleeps in a unique-looking process, for the host to look for
            os.execv("/bin/sleep", ["sleep", "{token}"])
        time.sleep(0.5)
        with open("late.txt", "w") as f:
            f.write("written after the execution ended")
        os._exit(0)
    os._exit(0)
os.wait()
print("parent done")
"""


def _token() -> str:
    return f"{secrets.randbelow(10**6) + 10**6}.{secrets.randbelow(1000):03d}"


def test_daemon_killed_cold(sandbox, tmp_path):
    token = _token()
    r = sandbox.run_python(DAEMON.format(token=token), workspace=tmp_path)
    assert r.ok and r.stdout == "parent done\n", r
    assert r.duration_s < 1.0  # the execution did not wait for the daemon
    assert wait_gone(lambda: cmdlines_with(token), 1.0), "daemon survived the execution"
    time.sleep(0.8)
    assert not (tmp_path / "late.txt").exists()


def test_daemon_killed_in_pool(pool, tmp_path, no_strays):
    token = _token()
    r = pool.run_python(DAEMON.format(token=token), workspace=tmp_path)
    assert r.ok and r.stdout == "parent done\n", r
    assert not cmdlines_with(token)  # the server killed it before answering
    time.sleep(0.8)
    assert not (tmp_path / "late.txt").exists()
    assert_pool_clean(pool)
