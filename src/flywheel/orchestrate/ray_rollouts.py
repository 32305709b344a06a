"""RayRollouts: the rollout source of `rollout.backend: ray`, the same run across a Ray cluster.

It speaks the protocol of orchestrate/pool.py (submit, poll, publish, in_flight, stats, close),
so the feeder, the staleness bound, truncated importance sampling, per-token versions and
exact resume (orchestrate/feeder.py, train/rl.py) keep their meaning unchanged. The parts:

- `RolloutActor` (one per `rollout.workers`): a worker's EpisodeRunner (orchestrate/worker.py:
  engine, environment, policy) in an actor placed by `rollout.ray.worker_cpus`,
  `worker_gpus` and `worker_resources`. For each work item it asks the `WeightBoard` for the
  newest weights of at least `item.min_version` (waiting for them if need be), loads them if
  they are newer than its own, and plays the item.
- Weights, once per version, two ways. Rollout actors on the learner's node read the run's
  shared-memory segment (weights/shm.py), as worker processes do: a reader slot each, the
  engine bound to the leased buffer without a copy (dense kernels) or reordered straight from
  it (packed ones). For actors elsewhere `publish` also puts the weights into Ray's object
  store, as numpy arrays, behind the `WeightBoard` (one, async: the newest (version, object
  ref)); such an actor fetches a version over the network once and copies it into its engine.
  The object-store copy is made only while some actor runs on another node. With
  `rollout.in_flight_updates`, every actor takes newer weights between decode steps: those on
  the learner's node from the segment, as worker processes do, the others from the board
  (`BoardWeights`: one request for a newer version kept pending, checked without waiting).
- `EnvActor` (`rollout.ray.env_actors` of them, placed by `env_resources`, e.g. on CPU
  nodes labelled `env_cpu`): the environment's episodes live there; a rollout actor plays
  against them through `RemoteEnvironment`, one actor call per episode step. With 0 env
  actors each rollout actor runs its environment itself.

Failures: a rollout actor that dies (its node lost, a crash, `ray.kill`) is replaced by a new
one and its unfinished items are sent again; results are keyed by item id, so none counts
twice; more than `rollout.max_restarts` deaths stop the run. A dead env actor fails the items
that were using it (their rollout actor reports the error); those are sent again in the same
way, to a replaced env actor. `where()` tells where each part runs; `placement()` collects it.

The learner is not this module's: it runs in the driver, or on its own actors
(train/learner/ray_actors.py); the driver publishes its weights here either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import threading
import time
import warnings
from typing import Any, Callable, Mapping

import numpy as np
import ray
import torch

from flywheel.config import RayConfig
from flywheel.envs import load_env
from flywheel.envs.base import Env, EnvGroupBuilder, Environment, StepResult
from flywheel.orchestrate.pool import RolloutError
from flywheel.orchestrate.worker import (EpisodeRunner, SegmentWeights, WorkerSpec, WorkItem, WorkResult,
                                        reuse_freed_memory)
from flywheel.weights import SharedMemoryTransport
from flywheel.types import Task


def connect(cfg: RayConfig, log: Callable[[str], None] = print) -> bool:
    """Join the cluster at `cfg.address`, or start a local one when it is None. True when this
    call started Ray (and so should shut it down)."""
    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = {"namespace": cfg.namespace, "log_to_driver": True}
    if cfg.address is None:
        kwargs["include_dashboard"] = False
    ray.init(address=cfg.address, **kwargs)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    log(f"ray: {len(nodes)} node(s), resources {ray.cluster_resources()}")
    return True


def where() -> dict[str, Any]:
    """This process's place in the cluster."""
    ctx = ray.get_runtime_context()
    resources = ctx.get_assigned_resources() if ctx.get_actor_id() is not None else {}  # the driver holds none
    return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid(),
            "resources": resources}


# ---------------------------------------------------------------- weights


