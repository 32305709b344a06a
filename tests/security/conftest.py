"""Fixtures of the sandbox security suite.

Every test here runs untrusted-looking code for real. Where bwrap cannot isolate on this host
(not installed, user namespaces disabled, root without a writable pids cgroup) the whole
directory is skipped with the reason `unavailable_reason()` gives, never failed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sandbox_helpers import FAST, REASON, descendants, wait_gone

from flywheel.sandbox import Sandbox, SandboxPool


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=f"sandbox unavailable on this host: {REASON}")
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sandbox() -> Sandbox:
    return Sandbox(FAST)


@pytest.fixture(scope="session")
def pool():
    p = SandboxPool(size=2, limits=FAST)
    yield p
    p.close()


@pytest.fixture
def no_strays(pool):
    """Checks that no process outlives a test besides the pool's own sandboxes (and their holders)."""
    before = descendants()
    yield
    def extra():
        servers = set()
        for w in pool._workers:
            if w.proc is not None:
                servers |= {w.proc.pid} | descendants(w.proc.pid)
            if w.fs is not None and w.fs.proc is not None:  # the holder of its capped tmpfs (quota.py)
                servers.add(w.fs.proc.pid)
        return descendants() - before - servers
    assert wait_gone(extra), f"stray processes: {extra()}"


