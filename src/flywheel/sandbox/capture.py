"""Run one host process with a wall-clock deadline, feed its stdin, capture stdout/stderr up to
a cap, and read bwrap's JSON status stream, all in one `select` loop (no threads).

The deadline and the output cap both call `kill_tree`, which the caller supplies (for bwrap:
SIGKILL the sandbox's pid 1, whose death takes the whole pid namespace down, plus the cgroup).
If the process has not exited a second after that, the process itself is SIGKILLed. A killed
run has returncode None.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable

CHUNK = 1 << 16


@dataclass
class Captured:
    returncode: int | None  # None when it had to be killed; negative = signal (subprocess convention)
    stdout: bytes
    stderr: bytes
    duration_s: float
    timed_out: bool = False
    overflow: bool = False  # a stream passed the cap (the tree was killed)
    status: list[dict] = field(default_factory=list)  # bwrap --json-status-fd documents


class _Status:
    """Incremental parser of bwrap's status fd: JSON documents one after another."""

    def __init__(self):
        self.buf = ""
        self.docs: list[dict] = []

    def feed(self, data: bytes) -> None:
        self.buf += data.decode("utf-8", "replace")
        dec = json.JSONDecoder()
        while True:
            s = self.buf.lstrip()
            if not s:
                self.buf = ""
                return
            try:
                doc, end = dec.raw_decode(s)
            except ValueError:
                self.buf = s
                return
            if isinstance(doc, dict):
                self.docs.append(doc)
            self.buf = s[end:]

    def get(self, key: str):
        return next((d[key] for d in self.docs if key in d), None)


def _close_up(proc: subprocess.Popen, sel: selectors.BaseSelector, pidfd: int, status_fd: int | None,
              exited: bool) -> None:
    """Close every descriptor run_captured opened and reap the process (killed first when
    leaving early, on an exception: never wait on a live sandbox); sets proc.returncode."""
    sel.close()
    os.close(pidfd)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        if f is not None and not f.closed:
            try:
                f.close()
            except OSError:
                pass
    if status_fd is not None:
        os.close(status_fd)
    if not exited:
        proc.kill()
    if proc.returncode is None:
        proc.returncode = os.waitstatus_to_exitcode(os.waitpid(proc.pid, 0)[1])


def run_captured(argv: list[str], *, wall_s: float, cap: int, stdin: bytes | None = None,
                 pass_fds: tuple[int, ...] = (), env: dict[str, str] | None = None, cwd: str | None = None,
                 status_fd: int | None = None, after_spawn: Callable[[], None] | None = None,
                 kill_tree: Callable[[int, int | None], None] | None = None,
                 on_exit: Callable[[int], None] | None = None, start_new_session: bool = False) -> Captured:
    """`kill_tree(pid, child_pid)` gets the process's pid and bwrap's reported child pid (pid 1
    of the sandbox; None if not yet known). `on_exit(pid)` runs once the process has exited (before
    draining its pipes): the place to kill leftovers that would hold the pipes open."""
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=pass_fds,
                            env=env, cwd=cwd, start_new_session=start_new_session)
    if after_spawn is not None:
        after_spawn()  # e.g. close our copies of the fds bwrap inherited
    deadline = t0 + wall_s
    out, err = bytearray(), bytearray()
    status = _Status()
    timed_out = overflow = False
    kill_at: float | None = None  # when kill_tree ran
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, out)
    sel.register(proc.stderr, selectors.EVENT_READ, err)
    sel.register(pidfd, selectors.EVENT_READ, "exit")
    if status_fd is not None:
        sel.register(status_fd, selectors.EVENT_READ, status)
    pending = memoryview(stdin or b"")
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE, "stdin")
    exited_at: float | None = None

    def kill(now: float) -> None:
        nonlocal kill_at
        if kill_at is None:
            kill_at = now
            if kill_tree is not None:
                kill_tree(proc.pid, status.get("child-pid"))
            else:
                proc.kill()

    try:
        while True:
            readers = [k for k in sel.get_map().values() if k.data not in ("exit", "stdin")]
            if exited_at is not None and (not readers or time.monotonic() - exited_at > 1.0):
                break  # exited and drained (or something outside still holds a pipe: give up on it)
            now = time.monotonic()
            if not timed_out and not overflow and now >= deadline and exited_at is None:
                timed_out = True
                kill(now)
            if kill_at is not None and exited_at is None and now - kill_at > 1.0:
                proc.kill()
            wait = max(0.0, deadline - now) if kill_at is None else 0.05
            if exited_at is not None:
                wait = min(wait, 0.05)
            for key, _ in sel.select(timeout=wait):
                if key.data == "exit":
                    sel.unregister(pidfd)
                    exited_at = time.monotonic()
                    if on_exit is not None:
                        on_exit(proc.pid)
                elif key.data == "stdin":
                    try:
                        n = os.write(key.fd, pending[:CHUNK])
                        pending = pending[n:]
                    except (BrokenPipeError, BlockingIOError):
                        n = -1
                    if not pending or n < 0:
                        sel.unregister(key.fileobj)
                        proc.stdin.close()
                else:
                    data = os.read(key.fd, CHUNK)
                    if not data:
                        sel.unregister(key.fileobj)
                        continue
                    if isinstance(key.data, _Status):
                        key.data.feed(data)
                        continue
                    buf = key.data
                    room = cap - len(buf)
                    if len(data) > room:
                        buf += data[:max(room, 0)]
                        if not overflow and kill_at is None:
                            overflow = True
                            kill(time.monotonic())
                    else:
                        buf += data
    finally:
        _close_up(proc, sel, pidfd, status_fd, exited=exited_at is not None)
    rc = proc.returncode
    if kill_at is not None:
        rc = None
    return Captured(rc, bytes(out), bytes(err), time.monotonic() - t0, timed_out, overflow, status.docs)

