"""A pre-imported interpreter that forks each fine-tuning job's training process.

A fresh `python -m flywheel.worker.job_run` spends seconds importing torch, transformers and
the recipes before a tiny job trains its first step. A worker instead keeps one zygote: a
process that imported all of it once (and has run no torch op, so no thread pools exist to be
lost in a fork) and forks a child per job, which runs `job_run.child_main(job_dir)` with its
output in JOB_DIR/train.log. The child dies with the zygote, the zygote with its worker
(PR_SET_PDEATHSIG), so a killed worker leaves nothing running.

Protocol, one JSON object per line: the worker writes `{"job_dir": PATH}` to the zygote's
stdin; the zygote answers `{"pid": N}` once it forked, and `{"pid": N, "exit": STATUS}` when
that child ended (STATUS as subprocess gives it: the exit code, or -SIGNAL).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path


class ZygoteChild:
    """A job's training process forked by the zygote, with the part of subprocess.Popen's API
    the worker uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self._done = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"job child {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def _ended(self, status: int) -> None:
        self.returncode = status
        self._done.set()


class Zygote:
    """The worker's side: starts the zygote on first use (and again if it died)."""

    def __init__(self):
        self._proc: subprocess.Popen | None = None
        self._children: dict[int, ZygoteChild] = {}  # of the zygote running now, by pid
        self._forked: list[ZygoteChild] = []  # forked, not yet handed to spawn's caller
        self._cond = threading.Condition()

    def spawn(self, job_dir: Path) -> ZygoteChild:
        with self._cond:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            proc = self._proc
            proc.stdin.write(json.dumps({"job_dir": str(job_dir)}) + "\n")
            proc.stdin.flush()
            deadline = time.monotonic() + 300  # the first fork waits for the zygote's imports
            while not self._forked:
                if proc.poll() is not None:
                    raise RuntimeError(f"the job zygote exited with status {proc.returncode} before it forked")
                if time.monotonic() > deadline:
                    raise RuntimeError("the job zygote did not fork within 300 s")
                self._cond.wait(timeout=1.0)
            return self._forked.pop(0)

    def _start(self) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "flywheel.worker.zygote"], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, bufsize=1,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._children = {}
        threading.Thread(target=self._read, args=(self._proc, self._children), name="flywheel-zygote",
                         daemon=True).start()

    def _read(self, proc: subprocess.Popen, children: dict[int, ZygoteChild]) -> None:
        """Follow one zygote's messages; `children` is its own table (a restarted zygote has another)."""
        for line in proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "exit" in msg:
                    child = children.pop(msg["pid"], None)
                    if child is not None:
                        child._ended(msg["exit"])
                else:
                    child = children[msg["pid"]] = ZygoteChild(msg["pid"])
                    self._forked.append(child)
                self._cond.notify_all()
        with self._cond:  # this zygote is gone: so are its children (they die with it)
            for child in children.values():
                child._ended(-9)
            children.clear()
            self._cond.notify_all()

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()


def main() -> None:
    from flywheel.process import die_with_parent

    die_with_parent()
    import importlib

    from flywheel.worker import job_run
    for module in ("flywheel.train.sft", "flywheel.train.dpo", "flywheel.train.rl", "flywheel.loop.cycle", "peft"):
        importlib.import_module(module)  # what every job imports anyway, once

    out = threading.Lock()

    def say(msg: dict) -> None:
        with out:
            sys.stdout.write(json.dumps(msg) + "\n")
            sys.stdout.flush()

    def reap(pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        say({"pid": pid, "exit": os.waitstatus_to_exitcode(status)})

    for line in sys.stdin:
        job_dir = Path(json.loads(line)["job_dir"])
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                log = os.open(job_dir / "train.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.close(log)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                code = job_run.child_main(job_dir)
            except BaseException:  # noqa: BLE001 - whatever happens, the fork never returns to the loop
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        say({"pid": pid})
        threading.Thread(target=reap, args=(pid,), daemon=True).start()


if __name__ == "__main__":
    main()
