"""Pure pieces of flywheel.sandbox, no sandbox needed: the seccomp program (run through a small
classic-BPF interpreter written here), the bwrap option list, the server's framing and the
pool's workspace mirroring."""

from __future__ import annotations

import errno
import os
import struct
import threading
import time

import pytest

from flywheel.sandbox import bwrap, protocol, seccomp, workspace
from flywheel.sandbox.limits import Limits

X86_64, I386 = 0xC000003E, 0x40000003
ALLOW = 0x7FFF0000


def run_bpf(prog: bytes, nr: int, arch: int) -> int:
    """Evaluate a seccomp classic-BPF program on struct seccomp_data {nr, arch, ...}."""
    insns = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    data = struct.pack("=iI", nr, arch) + bytes(56)
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            acc = struct.unpack("=I", data[k:k + 4])[0]
        elif code == 0x15:  # jeq #k
            pc += jt if acc == k else jf
        elif code == 0x35:  # jge #k
            pc += jt if acc >= k else jf
        elif code == 0x06:  # ret #k
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
        pc += 1


def test_seccomp_denies_listed_syscalls_and_allows_the_rest():
    prog = seccomp.program("x86_64")
    assert run_bpf(prog, 101, X86_64) == 0x00050000 | errno.EPERM  # ptrace
    assert run_bpf(prog, 250, X86_64) == 0x00050000 | errno.EPERM  # keyctl
    assert run_bpf(prog, 442, X86_64) == 0x00050000 | errno.EPERM  # mount_setattr, the last compare
    for nr in (0, 1, 2, 57, 59, 60, 231, 435):  # read, write, open, fork, execve, exit, exit_group, clone3
        assert run_bpf(prog, nr, X86_64) == ALLOW, nr
    assert run_bpf(prog, 0, I386) == 0x00050000 | errno.ENOSYS  # another ABI: refused outright
    assert run_bpf(prog, 0x40000000 + 101, X86_64) == 0x00050000 | errno.ENOSYS  # x32 ptrace


def test_seccomp_aarch64_table_and_unknown_arch():
    prog = seccomp.program("aarch64")
    assert run_bpf(prog, 117, 0xC00000B7) == 0x00050000 | errno.EPERM  # ptrace on arm64
    assert run_bpf(prog, 63, 0xC00000B7) == ALLOW  # read on arm64
    assert seccomp.program("riscv64") is None


def test_bwrap_options_isolate_and_order_mounts(tmp_path):
    opts, fds = bwrap.options(bwrap.Spec(Limits(memory_mb=64), workspace=tmp_path, cwd="sub", env={"A": "1"}), 99)
    try:
        for flag in ("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--clearenv",
                     "--disable-userns"):
            assert flag in opts
        assert opts[opts.index("--cap-drop") + 1] == "ALL"
        assert ["--ro-bind", "/etc", "/etc"] != opts[:3] and "/etc/shadow" not in opts
        binds = [opts[i + 1:i + 3] for i, o in enumerate(opts) if o in ("--bind", "--ro-bind")]
        assert [str(tmp_path), "/workspace"] in binds
        assert all(dest != "/etc" for _, dest in binds)
        # /tmp's tmpfs before the python binds, the read-only remount of / after every mount
        last_mount = max(i for i, o in enumerate(opts) if o in ("--bind", "--ro-bind", "--tmpfs"))
        assert opts.index("--remount-ro", opts.index("/dev") + 1) < last_mount < opts.index("/", last_mount)
        assert opts[opts.index("--chdir") + 1] == "/workspace/sub"
        assert opts[opts.index("--size") + 1] == str(64 << 20)
        env = {opts[i + 1]: opts[i + 2] for i, o in enumerate(opts) if o == "--setenv"}
        assert env["A"] == "1" and env["HOME"] == "/tmp" and set(env) == {"A", "PATH", "HOME", "LANG", "TMPDIR"}
    finally:
        for fd in fds:
            os.close(fd)


def test_root_binds_leave_only_read_only_mount_points_in_private_dirs():
    opts = bwrap.root_binds(["/opt/py", "/tmp/a/b/venv", "/tmp/a/c", "/tmp/v", "/tmp/v/lib", "/dev/shm/x/y",
                             "/opt/py/lib"])
    assert opts == ["--tmpfs", "/dev/shm/x", "--ro-bind", "/dev/shm/x/y", "/dev/shm/x/y",
                    "--ro-bind", "/opt/py", "/opt/py",
                    "--tmpfs", "/tmp/a", "--ro-bind", "/tmp/a/b/venv", "/tmp/a/b/venv",
                    "--ro-bind", "/tmp/a/c", "/tmp/a/c", "--ro-bind", "/tmp/v", "/tmp/v",
                    "--remount-ro", "/dev/shm/x", "--remount-ro", "/tmp/a"]
    for bad in ("/tmp", "/tmp/", "/dev", "/", "//"):
        with pytest.raises(ValueError, match="private"):
            bwrap.root_binds([bad])
    assert bwrap.root_binds(["//tmp/a/b"]) == bwrap.root_binds(["/tmp/a/b"])  # normpath keeps a leading //


