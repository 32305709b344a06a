"""Output floods: stdout and stderr are each kept up to `output_bytes`; one byte more kills the
tree with error "output limit" and truncated=True."""

from __future__ import annotations

import time

from sandbox_helpers import assert_pool_clean, descendants, wait_gone

from flywheel.sandbox import Limits, SandboxPool

FLOOD = "import sys\nwhile True:\n    sys.{stream}.write('x' * 4096)"
CAP = 64 << 10


def test_stdout_flood_cold(sandbox):
    before = descendants()
    t = time.monotonic()
    r = sandbox.run_python(FLOOD.format(stream="stdout"), limits=sandbox.limits.with_(output_bytes=CAP))
    assert r.error == "output limit" and r.truncated and r.returncode is None, r.error
    assert len(r.stdout) == CAP and set(r.stdout) == {"x"}
    assert time.monotonic() - t < 2.0  # stopped at the cap, not by the wall clock
    assert wait_gone(lambda: descendants() - before)


def test_stderr_flood_cold(sandbox):
    r = sandbox.run_python(FLOOD.format(stream="stderr"), limits=sandbox.limits.with_(output_bytes=CAP))
    assert r.error == "output limit" and r.truncated and len(r.stderr) == CAP and r.stdout == ""


def test_output_at_the_cap_is_not_truncated(sandbox):
    r = sandbox.run_python(f"print('y' * {CAP - 1})", limits=sandbox.limits.with_(output_bytes=CAP))
    assert r.ok and not r.truncated and len(r.stdout) == CAP, r.error


def test_flood_from_a_grandchild_in_pool_then_clean(no_strays, pool):
    with SandboxPool(1, Limits(wall_s=5.0, output_bytes=CAP)) as small:
        code = "import os, sys\nif os.fork() == 0:\n    " + FLOOD.format(stream="stdout").replace("\n", "\n    ") + \
               "\nos.wait()"
        r = small.run_python(code)
        assert r.error == "output limit" and r.truncated and len(r.stdout) == CAP, r.error
        r = small.run_python("print('after')")
        assert r.ok and r.stdout == "after\n"
    r = pool.run_python(FLOOD.format(stream="stdout"))  # the default 1 MiB cap
    assert r.error == "output limit" and len(r.stdout) == pool.limits.output_bytes
    assert_pool_clean(pool)
