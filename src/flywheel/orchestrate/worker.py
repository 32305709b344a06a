"""A rollout worker: its own process, its own LocalEngine, episodes on request.

The learner sends `WorkItem`s over a pipe; for each the worker
  1. waits until the weight transport holds a version >= `item.min_version` (the staleness
     bound: the learner never asks for samples older than it can train on),
  2. loads the newest published weights if they are newer than its own,
  3. plays `group_size` episodes per task (rollout/play.py) and sends back a
     `WorkResult` with the trajectory groups (every sampled token tagged with its version).
A `None` item, or the learner's end of the pipe closing, ends the worker. One pipe per
worker: a worker killed mid-send can only corrupt its own pipe, which the pool discards.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from flywheel.envs import load_env
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import ChatRenderer, load
from flywheel.models.loading import quiet_transformers
from flywheel.rollout.play import EpisodeLoop, SamplerPolicy, play
from flywheel.types import Task, TrajectoryGroup
from flywheel.weights import SharedMemoryTransport


STARTUP_FAILED = -1  # WorkResult.item_id of a worker that could not start


@dataclass
class WorkerSpec:
    """Everything a worker process needs to build its engine and environment (picklable)."""

    model: str  # HF folder the worker loads first (weights are then replaced from the transport)
    env_name: str
    env_settings: dict
    transport_name: str  # shared-memory segment of the learner's SharedMemoryTransport
    sampling: dict  # SamplingParams fields
    group_size: int
    threads: int | None = None
    seed: int = 0
    device: str = "cpu"


@dataclass
class WorkItem:
    item_id: int
    tasks: list[Task]
    min_version: int


@dataclass
class WorkResult:
    item_id: int
    worker_id: int
    groups: list[TrajectoryGroup]
    version: int  # the weights that sampled every token of these groups
    generate_s: float  # episodes, tool calls included
    weight_wait_s: float  # waiting for `min_version` to be published
    weight_load_s: float  # copying the newest weights in
    tokens: int = 0
    error: str | None = None  # set when the episodes raised; groups is then empty


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the learner dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def worker_main(worker_id: int, conn) -> None:
    """Serve work items on `conn` (the first message is the WorkerSpec) until told to stop."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent or parent == 1:
        return
    try:
        spec: WorkerSpec = conn.recv()
        if spec.threads:
            torch.set_num_threads(spec.threads)
        quiet_transformers()
        env = load_env(spec.env_name, **spec.env_settings)
        model, tokenizer = load(spec.model, device=spec.device)
        engine = LocalEngine(model, tokenizer, version=-1, seed=spec.seed * 1009 + worker_id)
        renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
        transport = SharedMemoryTransport.attach(spec.transport_name)
        params = SamplingParams(**spec.sampling)
        policy = SamplerPolicy(engine, params, renderer)
        loop = EpisodeLoop()
    except Exception:  # noqa: BLE001 - a start-up failure is not worth restarting for
        conn.send(WorkResult(STARTUP_FAILED, worker_id, [], -1, 0.0, 0.0, 0.0, error=traceback.format_exc()))
        conn.close()
        return
    try:
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                return  # the learner is gone
            if item is None:
                return
            t0 = time.perf_counter()
            while transport.version() < item.min_version:
                if os.getppid() != parent:
                    return
                try:
                    transport.wait_newer(transport.version(), timeout_s=1.0)
                except TimeoutError:
                    pass
            t1 = time.perf_counter()
            engine.receive(transport)
            t2 = time.perf_counter()
            version = engine.version
            try:
                groups = loop.run(play(env, item.tasks, policy, group_size=spec.group_size))
                error = None
            except Exception as e:  # noqa: BLE001 - reported to the learner, which decides
                groups, error = [], f"{type(e).__name__}: {e}"
            t3 = time.perf_counter()
            tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
            conn.send(WorkResult(item.item_id, worker_id, groups, version, t3 - t2, t1 - t0, t2 - t1,
                                 tokens, error))
    finally:
        loop.close()
        transport.close()
        conn.close()


def main() -> None:
    """Entry of a worker process: `python -c "...; main()" WORKER_ID SOCKET_FD` (see pool.py)."""
    worker_main(int(sys.argv[1]), Connection(int(sys.argv[2])))
