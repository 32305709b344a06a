"""The bwrap command line, i.e. everything the sandboxed code can see.

Inside: /usr (+ the /bin, /lib... links) and the host Python's prefixes read-only at their host
paths (so the venv's interpreter and site-packages work), a few harmless /etc files, a synthetic
/etc/passwd, fresh /proc and /dev, private tmpfs /tmp and /dev/shm, the workspace read-write at
/workspace (those three: capped tmpfs from quota.py where `Spec.mounts` names them), everything
else absent (the root is an empty tmpfs, remounted read-only at the end).
Namespaces: all (user, pid, net, ipc, uts, cgroup); uid/gid 65534; no capabilities (bounding
set empty); no nested user namespaces; a new session (no TIOCSTI into the caller's terminal);
killed with its parent; environment cleared except PATH/HOME/LANG/TMPDIR and what the caller sets.

Facts that shaped this:
- bwrap's own environment and command line are readable by the sandbox in /proc/1/environ and
  /proc/1/cmdline (pid 1 is bwrap's reaper, same uid). So bwrap is started with a minimal
  environment and its options are passed through `--args FD`; only the command follows `--`.
- Root-owned host files look owner-readable from inside (the sandbox uid maps onto the caller's
  uid): /etc is NOT mounted whole (its shadow file would be readable), only a fixed subset.
- Mounts apply in order: /tmp's tmpfs comes before the Python binds so a venv under /tmp stays
  visible, and `--remount-ro /` comes last.
- A bind inside /tmp (a clone's venv at /tmp/clone/.venv) needs the directories leading to it,
  which would be writable, unremovable parts of the private /tmp: see `root_binds`.
"""

from __future__ import annotations

import os
import posixpath
import sys
from dataclasses import dataclass, field
from pathlib import Path

from .limits import Limits

SANDBOX_UID = 65534
WORKSPACE = "/workspace"
# harmless, commonly needed files; /etc itself is NOT mounted (shadow, ssh keys, credentials)
ETC_FILES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "localtime", "timezone",
             "nsswitch.conf", "mime.types", "python3", f"python3.{sys.version_info[1]}")
PASSWD = "nobody:x:65534:65534:nobody:/tmp:/usr/sbin/nologin\n"
GROUP = "nogroup:x:65534:\n"
HOSTS = "127.0.0.1 localhost\n::1 localhost ip6-localhost\n"
TOP_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
PRIVATE_DIRS = ("/dev/shm", "/tmp")  # the sandbox's own writable tmpfs mounts (a pool empties them)


def python_roots() -> list[str]:
    """Host directories the running interpreter needs (prefixes of the venv and its base),
    outside /usr, without nesting duplicates."""
    cands = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    paths = sorted({os.path.realpath(p) for p in cands} | {os.path.abspath(p) for p in cands})
    out: list[str] = []
    for p in paths:
        if p in ("/", "/usr") or p.startswith("/usr/") or not os.path.isdir(p):
            continue
        if any(p == q or p.startswith(q + "/") for q in out):
            continue
        out.append(p)
    return out


def root_binds(roots) -> list[str]:
    """bwrap options binding `roots` (host paths) read-only at their host paths; they come after
    the tmpfs mounts of PRIVATE_DIRS.

    Contract: every entry directly inside a private dir that these options create is a read-only
    mount point, and nothing else is. A root directly inside one is bound there; a deeper one
    hangs from an empty tmpfs on its first directory below the private dir, remounted read-only
    once its binds are made. So the sandboxed code cannot write next to a root, nor rename, remove
    or chmod the path to it, and a cleaner that removes everything but mount points gets the
    private dir clean. Nested roots are bound once (the outermost)."""
    kept: list[str] = []
    for r in sorted({"/" + posixpath.normpath(r).lstrip("/") for r in roots}):  # normpath keeps a leading //
        if r == "/":
            raise ValueError("a read-only bind of / would cover the whole sandbox, its private dirs included")
        if not any(r == q or r.startswith(q + "/") for q in kept):
            kept.append(r)
    opts: list[str] = []
    skeletons: list[str] = []
    for r in kept:
        for d in PRIVATE_DIRS:
            if r == d or d.startswith(r + "/"):
                raise ValueError(f"a read-only bind of {r} would cover the sandbox's private {d}")
            if r.startswith(d + "/"):
                top = posixpath.join(d, r[len(d) + 1:].split("/")[0])
                if top != r and top not in skeletons:
                    skeletons.append(top)
                    opts += ["--tmpfs", top]
        opts += ["--ro-bind", r, r]
    for top in skeletons:
        opts += ["--remount-ro", top]
    return opts


