"""One pool request cannot leave anything for the next one, nor tamper with the server that
forks it: files in /tmp, /dev/shm and the workspace, SysV IPC, interpreter state, the server's
memory and pipes. Also: the seccomp filter and the disabled nested user namespaces."""

from __future__ import annotations

import ast
import platform

import pytest
from sandbox_helpers import PROBE, assert_pool_clean

from flywheel.sandbox import Limits, SandboxError, SandboxPool

LEAVE = """
import builtins, ctypes, json, os
open("/tmp/left", "w").write("x")
open("/dev/shm/left", "w").write("x")
open("left-in-workspace", "w").write("x")
builtins.LEFT = "x"
json.dumps = None  # monkeypatch a module the server has imported
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0x1234, 4096, 0o1666)  # IPC_CREAT | 0666
print(shmid >= 0)
"""
CHECK = """
import builtins, ctypes, json, os
libc = ctypes.CDLL(None, use_errno=True)
print(json.dumps({"builtins": hasattr(builtins, "LEFT"), "shm": libc.shmget(0x1234, 0, 0o666) >= 0}))
"""
TAMPER = """
import os
server = os.getppid()
res = {}
for what in ("mem", "fd/0", "fd/1", "fd/3", "fd/4", "environ", "root/etc"):
    try:
        open(f"/proc/{server}/{what}", "rb").read(1)
        res[what] = "OPENED"
    except OSError as e:
        res[what] = e.errno
print(res)
"""
SYSCALLS = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def errno_of(r):
    return ctypes.get_errno() if r == -1 else "ALLOWED"
out = {
    "ptrace_attach_parent": errno_of(libc.ptrace(16, os.getppid(), 0, 0)),
    "ptrace_attach_pid1": errno_of(libc.ptrace(16, 1, 0, 0)),
    "keyctl": errno_of(libc.syscall(250, 0, 0, 0, 0, 0)),  # KEYCTL_GET_KEYRING_ID
    "unshare_user": errno_of(libc.unshare(0x10000000)),
    "mount": errno_of(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "bpf": errno_of(libc.syscall(321, 0, 0, 0)),
}
print(out)
"""


def test_nothing_crosses_between_requests():
    # one worker, so the second request surely lands in the same (recycled or cleaned) sandbox
    with SandboxPool(1, Limits(wall_s=5.0)) as pool:
        r = pool.run_python(LEAVE)
        assert r.ok and r.stdout == "True\n", r
        r = pool.run_python(CHECK)
        assert r.ok and r.stdout.strip() == '{"builtins": false, "shm": false}', r
        r = pool.run_python(PROBE)
        assert r.stdout.strip() == "clean", r


def test_server_is_not_readable_by_requests(pool):
    r = pool.run_python(TAMPER)
    assert r.ok and "OPENED" not in r.stdout, r
    assert_pool_clean(pool)


@pytest.mark.parametrize("runner", ["cold", "pool"])
def test_seccomp_and_userns(sandbox, pool, runner):
    code = SYSCALLS if platform.machine() == "x86_64" else SYSCALLS.replace("250,", "219,").replace("321,", "280,")
    r = (sandbox.run_python if runner == "cold" else pool.run_python)(code)
    assert r.ok, r
    out = ast.literal_eval(r.stdout.strip())  # never eval what sandboxed code printed
    assert out["ptrace_attach_parent"] == 1 and out["ptrace_attach_pid1"] == 1  # EPERM from the filter
    assert out["keyctl"] == 1 and out["bpf"] == 1 and out["mount"] == 1
    assert out["unshare_user"] in (1, 28)  # EPERM (filter) or ENOSPC (--disable-userns)


def test_workspace_copied_in_and_back(pool, tmp_path):
    (tmp_path / "keep.txt").write_text("keep")
    (tmp_path / "change.txt").write_text("old")
    (tmp_path / "remove.txt").write_text("bye")
    (tmp_path / "sub").mkdir()
    code = ("import os\nopen('change.txt','w').write('new')\nos.remove('remove.txt')\n"
            "open('sub/new.txt','w').write('n')\nos.symlink('/etc/passwd', 'link')\nprint(sorted(os.listdir('.')))")
    r = pool.run_python(code, workspace=tmp_path)
    assert r.ok and r.stdout == "['change.txt', 'keep.txt', 'link', 'remove.txt', 'sub']\n".replace(
        "'remove.txt', ", ""), r
    assert (tmp_path / "change.txt").read_text() == "new" and not (tmp_path / "remove.txt").exists()
    assert (tmp_path / "sub" / "new.txt").read_text() == "n" and (tmp_path / "keep.txt").read_text() == "keep"
    assert (tmp_path / "link").is_symlink()  # copied as a link, never followed on the host
    assert_pool_clean(pool)


def test_status_fd_games_cannot_hurt(pool, tmp_path):
    # fd 3 carries the child's exit status to the server; code that reuses fd 3 keeps its file intact
    code = "import os\nos.close(3)\nf = open('mine.bin', 'wb')\nassert f.fileno() == 3\nf.write(b'data')\nf.flush()"
    r = pool.run_python(code, workspace=tmp_path)
    assert r.ok, r
    assert (tmp_path / "mine.bin").read_bytes() == b"data"
    # code that fakes an early status report is SIGKILLed on the spot: it cannot linger
    r = pool.run_python("import os, time\nos.write(3, b'\\x07')\ntime.sleep(30)")
    assert r.returncode == 7 and r.duration_s < 2.0, r
    assert_pool_clean(pool)


def test_pathological_workspace_trees_are_cleaned(pool, tmp_path):
    # deeper than Python's recursion limit, with a directory made unreadable on the way
    code = ("import os\nfor i in range(1200):\n    os.mkdir('d')\n    os.chdir('d')\n"
            "os.chdir('/workspace/d/d')\nos.chmod('d', 0)\nos.makedirs('/tmp/x/y')\nos.chmod('/tmp/x', 0)\nprint('ok')")
    r = pool.run_python(code)
    assert r.ok, r
    assert_pool_clean(pool)
    # mirroring such a tree back into a host workspace is refused loudly, and the sandbox replaced
    with pytest.raises(SandboxError, match="could not copy the workspace back"):
        pool.run_python(code, workspace=tmp_path)
    assert_pool_clean(pool)
