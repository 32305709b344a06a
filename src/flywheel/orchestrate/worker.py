"""A rollout worker: its own process, its own LocalEngine, episodes on request.

The learner sends `WorkItem`s over a pipe; for each the worker
  1. waits until the weight transport holds a version >= `item.min_version` (the staleness
     bound: the learner never asks for samples older than it can train on),
  2. loads the newest published weights if they are newer than its own: zero-copy through a
     reader slot it claims at start (its engine runs on the leased shared buffer, packed
     kernels are reordered straight from it), or by a copy where it has none (a segment
     without free slots, a GPU engine),
  3. plays `group_size` episodes per task (rollout/play.py) and sends back a
     `WorkResult` with the trajectory groups (every sampled token tagged with its version).
The worker's first message is a `WorkerReady` (or, when it cannot start, a STARTUP_FAILED
result), so the learner can start its clock once every worker can take work.
A `None` item, or the learner's end of the pipe closing, ends the worker. One pipe per
worker: a worker killed mid-send can only corrupt its own pipe, which the pool discards.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from flywheel.envs import load_env
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import ChatRenderer, load
from flywheel.models.loading import quiet_transformers
from flywheel.process import cycle_collector_paused, die_with_parent
from flywheel.rollout.play import EpisodeLoop, SamplerPolicy, play
from flywheel.rollout.refill import Keep, Refiller
from flywheel.types import Task, TrajectoryGroup
from flywheel.weights import SharedMemoryTransport


STARTUP_FAILED = -1  # WorkResult.item_id of a worker that could not start


@dataclass
class WorkerReady:
    """A worker process's first message once its engine, environment and weight reader are
    built (a start-up failure sends a STARTUP_FAILED WorkResult instead)."""

    worker_id: int
    build_s: float  # building them, after the interpreter's imports


@dataclass
class WorkerSpec:
    """Everything a worker process needs to build its engine and environment (picklable)."""

    model: str  # HF folder the worker loads first (weights are then replaced from the transport)
    env_name: str
    env_settings: dict
    transport_name: str  # shared-memory segment of the learner's SharedMemoryTransport ("" on Ray)
    sampling: dict  # SamplingParams fields
    group_size: int
    threads: int | None = None
    seed: int = 0
    device: str = "cpu"
    packed: bool | None = None  # the lean decoder's kernel set (None: it picks by size, decoder.py)
    engine: str = "local"  # "local" (LocalEngine) or "vllm" (inference/vllm_sampler.py, on a Ray actor's GPU)
    in_flight: bool = False  # take newer weights between decode steps, not only between items
    refill_ahead: bool = True  # rollout.refill_ahead (rollout/refill.py Refiller)


@dataclass
class WorkItem:
    item_id: int
    tasks: list[Task]
    min_version: int
    # dynamic sampling's refill (rollout/refill.py): spares played in place of the groups `keep`
    # rejects; the result's groups answer (tasks + spares)[:len(groups)]
    spares: list[Task] = field(default_factory=list)
    keep: Keep | None = None


@dataclass
class WorkResult:
    item_id: int
    worker_id: int
    groups: list[TrajectoryGroup]
    version: int  # the weights that sampled every token of these groups
    generate_s: float  # episodes, tool calls included
    weight_wait_s: float  # waiting for `min_version` to be published
    weight_load_s: float  # picking the newest weights up (nothing when they were not newer)
    tokens: int = 0
    error: str | None = None  # set when the episodes raised; groups is then empty
    weight_pickup: str = ""  # "bind" (zero-copy, a leased reader slot) or "copy" (read_into)
    # of the weight loads since the worker's previous result (the pickup before this item and
    # in-flight ones during the previous), seconds spent rebuilding the engine's kernels
    kernel_rebuild_s: float = 0.0


def reuse_freed_memory() -> None:
    """glibc: serve large allocations from the heap and keep freed memory there. By default
    each block over 32 MB is mapped fresh and unmapped when freed, so every weight pickup
    with packed kernels (the old packed weights go, new ones of the same sizes come) paid a
    page fault per 4 KB of the new copies: about a third of its time at ~100M parameters
    (docs/benchmarks.md, "Measurements behind choices in the code")."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(-3, 1 << 30)  # M_MMAP_THRESHOLD: only blocks over 1 GiB get their own mapping
        libc.mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD (an int): keep the top of the heap
    except (OSError, AttributeError):
        pass


