"""Huge files are stopped by RLIMIT_FSIZE and the sized tmpfs; nothing outside the workspace
and the private /tmp is writable, and the host sees no trace of the attempts."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from sandbox_helpers import REPO, assert_pool_clean

HUGE_PY = """
with open("big.bin", "wb") as f:
    for _ in range(64):
        f.write(b"x" * (1 << 20))  # 64 MiB, past the 8 MiB limit
"""
HUGE_SH = "head -c 67108864 /dev/zero > big.bin"
FILL_TMP = """
import os
for i in range(100):
    with open(f"/tmp/f{i}", "wb") as f:
        f.write(b"x" * (6 << 20))  # each file under the size limit; together past the tmpfs size
"""

def test_huge_file_python(sandbox, tmp_path):
    r = sandbox.run_python(HUGE_PY, workspace=tmp_path, limits=sandbox.limits.with_(file_size_mb=8))
    assert r.error == "file size limit", r
    assert (tmp_path / "big.bin").stat().st_size == 8 << 20  # the write stopped exactly at the limit


def test_huge_file_shell_gets_sigxfsz(sandbox, tmp_path):
    r = sandbox.run(["/bin/sh", "-c", HUGE_SH], workspace=tmp_path, limits=sandbox.limits.with_(file_size_mb=8))
    assert r.error == "file size limit" and r.returncode == -25, r  # SIGXFSZ (head does not ignore it)
    assert (tmp_path / "big.bin").stat().st_size == 8 << 20


def test_private_tmp_is_sized(sandbox):
    r = sandbox.run_python(FILL_TMP, limits=sandbox.limits.with_(memory_mb=64, file_size_mb=8))
    assert r.returncode == 1 and "No space left on device" in r.stderr, r


def test_huge_file_in_pool_then_clean(pool, tmp_path, no_strays):
    r = pool.run_python(HUGE_PY.replace("range(64)", "range(1024)"), workspace=tmp_path)
    assert r.error == "file size limit", r  # the pool's limit: 64 MiB
    assert (tmp_path / "big.bin").stat().st_size == 64 << 20  # synced back, as a bind mount would show
    assert_pool_clean(pool)


def _outside_targets() -> list[str]:
    venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
    targets = ["/", "/etc", "/usr", "/usr/lib", "/root", str(Path.home()), str(REPO), str(REPO / "src"),
               venv, sys.base_prefix, "/dev", "/proc", "/proc/sys/kernel", "/sys", "/var", "/home", "/opt",
               os.path.dirname(str(REPO))]
    # /tmp is the sandbox's own private tmpfs: a checkout under it (a CI clone) is mounted
    # read-only deeper down, while its parent directories there are writable and private
    private = [t for t in targets if t == "/tmp" or t.startswith("/tmp/")]
    return [t for t in targets if t not in private] + [t for t in (str(REPO / "src"), venv) if t in private]


CHECK_WRITES = """
import os, sys
ok = []
for d in {targets!r}:
    p = os.path.join(d, "flywheel-sandbox-escape")
    try:
        with open(p, "w") as f:
            f.write("x")
        ok.append(d)
    except OSError:
        pass
    try:
        os.mkdir(p + ".d")
        ok.append(d + " (mkdir)")
    except OSError:
        pass
for d in ("/workspace", "/tmp", "/dev/shm"):
    with open(os.path.join(d, "allowed"), "w") as f:
        f.write("x")
print("WRITABLE:", ok)
"""


def test_nothing_outside_workspace_and_tmp_is_writable(sandbox, pool, tmp_path):
    targets = _outside_targets()
    code = CHECK_WRITES.format(targets=targets)
    for runner in (lambda: sandbox.run_python(code, workspace=tmp_path), lambda: pool.run_python(code, workspace=tmp_path)):
        r = runner()
        assert r.ok and r.stdout.strip() == "WRITABLE: []", r
        assert (tmp_path / "allowed").exists()
    for d in targets:
        assert not os.path.exists(os.path.join(d, "flywheel-sandbox-escape")), d
        assert not os.path.exists(os.path.join(d, "flywheel-sandbox-escape.d")), d
    assert_pool_clean(pool)
