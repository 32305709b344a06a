"""`SandboxPool`: warm sandboxes, each a fork server inside one bwrap sandbox (server.py), so a
short snippet runs in a few ms where a cold bwrap start costs tens of ms (bench/sandbox.py).

Every execution is isolated from the previous one: a fresh child forked from a pristine server,
everything it left behind killed, /tmp and /dev/shm emptied, and a workspace (a capped tmpfs,
quota.py) that is filled from the request's `workspace` before it runs, copied back into it
afterwards (all of it within the request's timeout + quota.COPY_BACK_S, or none of it; none when
the run ended with the workspace full) and then emptied, or dropped with its sandbox when it holds
more than CLEAR_MAX entries. A server that died, stopped answering, or could not clean up (e.g. SysV IPC objects
left behind) is killed with its sandbox and replaced before its next request, so a request that
broke its sandbox returns an ExecResult with `error` set and the next one gets a clean sandbox.
A sandbox whose /tmp or /dev/shm cannot be emptied (no request to blame: a mount layout bug)
would restart on every request: the pool says so once, with a SandboxDirtyWarning and a logged
warning naming what was left; `stats()` counts warm and restarted requests.

Thread-safe: each call takes an idle worker from a queue (blocking while all `size` are busy);
from asyncio use `loop.run_in_executor(None, pool.run_python, code)`.

Differences from `Sandbox`: no per-call `env` or `cwd` (requests run in /workspace with the
server's environment), and the workspace is copied, so the copied-in tree counts against the
workspace quota (cheap for a small repository; for large trees use `Sandbox`, which lays an
overlay on the host directory and counts only what the run writes).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import warnings
import weakref
from pathlib import Path

from . import bwrap, classify, probe, quota, workspace as wsmod
from . import result as R
from .limits import Limits
from .result import ExecResult, SandboxDirtyWarning, SandboxError
from .sandbox import _stdin_bytes, _workspace
from .worker import Worker, dirty

log = logging.getLogger("flywheel.sandbox")


UNCLEAN_STREAK = 3  # unclean requests in a row that make the pool warn
CLEAR_MAX = 4000  # a worker's workspace holding more entries after a request is recycled, not emptied

class _Spawner:
    """A long-lived thread that starts the sandboxes: bwrap's --die-with-parent fires when the
    *thread* that forked it exits, so it must not be a caller's (possibly short-lived) thread."""

    def __init__(self):
        self._q: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._stopped = False
        self._t = threading.Thread(target=self._loop, name="flywheel-sandbox-spawner", daemon=True)
        self._t.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)

    def __call__(self, fn):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise SandboxError("the sandbox pool is closed")
            self._q.put((fn, fut))
        return fut.result()

    def stop(self) -> None:
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._q.put(None)


def _shutdown(workers: list[Worker], spawner: _Spawner) -> None:
    for w in workers:
        w.kill()
    spawner.stop()


