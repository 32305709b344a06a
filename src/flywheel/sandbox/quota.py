"""Capped filesystems for one sandbox: the workspace, /tmp and /dev/shm, each a tmpfs with a byte
cap (`size=`) and an inode cap (`nr_inodes=`).

Why: bwrap can size a tmpfs (`--size`) but not cap its inodes, and a host directory bind-mounted
as the workspace has no cap at all, so a loop creating empty files filled the host workspace
(tens of thousands of files per second) and the pool then spent many seconds past the deadline
copying them back. A capped tmpfs makes the loop fail with ENOSPC inside the sandbox instead.

How: a holder process (`unshare --user --map-root-user --mount`, then /bin/sh) mounts the tmpfs
on directories under a private host directory `base`, inside a user and mount namespace of its
own (any user that may create user namespaces can, as bwrap needs to), and then waits on a pipe.
The sandbox is started inside that namespace (`prefix()`: nsenter) and bind-mounts `inside(name)`;
the host reaches the same files through the holder's root, `/proc/<holder>/root` (`host(name)`).
Closing the pipe (or the host process dying) ends the holder, and its namespace and mounts with it.

Overlay mode (`lower` given; the cold Sandbox): "ws" is an overlayfs whose lower layer is the host
workspace (bind-mounted at base/lower) and whose upper layer lives on the capped tmpfs "up": the
run sees the host files without a copy, and only what it writes counts against the quota.
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import select
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import copyback
from . import result as R
from .limits import MiB, Limits
from .result import SandboxError

# a run's workspace is copied back by its start + wall_s + COPY_BACK_S or not at all, so that a
# call returns within wall_s + 1 s (the rest: killing the run, the holder's and cgroup's teardown)
COPY_BACK_S = 0.6
HOLDER_ENV = {"PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
SAFE_BASE = re.compile(r"[A-Za-z0-9_./+-]+")  # goes into mount options unescaped
# $1 base, $2 fstab fd, $3 "overlay" or "": mount, say ready, hold until stdin closes
HOLDER = r'''
mount -a -T "/proc/self/fd/$2" || exit 125
if [ "$3" = overlay ]; then
  mkdir "$1/up/u" "$1/up/w" || exit 125
  mount -t overlay -o "lowerdir=$1/lower,upperdir=$1/up/u,workdir=$1/up/w,userxattr" flywheel-ws "$1/ws" || exit 126
fi
echo ready
read _ || true
'''


@dataclass(frozen=True)
class Usage:
    """What a capped tmpfs holds (statvfs); `full` when no inode or no block is left, i.e. a
    write may have failed with ENOSPC."""

    files: int
    bytes: int
    full: bool


def _fstab_path(p: str) -> str:
    return p.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011").replace("\n", "\\012")


def fstab(base: str, lim: Limits, lower: str | None) -> str:
    """The holder's mounts: one tmpfs per capped directory (and the overlay's lower bind)."""
    ws = "up" if lower is not None else "ws"
    rows = [(ws, lim.workspace_bytes), ("tmp", lim.tmpfs_bytes), ("shm", lim.tmpfs_bytes)]
    out = [f"flywheel {_fstab_path(f'{base}/{name}')} tmpfs size={size},nr_inodes={lim.workspace_files},mode=0755 0 0"
           for name, size in rows]
    if lower is not None:
        out.append(f"{_fstab_path(lower)} {_fstab_path(base + '/lower')} none bind 0 0")
    return "\n".join(out) + "\n"


class QuotaFs:
    """The capped tmpfs mounts of one sandbox and the holder process that keeps them (module doc).

    Names: "ws" (the workspace, bound at /workspace), "tmp", "shm"; in overlay mode also "up"
    (the tmpfs holding the overlay's upper layer "up/u"). Raises SandboxError when the holder
    cannot mount them (no user namespaces, no `unshare`/`mount`)."""

    def __init__(self, limits: Limits, lower: str | Path | None = None, unshare: str = "unshare",
                 nsenter: str = "nsenter", timeout_s: float = 30.0):
        self.limits, self.overlay, self._nsenter = limits, lower is not None, nsenter
        self.base = tempfile.mkdtemp(prefix="flywheel-quota-")
        self.proc: subprocess.Popen | None = None
        try:
            if not SAFE_BASE.fullmatch(self.base):
                raise SandboxError(f"temporary directory {self.base!r} has characters unsafe in mount options; "
                                   f"set TMPDIR to a plain path")
            for name in ("ws", "tmp", "shm") + (("up", "lower") if self.overlay else ()):
                os.mkdir(f"{self.base}/{name}", 0o700)
            self._start(unshare, None if lower is None else os.path.realpath(lower), timeout_s)
        except BaseException:
            self.close()
            raise

    def _start(self, unshare: str, lower: str | None, timeout_s: float) -> None:
        fd = os.memfd_create("fstab", 0)
        try:
            os.write(fd, fstab(self.base, self.limits, lower).encode())
            self.proc = subprocess.Popen(
                [unshare, "--user", "--map-root-user", "--mount", "--propagation", "private", "/bin/sh", "-c", HOLDER,
                 "flywheel-quota", self.base, str(fd), "overlay" if lower is not None else ""],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(fd,),
                env=HOLDER_ENV, cwd="/")
        finally:
            os.close(fd)
        line, out = b"", self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while not line.endswith(b"\n") and select.select([out], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = os.read(out, 64)
            if not chunk:
                break
            line += chunk
        if line != b"ready\n":
            err = self._stderr()
            raise SandboxError(f"could not mount the sandbox's capped tmpfs (workspace quota) in a user namespace "
                               f"(exit {self.proc.poll()}): {err or line[:200]!r}")

    def _stderr(self) -> str:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
            return self.proc.stderr.read().decode("utf-8", "replace").strip()[-1000:]
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def quota_dir(self) -> str:
        """The capped tmpfs that holds the workspace's data."""
        return "up" if self.overlay else "ws"

    def inside(self, name: str) -> str:
        """Path of `name` in the holder's mount namespace (what bwrap, run via `prefix()`, binds)."""
        return f"{self.base}/{name}"

    def host(self, name: str) -> str:
        """Path of `name` as the host process reaches it (through the holder's root)."""
        return f"/proc/{self.pid}/root{self.base}/{name}"

    def upper(self) -> str:
        """Host path of the overlay's upper layer: what the run wrote (overlay mode only)."""
        return self.host("up") + "/u"

    def prefix(self) -> list[str]:
        """Command prefix that runs the rest of a command line in the holder's namespaces."""
        return [self._nsenter, f"--target={self.pid}", "--user", "--mount", "--preserve-credentials", "--"]

    def usage(self, name: str | None = None) -> Usage:
        st = os.statvfs(self.host(name or self.quota_dir))
        return Usage(st.f_files - st.f_ffree, (st.f_blocks - st.f_bfree) * st.f_frsize,
                     st.f_ffree == 0 or st.f_bfree == 0)

    def close(self) -> None:
        """End the holder: its namespace and mounts go when it exits, and then `base` is removed.
        Returns at once (unmounting waits for RCU grace periods, ~4 ms a mount): a reaper thread
        waits for the holder. Idempotent."""
        if self.proc is not None:
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    f.close()
                except (OSError, ValueError):
                    pass
        if self.proc is not None or self.base is not None:
            _reap_later(self.proc, self.base)
        self.proc = self.base = None


_reap_q: queue.SimpleQueue = queue.SimpleQueue()
_reaper_lock = threading.Lock()
_reaper: threading.Thread | None = None
_exiting = False


def _reap(proc: subprocess.Popen | None, base: str | None) -> None:
    if proc is not None:
        try:
            proc.wait(timeout=10)  # its stdin is closed: it is exiting
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if base is not None:
        for name in ("ws", "tmp", "shm", "up", "lower", ""):
            try:
                os.rmdir(os.path.join(base, name))
            except OSError:
                pass


def _reap_forever() -> None:
    while (item := _reap_q.get()) is not None:
        _reap(*item)


def _reap_later(proc: subprocess.Popen | None, base: str | None) -> None:
    global _reaper
    with _reaper_lock:
        if _exiting:  # after _drain (a pool's finalizer at exit): no thread to hand it to
            _reap(proc, base)
            return
        if _reaper is None or not _reaper.is_alive():
            _reaper = threading.Thread(target=_reap_forever, name="flywheel-quota-reaper", daemon=True)
            _reaper.start()
        _reap_q.put((proc, base))


@atexit.register
def _drain() -> None:
    """At exit: let the reaper finish (bounded), so no empty mount-point directories stay behind."""
    global _exiting
    with _reaper_lock:
        _exiting = True
        if _reaper is not None and _reaper.is_alive():
            _reap_q.put(None)
            _reaper.join(timeout=5)


def exceeded_note(u: Usage, lim: Limits) -> str:
    return (f"workspace quota exceeded: {u.files} of {lim.workspace_files} files, "
            f"{u.bytes / MiB:.1f} of {lim.workspace_mb} MiB")


def settle(fs: QuotaFs | None, dst: str | Path | None, deadline: float,
           src: str | None = None) -> tuple[str | None, str]:
    """After a run, with nothing left running in the sandbox: (error reason or None, a note for
    stderr). A full workspace (a write may have failed for lack of space or inodes) is reported
    and nothing is copied back; otherwise the workspace is copied back onto `dst` (None: nothing
    to copy back to) before `deadline` (monotonic), or not at all. Either way a `dst` that does
    not get the run's copy stays as it was before the call. `fs=None` (the unsafe mode, no
    quota): the plain directory `src` is copied back."""
    upper = False
    if fs is not None:
        u = fs.usage()
        if u.full:
            return R.QUOTA, f"sandbox: {exceeded_note(u, fs.limits)}; nothing was copied back to the workspace\n"
        src, upper = (fs.upper(), True) if fs.overlay else (fs.host("ws"), False)
    if dst is None:
        return None, ""
    try:
        copyback.copy_back(src, os.fspath(dst), deadline, upper=upper)
    except copyback.CopyBackTimeout:
        return R.COPY_BACK, ("sandbox: the workspace could not be copied back within the time limit; it was left "
                             "as it was before the call\n")
    return None, ""