def default_env() -> dict[str, str]:
    bindir = os.path.dirname(os.path.abspath(sys.executable))
    path = ":".join(dict.fromkeys([bindir, "/usr/local/bin", "/usr/bin", "/bin"]))
    return {"PATH": path, "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}


def inside_cwd(cwd: str) -> str:
    """`cwd` (relative to /workspace) as an absolute path inside; refuses to leave /workspace."""
    p = posixpath.normpath(posixpath.join(WORKSPACE, cwd or "."))
    if p != WORKSPACE and not p.startswith(WORKSPACE + "/"):
        raise ValueError(f"cwd must stay inside the workspace, got {cwd!r}")
    return p


def memfd(name: str, data: bytes) -> int:
    """An fd holding `data`, positioned at 0 (bwrap reads it to EOF)."""
    fd = os.memfd_create(name, 0)  # not CLOEXEC: it is passed to bwrap by number
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@dataclass
class Spec:
    """What one sandbox gets. `workspace=None` gives a throwaway tmpfs at /workspace."""

    limits: Limits = field(default_factory=Limits)
    workspace: Path | None = None
    cwd: str = "."
    env: dict[str, str] | None = None
    extra_ro: tuple[str, ...] = ()
    seccomp: bytes | None = None
    disable_userns: bool = True
    tmpfs_size: bool = True
    files: dict[str, bytes] = field(default_factory=dict)  # extra read-only files: path inside -> content
    as_pid_1: bool = False  # the command itself is pid 1 (no bwrap reaper inside)
    # /workspace, /tmp, /dev/shm -> a directory to bind there instead (the capped tmpfs of a
    # quota.QuotaFs, a path in its namespace); missing ones get a sized tmpfs (or the workspace)
    mounts: dict[str, str] = field(default_factory=dict)


@dataclass
class Prepared:
    argv: list[str]
    fds: list[int]  # to pass to bwrap (same numbers) and close after it started
    status_fd: int  # read end of --json-status-fd

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def options(spec: Spec, status_w: int) -> tuple[list[str], list[int]]:
    """bwrap options (without the command) and the data fds they reference."""
    fds: list[int] = []
    lim = spec.limits

    def data(name: str, content: bytes) -> str:
        fd = memfd(name, content)
        fds.append(fd)
        return str(fd)

    def sized(dest: str) -> list[str]:
        if dest in spec.mounts:
            return ["--bind", spec.mounts[dest], dest]
        return (["--size", str(lim.tmpfs_bytes)] if spec.tmpfs_size else []) + ["--tmpfs", dest]

    o = ["--unshare-all", "--unshare-user", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
         "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if spec.disable_userns:
        o.append("--disable-userns")
    if spec.as_pid_1:
        o.append("--as-pid-1")
    o.append("--clearenv")
    env = default_env()
    env.update(spec.env or {})
    for k, v in env.items():
        if not k or "=" in k or "\0" in k or "\0" in v:
            raise ValueError(f"bad environment variable {k!r}")
        o += ["--setenv", k, v]
    o += ["--ro-bind", "/usr", "/usr"]
    for top in TOP_LINKS:
        p = "/" + top
        if os.path.islink(p):
            o += ["--symlink", os.readlink(p), p]
        elif os.path.isdir(p):
            o += ["--ro-bind", p, p]
    for name in ETC_FILES:
        o += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for dest, content in (("passwd", PASSWD), ("group", GROUP), ("hosts", HOSTS), ("hostname", "sandbox\n")):
        o += ["--ro-bind-data", data(dest, content.encode()), f"/etc/{dest}"]
    o += ["--proc", "/proc", "--dev", "/dev", *sized("/dev/shm"), "--remount-ro", "/dev", *sized("/tmp")]
    o += root_binds([*python_roots(), *spec.extra_ro])
    for dest, content in spec.files.items():
        o += ["--ro-bind-data", data(os.path.basename(dest), content), dest]
    if spec.workspace is not None and WORKSPACE not in spec.mounts:
        o += ["--bind", str(spec.workspace), WORKSPACE]
    else:
        o += sized(WORKSPACE)
    o += ["--remount-ro", "/", "--chdir", inside_cwd(spec.cwd)]
    if spec.seccomp:
        o += ["--seccomp", data("seccomp", spec.seccomp)]
    o += ["--json-status-fd", str(status_w)]
    return o, fds


def prepare(bwrap: str, spec: Spec, command: list[str]) -> Prepared:
    """The full argv `bwrap --args FD -- command...` with its fds (caller closes them after spawn)."""
    status_r, status_w = os.pipe()
    os.set_inheritable(status_w, True)
    try:
        opts, fds = options(spec, status_w)
        args_fd = memfd("bwrap-args", b"".join(a.encode() + b"\0" for a in opts))
    except BaseException:
        os.close(status_r)
        os.close(status_w)
        raise
    fds += [args_fd, status_w]
    return Prepared([bwrap, "--args", str(args_fd), "--", *command], fds, status_r)
