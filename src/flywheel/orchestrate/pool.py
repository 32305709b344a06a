"""Rollout sources on this machine: where the learner's trajectory groups come from.

Both satisfy source.py's RolloutSource, what the feeder (feeder.py) asks of a source.
`InProcessRollouts` plays episodes in the learner's process when polled (synchronous
training, `rollout.workers = 0`). `ProcessRollouts` runs worker processes
(orchestrate/worker.py) that overlap with the learner; weights reach them through a
shared-memory transport (`rollout_transport`: a zero-copy reader slot per worker). A worker
that dies is restarted and its unfinished items are sent again, so no task is lost; results
are keyed by item id, so none is counted twice.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Callable, Mapping

import torch

from flywheel.errors import TrainError
from flywheel.inference.decoder import fusion_groups, unsupported_reason
from flywheel.orchestrate.worker import STARTUP_FAILED, WorkerReady, WorkerSpec, WorkItem, WorkResult
from flywheel.process import cycle_collector_paused
from flywheel.rollout.play import EpisodeLoop, SamplerPolicy, play
from flywheel.rollout.refill import Refiller
from flywheel.types import Task
from flywheel.weights import SharedMemoryTransport


def rollout_transport(model, workers: int, name: str | None = None) -> SharedMemoryTransport:
    """The weight segment of a run with `workers` rollout processes: one reader slot each, so
    every worker picks weights up zero-copy (orchestrate/worker.py), workers + 2 buffers, so the
    learner never waits for a lease, and each group the lean decoder fuses (q/k/v, gate/up)
    laid out back to back, so its dense kernels run on the shared buffer as it is."""
    groups = fusion_groups(model) if unsupported_reason(model) is None else []
    return SharedMemoryTransport.create(dict(model.named_parameters()), name=name, readers=workers,
                                        adjacent=groups)


class RolloutError(TrainError):
    """Rollouts cannot continue (a worker keeps crashing, or an environment raised)."""


class InProcessRollouts:
    """Generation in the learner's process (synchronous RL). `threads`: torch threads while
    generating (then restored): small-batch decoding is bound by op dispatch, so fewer threads
    than the learner's can be faster (bench/async.py measures it)."""

    def __init__(self, engine, env, group_size: int, params, renderer, threads: int | None = None,
                 refill_ahead: bool = True):
        self.engine, self.env, self.group_size = engine, env, group_size
        self.params, self.renderer, self.threads = params, renderer, threads
        self._queue: deque[WorkItem] = deque()
        self._loop = EpisodeLoop()
        self._refiller = Refiller(self._play_groups, refill_ahead)

    def submit(self, item: WorkItem) -> None:
        self._queue.append(item)

    def in_flight(self) -> int:
        return len(self._queue)

    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        with torch.no_grad():
            self.engine.update_weights(params, version)

    def ready(self) -> float:
        return 0.0  # the engine is built with the source

    def poll(self, timeout_s: float = 0.0) -> list[WorkResult]:
        if not self._queue:
            return []
        item = self._queue.popleft()
        if self.engine.version < item.min_version:
            raise RolloutError(f"item {item.item_id} needs weights >= v{item.min_version}, "
                               f"the engine has v{self.engine.version}: publish first")
        t0 = time.perf_counter()
        learner_threads = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            groups = self._loop.run(self._refiller.play(item.tasks, item.spares, item.keep))
        finally:
            torch.set_num_threads(learner_threads)
        tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
        return [WorkResult(item.item_id, 0, groups, self.engine.version, time.perf_counter() - t0, 0.0, 0.0,
                           tokens)]

    def _play_groups(self, tasks: list[Task]):
        return play(self.env, tasks, SamplerPolicy(self.engine, self.params, self.renderer), group_size=self.group_size)

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        self._loop.close()


class _Worker:
    def __init__(self, worker_id: int, process: subprocess.Popen, conn: Connection):
        self.worker_id, self.process, self.conn = worker_id, process, conn
        self.items: dict[int, WorkItem] = {}  # sent, not yet answered
        self.spawned_at = time.perf_counter()
        self.ready_after_s: float | None = None  # spawn -> its WorkerReady arrived

    def alive(self) -> bool:
        return self.process.poll() is None