@ray.remote(num_cpus=0)
class WeightBoard:
    """The newest published weights: (version, [object ref]) (the ref boxed in a list so Ray
    passes it on instead of fetching it)."""

    def __init__(self):
        self.version, self.box = -1, [None]
        self.changed = asyncio.Condition()

    async def set(self, version: int, box: list) -> None:
        async with self.changed:
            if version > self.version:
                self.version, self.box = version, box
            self.changed.notify_all()

    async def newest(self, min_version: int) -> tuple[int, list]:
        async with self.changed:
            await self.changed.wait_for(lambda: self.version >= min_version)
            return self.version, self.box


def to_arrays(params: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray | torch.Tensor]:
    """What goes into the object store: numpy arrays (mapped without a copy by readers on the
    same node), tensors of dtypes numpy lacks (bfloat16) as they are."""
    out: dict[str, np.ndarray | torch.Tensor] = {}
    for name, t in params.items():
        t = t.detach()
        out[name] = t.cpu() if t.dtype == torch.bfloat16 else t.cpu().numpy()
    return out


def from_arrays(arrays: Mapping[str, np.ndarray | torch.Tensor]) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # read-only views of the object store: the engine copies them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}


# ---------------------------------------------------------------- environments on their own actors


@ray.remote
class EnvActor:
    """Episodes of one environment, played step by step for rollout actors elsewhere."""

    def __init__(self, env_name: str, env_settings: dict):
        self.env = load_env(env_name, **env_settings)
        self.episodes: dict[int, Env] = {}
        self.ids = itertools.count()

    def where(self) -> dict[str, Any]:
        return where()

    async def open_group(self, task: Task, n: int) -> list[tuple[int, Any, list[dict] | None]]:
        """The group's n episodes: (episode id, initial observation, tools) each."""
        out = []
        for env in await self.env.group_builder(task, n).make_envs():
            eid = next(self.ids)
            self.episodes[eid] = env
            out.append((eid, await env.initial_observation(), env.tools))
        return out

    async def step(self, eid: int, action: str) -> StepResult:
        env = self.episodes.get(eid)
        if env is None:
            raise KeyError(f"episode {eid} is not open on this environment actor (it restarted?)")
        result = await env.step(action)
        if result.done:
            del self.episodes[eid]
        return result

    async def group_rewards(self, task: Task, rewards: list[float], transcripts: list) -> list[float]:
        return await self.env.group_builder(task, len(rewards)).group_rewards(rewards, transcripts)

    def open_episodes(self) -> int:
        return len(self.episodes)


class _RemoteEnv(Env):
    def __init__(self, actor, eid: int, task: Task, observation, tools):
        self.actor, self.eid, self.task, self._obs, self.tools = actor, eid, task, observation, tools

    async def initial_observation(self):
        return self._obs

    async def step(self, action: str) -> StepResult:
        return await self.actor.step.remote(self.eid, action)


class _RemoteGroupBuilder(EnvGroupBuilder):
    def __init__(self, actor, task: Task, n: int):
        super().__init__(lambda t: None, task, n)
        self.actor = actor

    async def make_envs(self) -> list[Env]:
        opened = await self.actor.open_group.remote(self.task, self.n)
        return [_RemoteEnv(self.actor, eid, self.task, obs, tools) for eid, obs, tools in opened]

    async def group_rewards(self, rewards, transcripts) -> list[float]:
        return await self.actor.group_rewards.remote(self.task, list(rewards), list(transcripts))


class RemoteEnvironment(Environment):
    """An environment whose episodes run on env actors: the groups of a rollout actor are
    spread over them by task id."""

    def __init__(self, actors: list, name: str):
        self.actors, self.name = actors, name

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        raise NotImplementedError("a RemoteEnvironment plays episodes; tasks come from the learner")

    def make_env(self, task: Task) -> Env:
        raise NotImplementedError("a RemoteEnvironment opens episodes in groups (group_builder)")

    def group_builder(self, task: Task, n: int) -> EnvGroupBuilder:
        return _RemoteGroupBuilder(self.actors[hash(task.id) % len(self.actors)], task, n)