class SandboxPool:
    """A warm pool of `size` started sandboxes (see the module docstring).

    `preload`: modules the servers import once at start (e.g. ['pytest']), so that
    `run_module('pytest', [...])` forks from an interpreter that has them already.
    `env`: extra environment variables of the servers, hence of every request.

    For pytest, preload=['pytest'] and env={'PYTEST_DISABLE_PLUGIN_AUTOLOAD': '1'} each cut a
    run's start-up several-fold (plugin imports dominate it); docs/benchmarks.md ("Measurements
    behind choices in the code") has the figures.
    """

    def __init__(self, size: int = 2, limits: Limits = Limits(), unsafe: bool | None = None,
                 preload: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None):
        if size < 1:
            raise ValueError("size must be >= 1")
        self.limits = limits
        self.backend = probe.choose_backend(unsafe, "SandboxPool")
        self.preload = tuple(preload)
        self._spawner = _Spawner()
        self._workers = [Worker(limits, self.isolated, self.preload, self._spawner, env) for _ in range(size)]
        self._idle: queue.Queue = queue.Queue()
        self._closed = False
        self._stats = dict.fromkeys(("requests", "warm", "restarted", "recycled", "unclean"), 0)
        self._stats_lock = threading.Lock()
        self._warned_dirty = False
        self._unclean_streak = 0  # requests in a row whose sandbox could not get clean
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._spawner)
        try:
            with concurrent.futures.ThreadPoolExecutor(size) as ex:  # starts overlap; Popen is on the spawner
                list(ex.map(lambda w: w.start(), self._workers))
        except BaseException:
            self.close()
            raise
        for w in self._workers:
            self._warn_dirty(w.dirty, 3)
            self._idle.put(w)

    @property
    def isolated(self) -> bool:
        return self.backend == "bwrap"

    @property
    def size(self) -> int:
        return len(self._workers)

    def stats(self) -> dict[str, float]:
        """Counters since construction: `requests` that reached a sandbox, of which `warm` (served
        by a started sandbox) and `restarted` (a fresh sandbox was started for it first);
        `recycled` sandboxes killed after a request (died, timed out, not clean), of which
        `unclean` because the server could not get clean; `warm_share` = warm / requests."""
        with self._stats_lock:
            out: dict[str, float] = dict(self._stats)
        out["warm_share"] = out["warm"] / out["requests"] if out["requests"] else 1.0
        return out

    def preload_errors(self) -> dict[str, str]:
        """Modules from `preload` that failed to import in the servers (name -> error)."""
        out: dict[str, str] = {}
        for w in self._workers:
            out.update(w.errors)
        return out

    # -- public calls ---------------------------------------------------------------------

    def run_python(self, code: str, workspace: str | Path | None = None, stdin: str | None = None,
                   timeout_s: float | None = None) -> ExecResult:
        """Run `code` like `python -c code` in /workspace (forked from a warm server)."""
        return self._run({"kind": "python", "code": code}, workspace, stdin, timeout_s)

    def run_module(self, module: str, args: list[str] | tuple[str, ...] = (), workspace: str | Path | None = None,
                   timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """Run `python -m module *args` in /workspace (e.g. 'pytest', ['-q', 'tests'])."""
        return self._run({"kind": "module", "module": module, "args": [str(a) for a in args]}, workspace, stdin,
                         timeout_s)

    def close(self) -> None:
        """Kill every sandbox. Requests in flight on other threads return with error 'killed'
        (their thread removes the worker's directory)."""
        self._closed = True
        idle = []
        while True:
            try:
                idle.append(self._idle.get_nowait())
            except queue.Empty:
                break
        for w in self._workers:
            if any(w is i for i in idle):
                w.kill()
            else:
                w.stop()
        self._spawner.stop()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _warn_dirty(self, left: list[str], stacklevel: int) -> None:
        """Once per pool: a fresh sandbox could not empty its /tmp or /dev/shm, or UNCLEAN_STREAK
        requests in a row left one that could not (`left`: what and why)."""
        with self._stats_lock:
            if not left or self._warned_dirty:
                return
            self._warned_dirty = True
        msg = (f"flywheel.sandbox: SandboxPool cannot get its sandboxes clean between requests, so every "
               f"request restarts its sandbox (many times slower than a warm one); left behind: {'; '.join(left[:3])}. "
               f"Warned once per pool; stats() counts the restarts.")
        warnings.warn(msg, SandboxDirtyWarning, stacklevel=stacklevel)
        log.warning(msg)

    def _acquire(self) -> Worker:
        while True:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            try:
                return self._idle.get(timeout=0.5)
            except queue.Empty:
                continue

    def _run(self, header: dict, workspace, stdin, timeout_s) -> ExecResult:
        timeout = float(timeout_s if timeout_s is not None else self.limits.wall_s)
        if timeout <= 0:
            raise ValueError("timeout_s must be > 0")
        ws = _workspace(workspace)
        data = _stdin_bytes(stdin)
        w = self._acquire()
        try:
            if self._closed:
                raise SandboxError("the sandbox pool is closed")
            if w.alive:
                self._count(requests=1, warm=1)
            else:
                self._count(requests=1, restarted=1)
                w.restart()
                self._warn_dirty(w.dirty, 4)
            return self._run_on(w, header, ws, data, timeout)
        finally:
            if self._closed:
                w.kill()
            else:
                self._idle.put(w)

    def _copy_in(self, w: Worker, ws: Path) -> None:
        try:
            wsmod.copy_in(ws, w.ws)
        except BaseException as e:
            wsmod.clear(w.ws)  # no half-copied workspace for the next request
            if isinstance(e, wsmod.WorkspaceTooLarge):
                raise SandboxError(f"{e.strerror}: {self.limits.workspace_files} files / {self.limits.workspace_mb} "
                                   f"MiB (raise Limits.workspace_files / workspace_mb)") from None
            raise

    def _settle(self, w: Worker, ws: Path | None, deadline: float, broken: bool) -> tuple[str | None, str]:
        """Copy the workspace back (quota.settle), then empty the worker's copy, or recycle the
        worker when it is broken or its copy holds more than CLEAR_MAX entries (its tmpfs then goes
        with its namespace, off this call's clock)."""
        if broken:
            w.stop()  # before touching the workspace: nothing may still write to it (its tmpfs stays)
        try:
            reason, note = quota.settle(w.fs, ws, deadline, src=w.ws)
            if not broken and w.fs is not None and w.fs.usage().files > CLEAR_MAX:
                broken = True
                self._count(recycled=1)
            elif not broken and not wsmod.is_empty(w.ws):
                wsmod.clear(w.ws)
        except (OSError, RecursionError) as e:  # e.g. a tree deeper than the recursion limit
            broken = True
            raise SandboxError(f"could not copy the workspace back from the sandbox: {e!r}") from e
        finally:
            if broken:
                w.kill()  # replaced before the next request (see _run)
        return reason, note

    def _run_on(self, w: Worker, header: dict, ws: Path | None, data: bytes | None, timeout: float) -> ExecResult:
        if ws is not None:
            self._copy_in(w, ws)
        cwd = bwrap.WORKSPACE if self.isolated else w.ws
        resp, out, err, died, host_timeout = {}, b"", b"", False, False
        t0 = time.monotonic()
        try:
            resp, out, err = w.request({**header, "timeout_s": timeout, "cwd": cwd}, data, timeout)
        except TimeoutError:
            host_timeout = True
        except (EOFError, OSError, ValueError):
            died = True
        pids, ooms = w.counter_deltas()
        unclean = not (died or host_timeout) and not resp.get("clean", True)
        broken = died or host_timeout or unclean
        self._count(recycled=int(broken), unclean=int(unclean))
        with self._stats_lock:
            self._unclean_streak = self._unclean_streak + 1 if unclean else 0
            streak = self._unclean_streak
        if streak >= UNCLEAN_STREAK:  # one request can leave a mess; the pool's layout leaves one every time
            self._warn_dirty(dirty(resp), 5)
        reason, wnote = self._settle(w, ws, t0 + timeout + quota.COPY_BACK_S, broken)
        if died or host_timeout:
            note = ("sandbox: no answer from the sandbox server before the deadline; the sandbox was killed\n"
                    if host_timeout else "sandbox: the sandbox server died during this request; it was replaced\n")
            error = classify.classify(returncode=None, timed_out=host_timeout, pids_hits=pids, oom_kills=ooms,
                                      died=died, quota=reason == R.QUOTA) or reason
            return ExecResult(None, "", note + wnote, time.monotonic() - t0, timed_out=host_timeout, error=error)
        rc = resp.get("returncode")
        rc = rc if isinstance(rc, int) or rc is None else None
        out_s, err_s = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        timed_out, overflow = bool(resp.get("timed_out")), bool(resp.get("overflow"))
        cpu = resp.get("cpu_s")
        error = classify.classify(returncode=rc, timed_out=timed_out, overflow=overflow, stderr=err_s,
                                  pids_hits=pids, oom_kills=ooms, cpu_s=cpu if isinstance(cpu, (int, float)) else None,
                                  cpu_limit=self.limits.cpu_s, quota=reason == R.QUOTA) or reason
        dur = resp.get("duration_s")
        return ExecResult(rc, out_s, err_s + wnote, float(dur) if isinstance(dur, (int, float)) else 0.0,
                          timed_out=timed_out, truncated=overflow, error=error)

