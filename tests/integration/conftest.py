"""Shared fixtures of the integration tests."""

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

def learning_seeds() -> list[int]:
    """The seeds of the learning tests' training runs: $FLYWHEEL_TEST_SEEDS (e.g. "0 1 2"), else
    [0]. Each seed is a test case of its own, sharing the session's warm starts; the learning
    matrix (bench/learning_matrix.py) runs them under several CPU settings."""
    value = os.environ.get("FLYWHEEL_TEST_SEEDS", "0")
    try:
        return [int(s) for s in value.replace(",", " ").split()]
    except ValueError:
        raise pytest.UsageError(f"FLYWHEEL_TEST_SEEDS={value!r} is not a list of integers") from None


def pytest_generate_tests(metafunc) -> None:
    if "learning_seed" in metafunc.fixturenames:
        metafunc.parametrize("learning_seed", learning_seeds())


@pytest.fixture(scope="session")
def arith_warm_start(tmp_path_factory) -> Path:
    """The peer protocol's tiny model taught `ab+cd=` to a plateau, then taught to forget carries
    most of the time (warm_starts.arith_carry_warm_start): held-out greedy ~0.4, with samples
    that still carry. Shared by the RL learning test, the Ray band test, the gate test and the
    flywheel cycle tests. It replaced a warm start stopped at the first check >= 0.35 of a
    single SFT, which landed inside an abrupt jump whose step moves with the CPU's rounding, so
    the RL test passed on one machine and failed on another (docs/benchmarks.md, "The
    arithmetic warm start on a plateau")."""
    from warm_starts import arith_carry_warm_start

    return arith_carry_warm_start(tmp_path_factory.mktemp("arith-warm"))


@pytest.fixture(scope="session")
def untrained_tiny(tmp_path_factory) -> Path:
    """A random tiny model (hidden 32) for tests of the machinery, whose outcome must not
    depend on what a model learns."""
    from flywheel.models import TinySpec, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("untrained") / "tiny",
                            TinySpec(hidden=32, layers=2, heads=4, ffn=64, max_positions=512))


# ---------------------------------------------------------------- CLI runs to kill


# One interpreter imports what the CLI's training commands need, once; each run is a fork of
# it (as safe as a fresh start: it has run no torch op) in a session of its own, which skips
# the ~4 s of imports a fresh `python -m flywheel.cli.main` spends before its first step.
_ZYGOTE = r'''
import json, os, sys, traceback
import torch, transformers  # noqa: F401
import flywheel.cli.main, flywheel.loop.curation, flywheel.loop.cycle, flywheel.loop.evaluation  # noqa: F401
import flywheel.train.rl, flywheel.train.sft  # noqa: F401
from flywheel.crash_points import kill_at

answers = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
for line in sys.stdin:
    req = json.loads(line)
    if req["op"] == "start":
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                os.setsid()
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                kill_at(req["kill_at"])
                try:
                    flywheel.cli.main.app(req["argv"], prog_name="flywheel")
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 71
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        answer = pid
    else:  # "poll" / "wait"
        try:
            got, status = os.waitpid(req["pid"], 0 if req["op"] == "wait" else os.WNOHANG)
            answer = os.waitstatus_to_exitcode(status) if got else None
        except ChildProcessError as e:
            answer = str(e)
    answers.write(json.dumps(answer) + "\n")
    answers.flush()
'''


class ForkedRun:
    """A `flywheel ...` command forked from the zygote: the calls of subprocess.Popen a test
    needs (poll, wait, send_signal, returncode) and `output` (stdout and stderr, interleaved)."""

    def __init__(self, zygote: "_Zygote", pid: int, log: Path):
        self._zygote, self.pid, self.log, self.returncode = zygote, pid, log, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.ask({"op": "poll", "pid": self.pid}, 10)
        return self.returncode

    def wait(self, timeout: float = 300) -> int:
        if self.returncode is None:
            try:
                self.returncode = self._zygote.ask({"op": "wait", "pid": self.pid}, timeout)
            except TimeoutError:
                self.kill_group()
                self.returncode = self._zygote.answer(30)  # the wait asked above ends with the kill
                raise
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the run and every process it started (its session)."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    @property
    def output(self) -> str:
        return self.log.read_text(errors="replace")


class _Zygote:
    def __init__(self, root: Path):
        self.root, self.count = root, 0
        self._errors = open(root / "zygote.stderr", "w")
        self.proc = subprocess.Popen([sys.executable, "-c", _ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._errors, text=True, start_new_session=True)

    def ask(self, request: dict, timeout: float):
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout, request)

    def answer(self, timeout: float, request: dict | None = None):
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            raise TimeoutError(f"no answer to {request} in {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote died: " + (self.root / "zygote.stderr").read_text()[-2000:])
        return json.loads(line)

    def start(self, argv: list[str], kill_at: str | None = None) -> ForkedRun:
        """`flywheel <argv>` in a new session; with `kill_at`, it SIGKILLs itself at that crash point."""
        self.count += 1
        log = self.root / f"run-{self.count}.log"
        return ForkedRun(self, self.ask({"op": "start", "argv": [str(a) for a in argv], "kill_at": kill_at,
                                         "log": str(log)}, 60), log)

    def close(self) -> None:
        self.proc.stdin.close()
        os.killpg(self.proc.pid, signal.SIGKILL)  # idle between runs: nothing to lose
        self.proc.wait()
        self._errors.close()


@pytest.fixture(scope="session")
def forked_cli(tmp_path_factory):
    """start(argv, kill_at=None) -> ForkedRun: a `flywheel` command that can be SIGKILLed as a
    whole (learner and rollout workers), at a moment the test picks or at a crash point."""
    zygote = _Zygote(tmp_path_factory.mktemp("zygote"))
    try:
        yield zygote.start
    finally:
        zygote.close()
