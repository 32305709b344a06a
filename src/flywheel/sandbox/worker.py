"""Host side of one warm sandbox of a SandboxPool: a bwrap sandbox running `server.py`, its
capped tmpfs (quota.QuotaFs: /workspace, /tmp, /dev/shm; the host reaches the workspace at `ws`),
its cgroup. In the unsafe mode `ws` is a plain host directory.

Everything read back from the server is untrusted (a request could have subverted it): frames
are JSON with size limits, never pickle, and a server that does not answer within the request's
deadline plus `GRACE_S` is killed with its whole sandbox.

bwrap is started with --die-with-parent, which the kernel ties to the *thread* that forked it,
so workers are spawned from the pool's long-lived spawner thread (see pool.py), never from a
caller's thread that may exit (an executor thread, say) and take the sandbox with it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

from . import bwrap, cgroup, probe, protocol, seccomp, server, workspace
from .quota import QuotaFs
from .capture import _Status
from .limits import MiB, Limits
from .result import SandboxError
from .sandbox import HOST_ENV, user_process_count

GRACE_S = 3.0  # host-side slack past a request's deadline before the whole sandbox is killed
SERVER_OVERHEAD = 2  # processes besides the request's: outer bwrap and the server (pid 1 inside)
FRAME_SLACK = 1 << 16
SERVER_DIR = "/opt/flywheel-sandbox"  # where server.py and protocol.py are placed inside the sandbox


def dirty(frame: dict) -> list[str]:
    """The server's `dirty` list (what its cleaner could not remove), size-capped and escaped
    (repr: no newline or control character reaches a log): the request chose those names."""
    v = frame.get("dirty")
    return [repr(str(x)[:300]) for x in v[:8]] if isinstance(v, list) else []


class Worker:
    def __init__(self, limits: Limits, isolated: bool, preload: tuple[str, ...], spawn: Callable,
                 env: dict[str, str] | None = None):
        self.limits, self.isolated, self.preload, self._spawn = limits, isolated, preload, spawn
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.cg: cgroup.Cgroup | None = None
        self.fs: QuotaFs | None = None  # isolated mode: the capped tmpfs, kept across stop() until kill()
        self.dir: str | None = None  # unsafe mode: the host directory holding `ws`
        self.init_pid: int | None = None  # host pid of the sandbox's pid 1 (the server)
        self.errors: dict[str, str] = {}  # preload / rlimit failures reported by the server
        self.dirty: list[str] = []  # what the fresh server could not clear from /tmp, /dev/shm (see dirty())
        self.dead = True
        self._counters = (0, 0)
        self._lock = threading.Lock()  # stop() may come from close() on another thread

    def counter_deltas(self) -> tuple[int, int]:
        """(forks refused by the pids limit, OOM kills) since the previous call."""
        if self.cg is None:
            return 0, 0
        now = self.cg.counters()
        before, self._counters = self._counters, now
        return now[0] - before[0], now[1] - before[1]

    @property
    def ws(self) -> str:
        """The request's workspace as the host reaches it."""
        return self.fs.host("ws") if self.fs is not None else os.path.join(self.dir, "ws")

    @property
    def alive(self) -> bool:
        return not self.dead and self.proc is not None and self.proc.poll() is None

    def _config(self) -> str:
        lim = self.limits
        rl = {k: v for k, v in lim.rlimits().items() if k in ("AS", "FSIZE", "NOFILE", "CORE")}
        # RLIMIT_NPROC fallback: counts the user namespace (the server too) or, without one (the
        # unsafe mode), every process of this user
        base = 1 if self.isolated else user_process_count()
        return json.dumps({"limits": lim.as_dict(), "rlimits": rl, "nproc": self.cg is None, "nproc_base": base,
                           "pidns": self.isolated, "preload": list(self.preload)})

    def _prepare(self) -> None:
        """The capped tmpfs (or the unsafe mode's host directory) and the cgroup."""
        try:
            if self.isolated:
                self.fs = probe.quota_fs(self.limits)
            else:
                self.dir = tempfile.mkdtemp(prefix="flywheel-pool-")
                os.mkdir(self.ws, 0o700)
            self.cg = cgroup.Cgroup(self.limits.processes, SERVER_OVERHEAD, None) if cgroup.pids_available() else None
        except SandboxError:
            self.kill()
            raise
        except OSError as e:  # CgroupError included
            self.kill()
            raise SandboxError(str(e)) from e

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the sandbox and wait for the server's ready frame."""
        lim = self.limits
        self._prepare()
        prefix = self.cg.join_prefix() if self.cg else []
        if self.isolated:  # the server's source is placed inside as a read-only file
            command = [sys.executable, f"{SERVER_DIR}/server.py", self._config()]
            files = {f"{SERVER_DIR}/{Path(m.__file__).name}": Path(m.__file__).read_bytes() for m in (server, protocol)}
            mounts = {bwrap.WORKSPACE: self.fs.inside("ws"), "/tmp": self.fs.inside("tmp"),
                      "/dev/shm": self.fs.inside("shm")}
            spec = bwrap.Spec(lim, None, ".", self.env, seccomp=seccomp.program(), files=files,
                              as_pid_1=True, mounts=mounts, **probe.bwrap_spec_flags())
            prep = bwrap.prepare(probe.find_bwrap(), spec, command)
            argv, fds, env, cwd = prefix + self.fs.prefix() + prep.argv, tuple(prep.fds), HOST_ENV, "/"
            status_fd = prep.status_fd
        else:
            prep = None
            command = [sys.executable, server.__file__, self._config()]
            env = {**bwrap.default_env(), "HOME": self.ws, **self.env}
            argv, fds, cwd, status_fd = prefix + command, (), self.ws, None
        try:
            self.proc = self._spawn(lambda: subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=fds,
                env=env, cwd=cwd, start_new_session=not self.isolated))
        except BaseException:
            if prep:
                prep.close_fds()
                os.close(prep.status_fd)
            self.kill()
            raise
        if prep:
            prep.close_fds()
        self.dead = False
        try:
            hdr, _ = protocol.read_frame(self.proc.stdout.fileno(), deadline=time.monotonic() + timeout_s, max_blob=0)
            if not hdr.get("ready"):
                raise ValueError(f"unexpected first frame {hdr}")
        except (EOFError, TimeoutError, ValueError, OSError) as e:
            err = self._stderr_tail()
            self.kill()
            raise SandboxError(f"the sandbox server did not start ({e}): {err}") from None
        finally:
            if status_fd is not None:
                self.init_pid = self._read_status(status_fd)
        self.errors = hdr.get("errors", {})
        self.dirty = dirty(hdr)
        if self.cg is not None:  # cap the tree at the server's idle footprint + memory_mb
            used = self.cg.memory_usage()
            if used is not None:
                self.cg.set_memory(used + lim.memory_mb * MiB)
            self._counters = self.cg.counters()

    def _read_status(self, fd: int) -> int | None:
        st = _Status()
        os.set_blocking(fd, False)
        try:
            st.feed(os.read(fd, 1 << 16))
        except OSError:
            pass
        finally:
            os.close(fd)
        return st.get("child-pid")

    def _stderr_tail(self) -> str:
        try:
            os.set_blocking(self.proc.stderr.fileno(), False)
            return (self.proc.stderr.read() or b"")[-2000:].decode("utf-8", "replace").strip()
        except (OSError, ValueError, TypeError):
            return ""

    def request(self, header: dict, stdin: bytes | None, timeout_s: float) -> tuple[dict, bytes, bytes]:
        """Send one request and wait for its answer. Raises TimeoutError (no answer in time),
        EOFError/OSError (the sandbox died) or ValueError (a malformed answer)."""
        protocol.write_frame(self.proc.stdin.fileno(), header, [stdin or b""])
        resp, blobs = protocol.read_frame(self.proc.stdout.fileno(), deadline=time.monotonic() + timeout_s + GRACE_S,
                                        max_blob=self.limits.output_bytes + FRAME_SLACK)
        if len(blobs) != 2:
            raise ValueError("malformed answer")
        return resp, blobs[0], blobs[1]

    def stop(self) -> None:
        """Kill the sandbox (everything in it), reap it and remove its cgroup; keep the directory."""
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        self.dead = True
        if self.proc is not None:
            if self.init_pid and self.proc.poll() is None:
                try:
                    os.kill(self.init_pid, signal.SIGKILL)  # pid 1 of the sandbox (the server): takes all with it
                except OSError:
                    pass
            if self.cg is not None:
                self.cg.kill()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                if not self.isolated:
                    try:
                        os.killpg(self.proc.pid, signal.SIGKILL)
                    except OSError:
                        pass
                self.proc.kill()
                self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                try:
                    f.close()
                except (OSError, ValueError):
                    pass
            self.proc = None
        if self.cg is not None:
            self.cg.close()
            self.cg = None
        self.init_pid = None

    def kill(self) -> None:
        """stop(), then drop the capped tmpfs (or remove the unsafe mode's host directory)."""
        with self._lock:
            self._stop()
            if self.fs is not None:
                self.fs.close()
                self.fs = None
            if self.dir is not None:
                workspace.remove_tree(self.dir)
                self.dir = None

    def restart(self) -> None:
        self.kill()
        self.start()