# ---------------------------------------------------------------- rollout actors


class BoardWeights:
    """An actor's weights from the object store, behind the WeightBoard (actors off the
    learner's node). `take(min_version)` before an item waits for that version and loads the
    newest; with `in_flight`, the engine also takes a newer version between decode steps: one
    request for a version newer than its own is kept pending on the board and checked without
    waiting, so a decode step costs no round trip."""

    def __init__(self, board, engine, in_flight: bool = False):
        self.board, self.engine = board, engine
        self._pending = None  # board.newest(engine.version + 1), not yet answered
        if in_flight:
            engine.between_steps = self.take_if_published

    def take(self, min_version: int) -> tuple[float, float]:
        """(seconds waiting for min_version, seconds loading the newest)."""
        t0 = time.perf_counter()
        answer = ray.get(self.board.newest.remote(min_version))
        t1 = time.perf_counter()
        self._load(*answer)
        return t1 - t0, time.perf_counter() - t1

    def take_if_published(self) -> None:
        if self._pending is None:
            self._pending = self.board.newest.remote(self.engine.version + 1)
        ready, _ = ray.wait([self._pending], timeout=0)
        if ready:
            answer, self._pending = ray.get(self._pending), None
            self._load(*answer)

    def _load(self, version: int, box: list) -> None:
        if version > self.engine.version:
            with torch.no_grad():
                self.engine.update_weights(from_arrays(ray.get(box[0])), version)


class GroupWeights:
    """An actor's weights from the run's broadcast group (weights/broadcast.py;
    `rollout.ray.weights: broadcast`): joined, and joined again after the group is re-formed,
    from a concurrency group of its own while `run` may be waiting for weights."""

    def __init__(self, engine, in_flight: bool = False):
        self.engine = engine
        self.transport = None
        self._joined = threading.Condition()
        if in_flight:
            engine.between_steps = self.take_newest

    def join(self, host: str, port: int, rank: int, world_size: int, specs: list, backend: str) -> None:
        from flywheel.weights.broadcast import BroadcastTransport

        if hasattr(self.engine, "join_broadcast"):  # vLLM: its worker joins, on its own GPU
            fresh = self.engine.join_broadcast(host, port, rank, world_size, specs, backend)
        else:
            like = {n: torch.empty(shape, dtype=getattr(torch, d), device="meta") for n, d, shape in specs}
            device = str(self.engine.device) if backend == "nccl" else "cpu"
            fresh = BroadcastTransport.receiver(like, host, port, rank, world_size, backend, device)
        with self._joined:
            old, self.transport = self.transport, fresh
            self._joined.notify_all()
        if old is not None:
            old.close()

    def take(self, min_version: int) -> tuple[float, float]:
        """(seconds waiting for min_version, seconds loading the newest). Raises (failing the
        item) when the group broke before that version came: the driver then forms it again
        and sends the item again."""
        t0 = time.perf_counter()
        with self._joined:
            self._joined.wait_for(lambda: self.transport is not None)
            transport = self.transport
        while transport.version() < min_version:
            if transport.error is not None and transport is self.transport:
                raise RuntimeError(f"{GROUP_BROKE}: {transport.error}")
            try:
                transport.wait_newer(transport.version(), timeout_s=1.0)
            except (TimeoutError, RuntimeError):
                pass
            transport = self.transport  # re-formed meanwhile, perhaps
        t1 = time.perf_counter()
        self.take_newest()
        return t1 - t0, time.perf_counter() - t1

    def take_newest(self) -> None:
        transport = self.transport
        if transport is not None:
            self.engine.receive(transport)


