"""Memory bombs hit RLIMIT_AS (one process) or the tree's memory cgroup (many processes)."""

from __future__ import annotations

import pytest
from sandbox_helpers import assert_pool_clean, descendants, host_responsive, wait_gone

from flywheel.sandbox import cgroup

ONE_BIG = "x = bytearray(8 << 30)"  # 8 GiB in one allocation
GROWING = """
chunks = []
while True:
    chunks.append(b"x" * (16 << 20))  # touched pages, 16 MiB at a time
"""
# four processes each under RLIMIT_AS (200 MiB of 256) but together far over the tree's cap
MANY = """
import os, sys, time
for _ in range(4):
    if os.fork() == 0:
        data = b"x" * (200 << 20)
        time.sleep(5)
        os._exit(0)
for _ in range(4):
    if os.WIFSIGNALED(os.wait()[1]):
        sys.exit("a child was killed")
"""
has_memory_cgroup = pytest.mark.skipif(not any("memory" in h.controllers for h in cgroup.hierarchies()),
                                       reason="no writable memory cgroup here: only RLIMIT_AS applies")


@pytest.mark.parametrize("code", [ONE_BIG, GROWING], ids=["one-allocation", "growing"])
def test_memory_bomb_cold(sandbox, code):
    r = sandbox.run_python(code, limits=sandbox.limits.with_(memory_mb=256))
    assert r.error == "memory limit", r
    assert r.returncode == 1 and "MemoryError" in r.stderr
    assert host_responsive()


@has_memory_cgroup
def test_memory_spread_over_processes_hits_the_tree_cap(sandbox):
    before = descendants()
    r = sandbox.run_python(MANY, limits=sandbox.limits.with_(memory_mb=256, wall_s=8.0))
    assert r.error == "memory limit", r
    assert r.duration_s < 4.0  # the OOM kill ended it, not the children's sleep or the wall clock
    assert wait_gone(lambda: descendants() - before)


def test_memory_bomb_in_pool_then_clean(pool, no_strays):
    r = pool.run_python(GROWING)
    assert r.error == "memory limit", r
    assert_pool_clean(pool)


@has_memory_cgroup
def test_memory_spread_in_pool_then_clean(pool, no_strays):
    r = pool.run_python(MANY.replace("200 << 20", "300 << 20"), timeout_s=8.0)
    assert r.error == "memory limit", r
    assert_pool_clean(pool)