@pytest.mark.parametrize("cwd, inside", [(".", "/workspace"), ("a/b", "/workspace/a/b"), ("a/../c", "/workspace/c")])
def test_inside_cwd(cwd, inside):
    assert bwrap.inside_cwd(cwd) == inside


@pytest.mark.parametrize("cwd", ["..", "../x", "/etc", "a/../../b"])
def test_inside_cwd_refuses_to_leave_the_workspace(cwd):
    with pytest.raises(ValueError):
        bwrap.inside_cwd(cwd)


def test_frames_round_trip_and_limits():
    r, w = os.pipe()
    try:
        protocol.write_frame(w, {"a": 1}, [b"out", b""])
        hdr, blobs = protocol.read_frame(r, deadline=time.monotonic() + 1)
        assert hdr == {"a": 1, "blobs": [3, 0]} and blobs == [b"out", b""]
        protocol.write_frame(w, {"a": 2}, [b"x" * 10])
        with pytest.raises(ValueError):
            protocol.read_frame(r, max_blob=5)
    finally:
        os.close(r)
        os.close(w)
    r, w = os.pipe()
    try:
        os.write(w, struct.pack(">I", protocol.MAX_HEADER + 1))
        with pytest.raises(ValueError):
            protocol.read_frame(r)
        with pytest.raises(TimeoutError):
            protocol.read_frame(r, deadline=time.monotonic() + 0.05)
        os.close(w)
        w = -1
        with pytest.raises(EOFError):
            protocol.read_exact(r, 1)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_workspace_copy_in_and_sync_back(tmp_path):
    src, box = tmp_path / "src", tmp_path / "box"
    src.mkdir(), box.mkdir()
    (src / "same.txt").write_text("same")
    (src / "gone.txt").write_text("gone")
    (src / "d").mkdir()
    (src / "d" / "f").write_text("f")
    (src / "link").symlink_to(tmp_path / "outside")
    os.mkfifo(src / "fifo")
    workspace.copy_in(src, box)
    assert sorted(os.listdir(box)) == ["d", "gone.txt", "link", "same.txt"]  # the FIFO is skipped
    # what code in the sandbox does
    (box / "gone.txt").unlink()
    (box / "new.txt").write_text("new")
    (box / "link").unlink()
    (box / "link").mkdir()  # a symlink replaced by a real directory
    (box / "link" / "inner").write_text("inner")
    (box / "d" / "f").write_text("changed")
    (box / "evil").symlink_to("/etc/passwd")
    before = (src / "same.txt").stat().st_mtime_ns
    workspace.sync_back(box, src)
    assert sorted(os.listdir(src)) == ["d", "evil", "fifo", "link", "new.txt", "same.txt"]  # the FIFO it never saw stays
    assert not (src / "gone.txt").exists() and (src / "new.txt").read_text() == "new"
    assert (src / "d" / "f").read_text() == "changed" and (src / "same.txt").stat().st_mtime_ns == before
    assert (src / "link").is_dir() and not (src / "link").is_symlink() and (src / "link" / "inner").exists()
    assert not (tmp_path / "outside").exists()  # nothing was written through the old symlink
    assert (src / "evil").is_symlink() and os.readlink(src / "evil") == "/etc/passwd"
    workspace.clear(box)
    assert workspace.is_empty(box)


def test_clear_handles_unwritable_directories(tmp_path):
    (tmp_path / "locked" / "deep").mkdir(parents=True)
    (tmp_path / "locked" / "deep" / "f").write_text("x")
    os.chmod(tmp_path / "locked" / "deep", 0)
    os.chmod(tmp_path / "locked", 0)
    workspace.clear(tmp_path)
    assert workspace.is_empty(tmp_path)


def test_spawner_thread_outlives_callers():
    from flywheel.sandbox.pool import _Spawner

    sp = _Spawner()
    seen = []
    t = threading.Thread(target=lambda: seen.append(sp(threading.get_ident)))
    t.start()
    t.join()
    assert seen[0] != t.ident and seen[0] == sp(threading.get_ident)  # always the spawner's own thread
    sp.stop()