@ray.remote(concurrency_groups={"weights": 1, "info": 1})  # neither waits behind `run`
class RolloutActor:
    def __init__(self, spec: WorkerSpec, worker_id: int, board, env_actors: list, env_name: str,
                 learner_node: str, broadcast: bool = False):
        reuse_freed_memory()  # as a worker process: packed pickups reuse the heap, no fresh pages
        env = RemoteEnvironment(env_actors, env_name) if env_actors else None
        self.runner = EpisodeRunner(spec, worker_id, env=env)
        self.segment = None  # the learner's shared-memory segment, read by actors on its node
        self.board = None  # else the object store's copy
        self.group = None  # or the run's broadcast group
        if broadcast:
            self.group = GroupWeights(self.runner.engine, spec.in_flight)
        elif spec.transport_name and ray.get_runtime_context().get_node_id() == learner_node:
            self.segment = SegmentWeights(spec.transport_name, self.runner.engine, spec.in_flight)
        else:
            self.board = BoardWeights(board, self.runner.engine, spec.in_flight)

    @ray.method(concurrency_group="info")
    def where(self) -> dict[str, Any]:
        how = "broadcast" if self.group else "shared_memory" if self.segment is not None else "object_store"
        return {**where(), "weights": how}

    @ray.method(concurrency_group="weights")
    def join_weights(self, host: str, port: int, rank: int, world_size: int, specs: list, backend: str) -> None:
        self.group.join(host, port, rank, world_size, specs, backend)

    def run(self, item: WorkItem) -> WorkResult:
        t0 = time.perf_counter()
        if self.group is not None:
            try:
                waited = self.group.take(item.min_version)
            except RuntimeError as e:  # the group broke: the driver forms it again and resends
                return WorkResult(item.item_id, self.runner.worker_id, [], self.runner.engine.version, 0.0, 0.0, 0.0,
                                  error=str(e))
            return self.runner.play(item, *waited, "broadcast")
        if self.segment is not None:
            self.segment.wait(item.min_version)
            t1 = time.perf_counter()
            self.segment.take_newest()
            return self.runner.play(item, t1 - t0, time.perf_counter() - t1, self.segment.pickup)
        return self.runner.play(item, *self.board.take(item.min_version), "object_store")