class EpisodeRunner:
    """A rollout worker's engine, environment and policy, whatever carries its work items (a
    worker process here, a Ray actor in orchestrate/ray_rollouts.py). `env`: the environment
    to play (default: the spec's, loaded here)."""

    def __init__(self, spec: WorkerSpec, worker_id: int, env=None):
        if spec.threads:
            torch.set_num_threads(spec.threads)
        quiet_transformers()
        self.spec, self.worker_id = spec, worker_id
        self.env = env if env is not None else load_env(spec.env_name, **spec.env_settings)
        if spec.engine == "vllm":
            from transformers import AutoTokenizer

            from flywheel.inference.vllm_sampler import VLLMSampler

            tokenizer = AutoTokenizer.from_pretrained(spec.model)
            self.engine = VLLMSampler(spec.model, version=-1, logprobs_mode=spec.sampling.get("logprobs_mode", "raw"),
                                      seed=spec.seed * 1009 + worker_id)
        else:
            model, tokenizer = load(spec.model, device=spec.device)
            self.engine = LocalEngine(model, tokenizer, version=-1, seed=spec.seed * 1009 + worker_id,
                                      packed=spec.packed)
        renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
        self.policy = SamplerPolicy(self.engine, SamplingParams(**spec.sampling), renderer)
        self.loop = EpisodeLoop()
        self.refiller = Refiller(self._play_groups, spec.refill_ahead)
        self._rebuild_seen = 0.0  # engine.kernel_rebuild_s at the previous result

    def play(self, item: WorkItem, weight_wait_s: float, weight_load_s: float, pickup: str) -> WorkResult:
        """Play `item` on the engine's current weights; an environment error is reported in
        the result, not raised (the learner decides)."""
        t0 = time.perf_counter()
        version = self.engine.version
        try:
            groups = self.loop.run(self.refiller.play(item.tasks, item.spares, item.keep))
            error = None
        except Exception as e:  # noqa: BLE001 - reported to the learner, which decides
            groups, error = [], f"{type(e).__name__}: {e}"
        tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
        rebuilt = getattr(self.engine, "kernel_rebuild_s", 0.0)
        rebuild_s, self._rebuild_seen = rebuilt - self._rebuild_seen, rebuilt
        return WorkResult(item.item_id, self.worker_id, groups, version, time.perf_counter() - t0, weight_wait_s,
                          weight_load_s, tokens, error, pickup, rebuild_s)

    def _play_groups(self, tasks: list[Task]):
        return play(self.env, tasks, self.policy, group_size=self.spec.group_size)

    def close(self) -> None:
        self.loop.close()


class SegmentWeights:
    """A rollout worker's weights from the learner's shared-memory segment (a worker process,
    or a Ray actor on the learner's node): a reader slot claimed for zero-copy pickup where
    one is free; with `in_flight`, the engine takes newer weights between decode steps too."""

    def __init__(self, transport_name: str, engine, in_flight: bool = False):
        self.engine = engine
        self.transport = SharedMemoryTransport.attach(transport_name)
        self.reader = _claim_reader(self.transport, engine)
        self.pickup = "bind" if self.reader else "copy"  # WorkResult.weight_pickup
        if in_flight:
            engine.between_steps = self.take_newest

    def wait(self, min_version: int, keep_waiting=lambda: True) -> bool:
        """Until the segment holds a version >= min_version; False if keep_waiting() turned false."""
        while self.transport.version() < min_version:
            if not keep_waiting():
                return False
            try:
                self.transport.wait_newer(self.transport.version(), timeout_s=1.0)
            except TimeoutError:
                pass
        return True

    def take_newest(self) -> None:
        """The newest weights, if newer than the engine's (LocalEngine.receive checks)."""
        self.engine.receive(self.reader or self.transport)

    def close(self) -> None:
        self.transport.close()  # frees the reader slot and its lease (a killed worker's are reclaimed)


def worker_main(worker_id: int, conn) -> None:
    """Serve work items on `conn` (the first message is the WorkerSpec) until told to stop."""
    t0 = time.perf_counter()
    parent = os.getppid()
    die_with_parent()
    reuse_freed_memory()
    if os.getppid() != parent or parent == 1:
        return
    try:
        spec: WorkerSpec = conn.recv()
        runner = EpisodeRunner(spec, worker_id)
        weights = SegmentWeights(spec.transport_name, runner.engine, spec.in_flight)
    except Exception:  # noqa: BLE001 - a start-up failure is not worth restarting for
        conn.send(WorkResult(STARTUP_FAILED, worker_id, [], -1, 0.0, 0.0, 0.0, error=traceback.format_exc()))
        conn.close()
        return
    conn.send(WorkerReady(worker_id, time.perf_counter() - t0))
    try:
        while True:
            try:
                item = conn.recv()
            except (EOFError, OSError):
                return  # the learner is gone
            if item is None:
                return
            t0 = time.perf_counter()
            if not weights.wait(item.min_version, lambda: os.getppid() == parent):
                return
            t1 = time.perf_counter()
            weights.take_newest()
            t2 = time.perf_counter()
            with cycle_collector_paused():  # pickling the result, too, makes containers by the trajectory
                conn.send(runner.play(item, t1 - t0, t2 - t1, weights.pickup))
    finally:
        runner.close()
        weights.close()
        conn.close()


def _claim_reader(transport: SharedMemoryTransport, engine: LocalEngine):
    """A free reader slot for zero-copy pickup, or None (copy) when the segment has none free
    or the engine is not in host memory. Slots of dead workers are reclaimed by the claim."""
    if engine.device.type != "cpu" or transport.n_slots == 0:
        return None
    try:
        return transport.reader()
    except RuntimeError as e:  # every slot held by a live process
        print(f"rollout worker: {e}; copying weights instead", file=sys.stderr)
        return None


def main() -> None:
    """Entry of a worker process: `python -c "...; main()" WORKER_ID SOCKET_FD` (see pool.py)."""
    worker_main(int(sys.argv[1]), Connection(int(sys.argv[2])))
