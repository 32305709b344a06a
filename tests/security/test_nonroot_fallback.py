"""The process limit without a cgroup: as a non-root host user, RLIMIT_NPROC set inside the
sandbox's user namespace binds (it does not for root). Exercised here by re-running a small
script as uid 65534 (setpriv) with the system Python, where no cgroup is writable."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess

import pytest
from sandbox_helpers import REPO

SCRIPT = r"""
import json, sys
sys.path.insert(0, SRC)
from flywheel.sandbox import Limits, Sandbox, SandboxPool, probe
count = ("import os, time\nn = 0\nfor _ in range(60):\n    try:\n        pid = os.fork()\n    except OSError:\n"
         "        break\n    if pid == 0:\n        time.sleep(3)\n        os._exit(0)\n    n += 1\nprint(n)")
bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
lim = Limits(wall_s=1.5, processes=10)
out = {"mode": probe.process_limit_mode(), "reason": probe.unavailable_reason()}
sb = Sandbox(lim)
out["cold"] = sb.run_python(count).stdout.strip()
out["cold_bomb"] = sb.run_python(bomb).timed_out
with SandboxPool(1, lim) as pool:
    out["pool"] = pool.run_python(count).stdout.strip()
    out["pool_after"] = pool.run_python("print('ok')").stdout.strip()
print(json.dumps(out))
"""


@functools.lru_cache(maxsize=1)
def _eligible() -> str | None:
    if os.geteuid() != 0:
        return "needs root to switch to an unprivileged uid (a non-root run exercises this path already)"
    if not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"):
        return "needs setpriv and /usr/bin/python3"
    probe = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c",
                            f"import sys; sys.path.insert(0, {str(REPO / 'src')!r}); import flywheel.sandbox"],
                           capture_output=True, cwd="/", env={"PATH": "/usr/bin:/bin"})
    if probe.returncode != 0:
        return "the system Python as uid 65534 cannot import flywheel.sandbox from this checkout"
    return None


@pytest.mark.skipif(_eligible() is not None, reason=str(_eligible()))
def test_rlimit_nproc_contains_a_fork_bomb_as_non_root():
    code = SCRIPT.replace("SRC", repr(str(REPO / "src")))
    out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", code],
                         capture_output=True, text=True, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["mode"] == "rlimit" and res["reason"] is None, res
    assert res["cold"] == "9" and res["pool"] == "9", res  # processes - 1 children, like the cgroup path
    assert res["cold_bomb"] is True and res["pool_after"] == "ok", res