class RayRollouts:
    """`n_workers` rollout actors (and `cfg.env_actors` environment actors) on the connected
    cluster, fed by load; dead actors replaced, their items sent again."""

    def __init__(self, spec: WorkerSpec, n_workers: int, cfg: RayConfig, max_restarts: int = 3,
                 log: Callable[[str], None] = print, transport: SharedMemoryTransport | None = None):
        """transport: the run's shared-memory segment (named in spec.transport_name), which
        actors on this node read; None: every actor reads the object store."""
        if n_workers < 1:
            raise ValueError(f"RayRollouts needs at least one rollout actor, got {n_workers}")
        self.spec, self.cfg, self.max_restarts, self.log = spec, cfg, max_restarts, log
        self.transport = transport
        if transport is None:
            self.spec = dataclasses.replace(spec, transport_name="")
        self.node = ray.get_runtime_context().get_node_id()  # the learner's
        self.board = WeightBoard.remote()
        self._remote: dict[int, bool] = {}  # actor slot -> it reads the object store
        self._weights_ref = None  # the newest version's object, kept alive while it is the newest
        # (params, version) last published, for an actor that starts reading the object store
        # late (a replacement on another node); the learner's params do not change between a
        # publish and its next update, which comes after the poll that replaces actors
        self._last = None
        self.broadcast = cfg.weights == "broadcast"
        self.group = None  # the broadcast group's publisher end, formed at the first publish
        self.env_actors = [self._env_actor() for _ in range(cfg.env_actors)]
        self.actors = [self._actor(i) for i in range(n_workers)]
        self._reads_object_store(list(range(n_workers)))
        self._pending: dict[Any, tuple[int, WorkItem]] = {}  # result ref -> (actor index, item)
        self._answered: set[int] = set()
        self.restarts = self.env_restarts = self.resubmitted_items = self.duplicate_results = 0

    def _env_actor(self):
        return EnvActor.options(num_cpus=self.cfg.env_cpus, resources=self.cfg.env_resources or None).remote(
            self.spec.env_name, self.spec.env_settings)

    def _actor(self, worker_id: int):
        actor = RolloutActor.options(
            num_cpus=self.cfg.worker_cpus, num_gpus=self.cfg.worker_gpus,
            resources=self.cfg.worker_resources or None).remote(
            self.spec, worker_id, self.board, self.env_actors, self.spec.env_name, self.node, self.broadcast)
        return actor

    def _reads_object_store(self, indices: list[int]) -> None:
        """Ask the actors in these slots how they read weights (waits for them to start)."""
        places = ray.get([self.actors[i].where.remote() for i in indices])
        for i, place in zip(indices, places):
            self._remote[i] = place["weights"] == "object_store"

    def placement(self) -> dict[str, Any]:
        """Where each actor runs: {"rollout": [...], "env": [...]}, each where() plus its index."""
        rollout = ray.get([a.where.remote() for a in self.actors])
        env = ray.get([a.where.remote() for a in self.env_actors])
        return {"rollout": [{"actor": i, **w} for i, w in enumerate(rollout)],
                "env": [{"actor": i, **w} for i, w in enumerate(env)]}

    # ------------------------------------------------------------------ protocol

    def submit(self, item: WorkItem) -> None:
        load = [0] * len(self.actors)
        for index, _ in self._pending.values():
            load[index] += 1
        self._send(min(range(len(self.actors)), key=load.__getitem__), item)

    def _send(self, index: int, item: WorkItem) -> None:
        self._pending[self.actors[index].run.remote(item)] = (index, item)

    def in_flight(self) -> int:
        return len(self._pending)

    def ready(self) -> float:
        return 0.0  # construction waited for every actor (_reads_object_store)

    def publish(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        """Into the shared-memory segment, and, while some actor runs on another node, one copy
        into the object store; the board is told without waiting for it (an actor that asks
        first waits on the board for the version its item needs). With `weights: broadcast`:
        over the group instead (formed at the first publish; a publish that fails on a broken
        group replaces the dead actors and forms it again)."""
        if self.broadcast:
            self._last = (params, version)
            try:
                if self.group is None:
                    self._form_group()
                self.group.publish(params, version)
            except RuntimeError as e:  # torch.distributed's errors: a member is gone
                self.log(f"weight group broken ({type(e).__name__}: {e}); forming it again")
                self._recover(regroup=False)
                self._regroup()
            return
        if self.transport is not None:
            self.transport.publish(params, version)
        self._last = (params, version)
        if self.transport is None or any(self._remote.values()):
            self._put(params, version)

    def _put(self, params: Mapping[str, torch.Tensor], version: int) -> None:
        self._weights_ref = ray.put(to_arrays(params))
        self.board.set.remote(version, [self._weights_ref])

    def poll(self, timeout_s: float = 0.0) -> list[WorkResult]:
        if not self._pending:
            if timeout_s:
                time.sleep(min(timeout_s, 0.01))
            return []
        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
        out: list[WorkResult] = []
        for ref in ready:
            if ref not in self._pending:
                continue  # sent again by a recovery below, in this same poll
            index, item = self._pending.pop(ref)
            try:
                result: WorkResult = ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError):
                self._recover()
                self._resend(index, item)
                continue
            if result.error is not None:
                if self.broadcast and GROUP_BROKE in result.error:
                    self.log(f"rollout actor {index}: {result.error}; forming the weight group again")
                    self._recover(regroup=False)
                    self._regroup()
                    self._resend(index, item)
                    continue
                if self.env_actors and any(w in result.error for w in _ENV_LOST):
                    self._recover()
                    self._resend(index, item)
                    continue
                raise RolloutError(f"rollout actor {index}, item {item.item_id}: {result.error}")
            if result.item_id in self._answered:
                self.duplicate_results += 1
                continue
            self._answered.add(result.item_id)
            out.append(result)
        return out

    def _form_group(self) -> None:
        """The broadcast group of this process (rank 0) and every rollout actor (rank 1 + slot),
        its layout that of the last params published; NCCL when those are on a GPU and the
        actors have GPUs, else gloo."""
        from flywheel.weights.broadcast import BroadcastTransport

        if self.group is not None:
            self.group.close()
            self.group = None
        params, _ = self._last
        cuda = next(iter(params.values())).device.type == "cuda"
        backend = "nccl" if cuda and self.cfg.worker_gpus > 0 else "gloo"
        specs = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in params.items()]
        store = BroadcastTransport.host(ray.util.get_node_ip_address())
        world = 1 + len(self.actors)
        joins = [a.join_weights.remote(store.host, store.port, 1 + i, world, specs, backend)
                 for i, a in enumerate(self.actors)]
        self.group = BroadcastTransport.publisher(params, store, world, backend,
                                                  "cuda" if backend == "nccl" else "cpu")
        ray.get(joins)

    def _recover(self, regroup: bool = True) -> None:
        """Replace every actor that does not answer: a dead rollout actor's unfinished items go
        to its replacement; when an env actor is replaced, the rollout actors (which hold the
        env actors' handles) are renewed too, their unfinished items sent again. With a
        broadcast group, one that lost a member is formed again (unless `regroup` is false:
        the caller does) and the last weights sent over it."""
        dead_env = [i for i, a in enumerate(self.env_actors) if not _alive(a)]
        for i in dead_env:
            self._count_restart(f"environment actor {i} died", env=True)
            self.env_actors[i] = self._env_actor()
        renewed = False
        for index, actor in enumerate(self.actors):
            if not _alive(actor):
                self._count_restart(f"rollout actor {index} died")
                self._renew(index)
                renewed = True
            elif dead_env:
                self._renew(index)
                renewed = True
        if self.broadcast and renewed and regroup:
            self._regroup()

    def _regroup(self) -> None:
        """Form the broadcast group again and send it the last weights published."""
        if self._last is not None:
            self._form_group()
            self.group.publish(*self._last)

    def _resend(self, index: int, item: WorkItem) -> None:
        self.resubmitted_items += 1
        self._send(index, item)

    def _renew(self, index: int) -> None:
        """A fresh actor in slot `index`; the old one's unfinished items go to it."""
        old = self.actors[index]
        board_used = self.transport is None or any(self._remote.values())
        self.actors[index] = self._actor(index)
        self._reads_object_store([index])
        if self._remote[index] and not board_used and self._last is not None:
            self._put(*self._last)  # the board had nothing: this actor is the first on another node
        ray.kill(old, no_restart=True)
        for ref, (i, item) in list(self._pending.items()):
            if i == index:
                del self._pending[ref]
                self._resend(index, item)

    def _count_restart(self, what: str, env: bool = False) -> None:
        if env:
            self.env_restarts += 1
        else:
            self.restarts += 1
        if self.restarts + self.env_restarts > self.max_restarts:
            raise RolloutError(f"{what}; that is {self.restarts + self.env_restarts} actor deaths, more than "
                               f"rollout.max_restarts={self.max_restarts}")
        self.log(f"{what}: replacing it and sending its unfinished items again")

    def stats(self) -> dict[str, float]:
        return {"rollout/worker_restarts": float(self.restarts), "rollout/env_restarts": float(self.env_restarts),
                "rollout/resubmitted_items": float(self.resubmitted_items),
                "rollout/duplicate_results": float(self.duplicate_results)}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
        for actor in [*self.actors, *self.env_actors, self.board]:
            ray.kill(actor, no_restart=True)
        self._pending.clear()
        self._weights_ref = None


GROUP_BROKE = "the weight group broke"  # an item's error when its actor's broadcast group failed
_ENV_LOST = ("ActorDied", "RayActorError", "not open on this")  # an item's error when its env actor went


def _alive(actor, timeout_s: float = 30.0) -> bool:
    try:
        ray.get(actor.where.remote(), timeout=timeout_s)
        return True
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False
