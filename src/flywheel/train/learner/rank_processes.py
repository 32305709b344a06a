"""Starting the ranks of an FSDP2 learner (train/learner/ranks.py) as local processes.

Processes. `launch` (in the calling process) hosts the rendezvous store (a TCPStore on
127.0.0.1, port chosen by the OS: no race for a free port), starts `world_size` fresh
interpreters (`python -m flywheel.train.learner.rank_processes JOB`), writes their pids to
OUTPUT/fsdp2/ranks.json and each rank's output to OUTPUT/fsdp2/rank{r}.log, and relays
rank 0's log lines. If any rank dies (a SIGKILL, an exception), the launcher SIGKILLs the
others and raises: the rank's own exception when it raised one, else TrainError naming the
rank and signal. Since checkpoints are renamed into place whole, `resume: true` then
continues from the newest complete one exactly as after a single-process kill. Ranks die
with the launcher (PR_SET_PDEATHSIG on Linux). A stop requested of the launcher (SIGTERM /
request_stop) is forwarded as SIGTERM; ranks agree on stopping once per step (all-reduce of
the stop and deadline flags), so all stop after the same step and checkpoint together.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import importlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from flywheel.errors import TrainError
from flywheel.threads import choose_threads, cpu_facts
from flywheel.train.learner.ranks import Rank
from flywheel.train.stop import request_stop, stop_requested

_ENV_RANK, _ENV_WORLD, _ENV_PORT = "FLYWHEEL_FSDP2_RANK", "FLYWHEEL_FSDP2_WORLD", "FLYWHEEL_FSDP2_PORT"
_ENV_CHANNEL = "FLYWHEEL_FSDP2_CHANNEL"  # a rank's end of its connection to the launcher (RankProcesses)
_HOST = "127.0.0.1"



def launch(target: str, payload: Any, world_size: int, device: str, workdir: str | Path,
           log: Callable[[str], None] = print, threads: int | None = None) -> Any:
    """Run `target` ("module:function", called as fn(payload, rank: Rank)) in `world_size`
    fresh processes joined in one process group; return rank 0's return value, or raise the
    first failing rank's exception (see the module doc). `workdir`/fsdp2 holds the job,
    ranks.json (pids) and each rank's log. `threads`: torch threads per rank on CPU
    (default: this machine's cores / world_size)."""
    ranks = RankProcesses(target, payload, world_size, device, workdir, log, threads)
    try:
        return ranks.wait()
    finally:
        ranks.kill()


class RankProcesses:
    """`world_size` ranks started as in `launch`, for a caller that talks to them while they
    run: with `channels`, each rank gets a Connection to this process (`Rank.channel`; this
    side: `conns[r]`)."""

    def __init__(self, target: str, payload: Any, world_size: int, device: str, workdir: str | Path,
                 log: Callable[[str], None] = print, threads: int | None = None, channels: bool = False):
        if world_size < 1:
            raise TrainError(f"train.world_size must be >= 1, got {world_size}")
        if device.startswith("cuda"):
            if not torch.cuda.is_available() or torch.cuda.device_count() < world_size:
                found = torch.cuda.device_count() if torch.cuda.is_available() else 0
                raise TrainError(f"train.strategy=fsdp2 on {device} needs train.world_size={world_size} GPUs; "
                                 f"this machine has {found}")
        elif device != "cpu":
            raise TrainError(f"train.strategy=fsdp2 runs on device 'cpu' (gloo) or 'cuda' (nccl), not {device!r}")
        self.run_dir = run_dir = Path(workdir) / "fsdp2"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True)
        job = run_dir / "job.pkl"
        job.write_bytes(pickle.dumps({"target": target, "payload": payload, "device": device}))
        self._store = dist.TCPStore(_HOST, 0, world_size, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=300))
        threads = threads or choose_threads(cpu_facts(measure_busy=False), processes=world_size).threads
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self._logs = []
        self._relay = None
        try:
            for r in range(world_size):
                env = {**os.environ, _ENV_RANK: str(r), _ENV_WORLD: str(world_size),
                       _ENV_PORT: str(self._store.port), "OMP_NUM_THREADS": str(threads)}
                fds = []
                if channels:
                    here, there = socket.socketpair()
                    env[_ENV_CHANNEL] = str(there.fileno())
                    fds = [there.fileno()]
                out = open(run_dir / f"rank{r}.log", "w")
                self._logs.append(out)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "flywheel.train.learner.rank_processes", str(job)], env=env, pass_fds=fds,
                    stdout=subprocess.PIPE if r == 0 else out, stderr=out, text=True, preexec_fn=_die_with_parent))
                if channels:
                    there.close()
                    self.conns.append(Connection(here.detach()))
            (run_dir / "ranks.json").write_text(json.dumps({str(r): p.pid for r, p in enumerate(self.procs)}) + "\n")
            self._relay = threading.Thread(target=_relay, args=(self.procs[0].stdout, self._logs[0], log),
                                           daemon=True)
            self._relay.start()
        except BaseException:
            self.kill()
            raise

    def wait(self) -> Any:
        """Wait for every rank to exit; rank 0's return value, or raise the failure."""
        failed = _wait(self.procs)
        if self._relay is not None:
            self._relay.join(timeout=10)
        if failed is not None:
            self.kill()
            self.raise_failure(failed)
        result = self.run_dir / "result.pkl"
        if not result.exists():
            raise TrainError(f"fsdp2: rank 0 exited without a result; see {self.run_dir / 'rank0.log'}")
        return pickle.loads(result.read_bytes())

    def dead(self) -> int | None:
        """A rank that has exited (the one that failed first, as `_wait` chooses), or None."""
        codes = {r: p.poll() for r, p in enumerate(self.procs)}
        exited = {r: c for r, c in codes.items() if c is not None}
        if not exited:
            return None
        return min(exited, key=lambda r: (exited[r] >= 0, exited[r] == 0, r))  # signalled, failed, done

    def kill(self) -> None:
        """SIGKILL the ranks still running; close the logs and the store."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for c in self.conns:
            c.close()
        self.conns = []
        for f in self._logs:
            f.close()
        self._logs = []
        self._store = None

    def raise_failure(self, failed: int):
        _raise_failure(self.run_dir, self.procs, failed)


def _wait(procs: list[subprocess.Popen]) -> int | None:
    """Wait for every rank; once one fails, SIGKILL the rest and return the failed rank (None:
    all succeeded). Of ranks that failed on their own, one killed by a signal is the cause
    (the others then fail in a collective: "Connection reset by peer"), else the lowest."""
    forwarded = False
    while True:
        codes = [p.poll() for p in procs]
        failed = {r: c for r, c in enumerate(codes) if c not in (None, 0)}
        if failed:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return min(failed, key=lambda r: (failed[r] >= 0, r))
        if all(c == 0 for c in codes):
            return None
        if stop_requested() and not forwarded:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            forwarded = True
        time.sleep(0.02)


def _raise_failure(run_dir: Path, procs: list[subprocess.Popen], failed: int):
    """Raise the failed rank's own exception, or TrainError naming how it died."""
    code = procs[failed].returncode
    err = run_dir / f"error.rank{failed}.pkl"
    if err.exists():
        try:
            exc = pickle.loads(err.read_bytes())
        except Exception:  # an exception that does not unpickle: its text is in the log
            exc = None
        if exc is not None:
            raise exc
    tail = (run_dir / f"rank{failed}.log").read_text(errors="replace")[-3000:]
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    raise TrainError(f"fsdp2: rank {failed} (pid {procs[failed].pid}) {how}; the other ranks were stopped. "
                     f"resume=true continues from the newest complete checkpoint. Its log ends:\n{tail}")