class ProcessRollouts:
    """`n_workers` rollout processes fed round-robin by load; restarts crashed ones."""

    def __init__(self, spec: WorkerSpec, n_workers: int, max_restarts: int = 3,
                 log: Callable[[str], None] = print):
        if n_workers < 1:
            raise ValueError(f"ProcessRollouts needs at least one worker, got {n_workers}")
        self.spec, self.max_restarts, self.log = spec, max_restarts, log
        self.transport = SharedMemoryTransport.attach(spec.transport_name)
        self.workers: list[_Worker] = [self._spawn(i) for i in range(n_workers)]
        self.restarts = 0
        self.resubmitted_items = 0
        self.duplicate_results = 0
        self._answered: set[int] = set()

    def _spawn(self, worker_id: int) -> _Worker:
        """A fresh interpreter running orchestrate/worker.py, talking over a socket pair.
        (Not multiprocessing's spawn: that re-imports the caller's __main__, which breaks
        scripts without an `if __name__ == "__main__"` guard.)"""
        here, there = socket.socketpair()
        proc = subprocess.Popen([sys.executable, "-c", "from flywheel.orchestrate.worker import main; main()",
                                 str(worker_id), str(there.fileno())], pass_fds=[there.fileno()])
        there.close()
        conn = Connection(here.detach())
        conn.send(self.spec)
        return _Worker(worker_id, proc, conn)

    # ------------------------------------------------------------------ protocol

    def submit(self, item: WorkItem) -> None:
        worker = min(self.workers, key=lambda w: len(w.items))
        self._send(worker, item)

    def _send(self, worker: _Worker, item: WorkItem) -> None:
        worker.items[item.item_id] = item
        try:
            worker.conn.send(item)
        except (BrokenPipeError, OSError):
            pass  # the worker died; the next poll restarts it and sends its items again

    def in_flight(self) -> int:
        return sum(len(w.items) for w in self.workers)

    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        self.transport.publish(params, version)

    def ready(self) -> float:
        """Block until every worker has started (its first message, WorkerReady, arrived);
        seconds waited. Workers start at construction, so whatever the caller did since
        (building its learner, a first evaluation) overlaps their start-up. A worker that
        died starting is restarted (rollout.max_restarts); one that failed raises."""
        t0 = time.perf_counter()
        while waiting := [w for w in self.workers if w.ready_after_s is None]:
            ready = wait([w.conn for w in waiting], timeout=1.0)
            for worker in waiting:
                if worker.conn in ready:
                    try:
                        self._receive(worker, worker.conn.recv())
                    except (EOFError, OSError):
                        self._restart(worker)
                elif not worker.alive():
                    self._restart(worker)
        return time.perf_counter() - t0

    def _receive(self, worker: _Worker, message: WorkResult | WorkerReady) -> WorkResult | None:
        """A message from `worker`: its WorkerReady is recorded, a start-up failure or an
        item's error raised, a result returned (None for a duplicate)."""
        if isinstance(message, WorkerReady):
            worker.ready_after_s = time.perf_counter() - worker.spawned_at
            return None
        if message.item_id == STARTUP_FAILED:
            raise RolloutError(f"rollout worker {worker.worker_id} failed to start:\n{message.error}")
        if message.error is not None:
            raise RolloutError(f"rollout worker {worker.worker_id}, item {message.item_id}: {message.error}")
        worker.items.pop(message.item_id, None)
        if message.item_id in self._answered:
            self.duplicate_results += 1
            return None
        self._answered.add(message.item_id)
        return message

    def poll(self, timeout_s: float = 0.0) -> list[WorkResult]:
        out: list[WorkResult] = []
        ready = wait([w.conn for w in self.workers], timeout=timeout_s)
        for worker in list(self.workers):
            if worker.conn not in ready:
                continue
            try:
                while worker.conn.poll():
                    with cycle_collector_paused():  # unpickling makes every trajectory's lists
                        result = self._receive(worker, worker.conn.recv())
                    if result is not None:
                        out.append(result)
            except (EOFError, OSError):
                self._restart(worker)
        for worker in list(self.workers):
            if not worker.alive():
                self._restart(worker)
        return out

    def _restart(self, worker: _Worker) -> None:
        if worker not in self.workers:
            return
        try:
            code = worker.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            worker.process.kill()
            code = worker.process.wait()
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise RolloutError(f"rollout worker {worker.worker_id} exited with code {code}; that is "
                               f"{self.restarts} crashes, more than rollout.max_restarts={self.max_restarts} "
                               "(its traceback, if any, is printed above)")
        pending = sorted(worker.items.values(), key=lambda it: it.item_id)
        self.log(f"rollout worker {worker.worker_id} exited with code {code}: restarting it and "
                 f"regenerating its {len(pending)} unfinished item(s)")
        worker.conn.close()
        fresh = self._spawn(worker.worker_id)
        self.workers[self.workers.index(worker)] = fresh
        for item in pending:
            self.resubmitted_items += 1
            self._send(fresh, item)

    def startup_s(self) -> list[float]:
        """Each started worker's seconds from spawn to ready (restarted ones: their latest)."""
        return [w.ready_after_s for w in self.workers if w.ready_after_s is not None]

    def stats(self) -> dict[str, float]:
        return {"rollout/worker_restarts": float(self.restarts),
                "rollout/resubmitted_items": float(self.resubmitted_items),
                "rollout/duplicate_results": float(self.duplicate_results)}

    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self.workers:
            try:
                w.process.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait()
            w.conn.close()
        self.transport.close()

