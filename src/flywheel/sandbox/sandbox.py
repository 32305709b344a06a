"""`Sandbox`: one cold bwrap execution per call (tens of ms; SandboxPool serves snippets in a few).

The process tree of one call, host view:
  /bin/sh (cgroup join, exec's into) -> bwrap (outer) -> bwrap reaper = pid 1 of a new pid
  namespace -> prlimit (sets rlimits, exec's into) -> the command -> its children.
When the command exits, bwrap exits and the pid namespace dies with everything left in it
(a daemonized grandchild included). On timeout or output overflow the reaper is SIGKILLed, which
has the same effect; the cgroup is swept too. bwrap runs in the namespaces of a quota.QuotaFs
holder (nsenter, between the cgroup join and bwrap), whose capped tmpfs are /tmp, /dev/shm and
the workspace: an overlay on the host workspace (or a copy of it where overlayfs is unavailable),
copied back once the run is over (quota.settle), within wall_s + quota.COPY_BACK_S of its start.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from . import bwrap, cgroup, classify, probe, quota, seccomp
from . import result as R
from .capture import run_captured
from .limits import MiB, Limits
from .result import ExecResult, SandboxError
from .workspace import WorkspaceTooLarge, copy_in

# bwrap's own environment and cwd: readable inside as /proc/1/environ (the join shell adds PWD)
HOST_ENV = {"PATH": "/usr/bin:/bin"}
BWRAP_OVERHEAD = 2  # processes of bwrap itself in the cgroup: the outer bwrap and the pid-1 reaper
CGROUP_SLACK = 32 * MiB  # bwrap's and prlimit's own pages on top of memory_mb


def _workspace(workspace: str | Path | None) -> Path | None:
    if workspace is None:
        return None
    p = Path(workspace).resolve()
    if not p.is_dir():
        raise SandboxError(f"workspace {workspace} is not a directory")
    return p


def _stdin_bytes(stdin: str | bytes | None) -> bytes | None:
    if stdin is None or stdin == "":
        return None
    return stdin.encode() if isinstance(stdin, str) else bytes(stdin)


def user_process_count() -> int:
    """Processes of this real uid on the host (what RLIMIT_NPROC counts outside a user namespace)."""
    uid, n = os.getuid(), 0
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.stat(f"/proc/{p}").st_uid == uid:
                    n += 1
            except OSError:
                pass
    return n


class Sandbox:
    """One cold bwrap execution per call.

    `unsafe=None` reads FLYWHEEL_UNSAFE_NO_SANDBOX=1. Without a usable bwrap and without the
    opt-in, construction raises SandboxUnavailable; with it, commands run with rlimits (and a pids
    cgroup if one is writable) only, and every construction warns. Thread-safe: calls share nothing.
    """

    def __init__(self, limits: Limits = Limits(), unsafe: bool | None = None):
        self.limits = limits
        self.backend = probe.choose_backend(unsafe, "Sandbox")
        self._bwrap = probe.find_bwrap()
        self._prlimit = probe.find_prlimit() or "prlimit"
        self._flags = probe.bwrap_spec_flags() if self.backend == "bwrap" else {}
        self._seccomp = seccomp.program()
        self.process_limit = "cgroup" if cgroup.pids_available() else "rlimit"

    @property
    def isolated(self) -> bool:
        return self.backend == "bwrap"

    def run(self, argv: list[str], workspace: str | Path | None = None, stdin: str | None = None,
            env: dict[str, str] | None = None, limits: Limits | None = None, cwd: str = ".",
            read_only: tuple[str, ...] = ()) -> ExecResult:
        """Run `argv` inside a fresh sandbox. The workspace (a host dir) is seen read-write at
        /workspace and is the only writable place besides a private /tmp; `cwd` is relative to
        /workspace. Without a workspace, /workspace is a throwaway tmpfs. What the run writes
        there is capped (Limits.workspace_files, workspace_mb) and reaches the host directory
        when the run is over, all of it or (quota exceeded, no time left) none of it.
        `read_only`: host folders seen read-only at their own paths (a prepared venv), besides
        the running interpreter's."""
        if not argv:
            raise ValueError("argv is empty")
        lim = limits or self.limits
        ws = _workspace(workspace)
        bwrap.inside_cwd(cwd)  # validate early
        try:
            cg = (cgroup.Cgroup(lim.processes, BWRAP_OVERHEAD, lim.memory_mb * MiB + CGROUP_SLACK)
                  if self.process_limit == "cgroup" else None)
        except cgroup.CgroupError as e:
            raise SandboxError(str(e)) from e
        reason, note = None, ""
        try:
            if self.isolated:
                cap, reason, note = self._run_bwrap(list(argv), ws, _stdin_bytes(stdin), env, lim, cwd, cg,
                                                    tuple(os.path.abspath(p) for p in read_only))
            else:
                cap = self._run_unsafe(list(argv), ws, _stdin_bytes(stdin), env, lim, cwd, cg)
        finally:
            pids_hits, ooms = cg.counters() if cg else (0, 0)
            if cg:
                cg.close()
        rc = cap.returncode
        if rc is not None and rc > 0 and self.isolated:
            rc = classify.from_bwrap_exit(rc)
        out, err = cap.stdout.decode("utf-8", "replace"), cap.stderr.decode("utf-8", "replace")
        error = classify.classify(returncode=rc, timed_out=cap.timed_out, overflow=cap.overflow, stderr=err,
                                  pids_hits=pids_hits, oom_kills=ooms, cpu_limit=lim.cpu_s,
                                  duration_s=cap.duration_s, quota=reason == R.QUOTA) or reason
        return ExecResult(rc, out, err + note, cap.duration_s, timed_out=cap.timed_out, truncated=cap.overflow,
                          error=error)

    def run_python(self, code: str, **kw) -> ExecResult:
        """`python -c code` with the host's own interpreter (its venv is mounted read-only)."""
        return self.run([sys.executable, "-c", code], **kw)

    # -- backends -------------------------------------------------------------------------

    def _run_bwrap(self, argv, ws, stdin, env, lim, cwd, cg, read_only=()):
        """(Captured, workspace error reason or None, note for stderr): the run in a QuotaFs whose
        workspace is an overlay on `ws` (or a copy of it), then copied back (quota.settle)."""
        overlay = ws is not None and probe.quota_mode() == "overlay"
        fs = probe.quota_fs(lim, lower=ws if overlay else None)
        try:
            if ws is not None and not overlay:
                try:
                    copy_in(ws, fs.host("ws"))
                except WorkspaceTooLarge as e:
                    raise SandboxError(f"{e.strerror}: {lim.workspace_files} files / {lim.workspace_mb} MiB (raise "
                                       f"Limits.workspace_files / workspace_mb)") from None
            t0 = time.monotonic()
            cap = self._launch(argv, fs, stdin, env, lim, cwd, cg, read_only)
            try:
                reason, note = quota.settle(fs, ws, t0 + lim.wall_s + quota.COPY_BACK_S)
            except (OSError, RecursionError) as e:  # e.g. the holder died, a tree deeper than the recursion limit
                raise SandboxError(f"could not copy the workspace back from the sandbox: {e!r}") from e
        finally:
            fs.close()
        return cap, reason, note

    def _launch(self, argv, fs, stdin, env, lim, cwd, cg, read_only=()):
        mounts = {bwrap.WORKSPACE: fs.inside("ws"), "/tmp": fs.inside("tmp"), "/dev/shm": fs.inside("shm")}
        spec = bwrap.Spec(lim, None, cwd, env, extra_ro=read_only, seccomp=self._seccomp, mounts=mounts,
                          **self._flags)
        # RLIMIT_NPROC (no cgroup) counts bwrap's reaper too
        command = [self._prlimit, *lim.prlimit_args(nproc=cg is None, nproc_overhead=1), "--", *argv]
        prep = bwrap.prepare(self._bwrap, spec, command)
        full = (cg.join_prefix() if cg else []) + fs.prefix() + prep.argv

        def kill_tree(pid: int, child_pid: int | None) -> None:
            if child_pid:  # bwrap's reaper: pid 1 of the sandbox; its death kills the namespace
                try:
                    os.kill(child_pid, signal.SIGKILL)
                except OSError:
                    pass
            else:
                os.kill(pid, signal.SIGKILL)  # still setting up: --die-with-parent does the rest
            if cg:
                cg.kill()

        try:
            cap = run_captured(full, wall_s=lim.wall_s, cap=lim.output_bytes, stdin=stdin, pass_fds=tuple(prep.fds),
                               env=HOST_ENV, cwd="/", status_fd=prep.status_fd, after_spawn=prep.close_fds, kill_tree=kill_tree)
        finally:
            prep.close_fds()
        launched = any("child-pid" in d for d in cap.status)
        finished = any("exit-code" in d for d in cap.status)
        err = cap.stderr.decode("utf-8", "replace")
        if cap.returncode is not None and not finished:
            if cg and cap.returncode == cgroup.JOIN_FAILED and not launched:
                raise SandboxError(f"could not enter the sandbox cgroup: {err.strip()[:500]}")
            if not launched or err.startswith("bwrap:"):
                raise SandboxError(f"bwrap could not start the sandbox: {err.strip()[:1000]}")
        return cap

    def _run_unsafe(self, argv, ws, stdin, env, lim, cwd, cg):
        tmp = None
        if ws is None:
            tmp = tempfile.mkdtemp(prefix="flywheel-unsafe-")
            ws = Path(tmp)
        host_cwd = ws / os.path.relpath(bwrap.inside_cwd(cwd), bwrap.WORKSPACE)
        full_env = {**bwrap.default_env(), "HOME": str(ws), **(env or {})}
        # without a pid namespace RLIMIT_NPROC counts all of this user's processes
        base = user_process_count() if cg is None else 0
        command = [self._prlimit, *lim.prlimit_args(nproc=cg is None, nproc_overhead=base), "--", *argv]

        def kill_tree(pid: int, child_pid: int | None) -> None:
            try:
                os.killpg(pid, signal.SIGKILL)  # start_new_session: the group id is its pid
            except OSError:
                pass
            if cg:
                cg.kill()

        try:
            return run_captured((cg.join_prefix() if cg else []) + command, wall_s=lim.wall_s, cap=lim.output_bytes,
                                stdin=stdin, env=full_env, cwd=str(host_cwd), kill_tree=kill_tree,
                                on_exit=lambda pid: kill_tree(pid, None), start_new_session=True)
        finally:
            if tmp:
                shutil.rmtree(tmp, ignore_errors=True)