def _relay(stream, copy, log: Callable[[str], None]) -> None:
    for line in stream:
        copy.write(line)
        copy.flush()
        log(line.rstrip("\n"))


def _die_with_parent() -> None:
    """In a rank, before exec: SIGKILL when the launcher dies (Linux), so no orphaned rank
    trains on and writes checkpoints beside a resumed run."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _rank_main(job_path: str) -> int:
    rank, world, port = int(os.environ[_ENV_RANK]), int(os.environ[_ENV_WORLD]), int(os.environ[_ENV_PORT])
    run_dir = Path(job_path).parent
    job = pickle.loads(Path(job_path).read_bytes())
    signal.signal(signal.SIGTERM, lambda *_: request_stop())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: its stacks into its log
    device = job["device"]
    if device.startswith("cuda"):
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    store = dist.TCPStore(_HOST, port, is_master=False, timeout=timedelta(seconds=300))
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo", store=store, rank=rank,
                            world_size=world)
    try:
        module, _, name = job["target"].partition(":")
        channel = Connection(int(os.environ[_ENV_CHANNEL])) if _ENV_CHANNEL in os.environ else None
        result = getattr(importlib.import_module(module), name)(job["payload"], Rank(rank, world, device, channel))
        if rank == 0:
            tmp = run_dir / "result.pkl.tmp"
            tmp.write_bytes(pickle.dumps(result))
            os.replace(tmp, run_dir / "result.pkl")
        return 0
    except BaseException as e:
        import traceback

        traceback.print_exc()
        try:
            (run_dir / f"error.rank{rank}.pkl").write_bytes(pickle.dumps(e))
        except Exception:
            pass
        return 1
    finally:
        sys.stdout.flush()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
