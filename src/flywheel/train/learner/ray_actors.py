"""The learner on Ray actors (`rollout.backend: ray`, `rollout.ray.learner: actors`).

One `LearnerActor` per rank (train.world_size under train.strategy=fsdp2, else one), placed by
`rollout.ray.learner_cpus`, `learner_gpus` and `learner_resources`, so the learner runs on the
cluster's GPU (or chosen) nodes while run_rl's driver keeps rollouts, feeder and evaluation.
The ranks join one torch.distributed group (NCCL with GPUs, gloo without) through a TCPStore
that rank 0's actor hosts on its node. Each of run_rl's calls goes to every actor (its
arguments put into the object store once) and rank 0's answer comes back; weights travel as
numpy arrays (orchestrate/ray_rollouts.py's to_arrays), mapped without a copy on the
driver's node.

Checkpoints and the final model are written by rank 0's actor into `output_dir` on its node:
on a cluster of several machines that path must be storage the driver's node shares (NFS, a
mounted bucket), as the driver reads checkpoints back on resume.

Failure: a learner actor is not restarted (max_restarts 0): a rank that dies or raises stops
every rank, and the call raises (TrainError naming the rank, or the rank's own exception);
`resume: true` continues from the newest checkpoint, as for local ranks (group.py).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import ray
import torch

from flywheel.config import RLConfig
from flywheel.errors import TrainError
from flywheel.orchestrate.ray_rollouts import from_arrays, to_arrays, where
from flywheel.train.learner.group import LearnerGroup

_STORE_TIMEOUT = timedelta(seconds=300)


@ray.remote(max_restarts=0)
class LearnerActor:
    """One rank of the learner: rl_learner.py's RLLearner in a Ray actor."""

    def __init__(self, rank: int, world_size: int, threads: int):
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.store, self.learner = None, None

    def open_store(self) -> tuple[str, int]:
        """Rank 0: host the group's rendezvous store on this node; its (ip, port)."""
        import torch.distributed as dist

        ip = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(ip, 0, self.world_size, is_master=True, wait_for_workers=False,
                                   timeout=_STORE_TIMEOUT)
        return ip, self.store.port

    def start(self, cfg_json: dict, ckpt: str | None, host: str, port: int) -> None:
        import torch.distributed as dist

        from flywheel.train.learner.ranks import Rank
        from flywheel.train.learner.rl_learner import RLLearner
        from flywheel.train.run_state import seed_everything

        cfg = RLConfig.model_validate(cfg_json)
        if cfg.device.startswith("cuda"):  # Ray shows each actor its own GPU(s), from cuda:0
            cfg = cfg.model_copy(update={"device": "cuda:0"})
        seed_everything(cfg.train.seed)
        rank = None
        if cfg.train.strategy == "fsdp2":
            cuda = cfg.device.startswith("cuda")
            store = self.store or dist.TCPStore(host, port, is_master=False, timeout=_STORE_TIMEOUT)
            dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=self.rank,
                                    world_size=self.world_size)
            rank = Rank(self.rank, self.world_size, "cuda:0" if cuda else "cpu")  # Ray shows each actor its GPU
        log = (lambda m: print(m, flush=True)) if self.rank == 0 else (lambda m: None)
        self.learner = RLLearner(cfg, None if ckpt is None else Path(ckpt), rank, log)

    def call(self, name: str, args: tuple) -> Any:
        value = getattr(self.learner, name)(*args)
        return to_arrays(value) if name == "weights" and value else value

    def where(self) -> dict:
        return {"actor": f"rank {self.rank}", "rank": self.rank, **where()}


class RayLearner(LearnerGroup):
    """run_rl's learner as Ray actors (see the module doc)."""

    def __init__(self, cfg: RLConfig, ckpt: Path | None, log: Callable[[str], None] = print):
        rc = cfg.rollout.ray
        if cfg.device.startswith("cuda") and not rc.learner_gpus:
            raise TrainError(f"device={cfg.device} with rollout.ray.learner=actors: give each learner actor a GPU "
                             "(rollout.ray.learner_gpus=1)")
        self.world_size = cfg.train.world_size if cfg.train.strategy == "fsdp2" else 1
        if cfg.device.startswith("cuda") and cfg.train.strategy == "fsdp2" and rc.learner_gpus < 1:
            raise TrainError(f"rollout.ray.learner_gpus={rc.learner_gpus}: FSDP2's NCCL ranks need a whole GPU each "
                             "(learner_gpus >= 1)")
        threads = cfg.threads or max(1, int(rc.learner_cpus))
        options = {"num_cpus": rc.learner_cpus, "num_gpus": rc.learner_gpus, "resources": dict(rc.learner_resources)}
        self.actors = [LearnerActor.options(**options).remote(r, self.world_size, threads)
                       for r in range(self.world_size)]
        self._closed = False
        try:
            host, port = self._get([self.actors[0].open_store.remote()])[0]
            self._get([a.start.remote(cfg.model_dump(mode="json"), None if ckpt is None else str(ckpt), host, port)
                       for a in self.actors])
        except BaseException:
            self.close()
            raise
        log(f"ray: learner of {self.world_size} actor(s) started ({options})")

    def placement(self) -> list[dict]:
        """Where each rank's actor runs: [{"actor", "rank", "node_id", "ip", "pid", "resources"}]."""
        return self._get([a.where.remote() for a in self.actors])

    def _call_all(self, name: str, *args) -> list:
        shared = ray.put(args)  # once, not once per rank
        answers = self._get([a.call.remote(name, shared) for a in self.actors])
        if name == "weights":
            answers[0] = from_arrays(answers[0])
        return answers

    def _get(self, refs: list) -> list:
        """Every answer, in order; the first failure stops every rank and raises."""
        index = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayActorError as e:
                self.close()
                raise TrainError(f"learner rank {index[done[0]]} (a Ray actor) died: {e}; every rank was stopped. "
                                 "resume=true continues from the newest complete checkpoint") from None
            except ray.exceptions.RayTaskError as e:
                self.close()
                raise e.as_instanceof_cause() from None
        return ray.get(refs)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for a in self.actors:
            ray.kill(a)


__all__ = ["LearnerActor", "RayLearner"]
