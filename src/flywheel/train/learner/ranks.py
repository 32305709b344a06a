"""The FSDP2 learner strategy (`train.strategy: fsdp2`): one learner sharded over
`train.world_size` torch.distributed processes on this machine (NCCL on GPUs, gloo on CPU).
This module is what runs inside a rank (`Rank`); rank_processes.py starts them, fsdp2_rl.py
holds the RL update across them, and train/sft.py runs its loop on them.

What is sharded. Each rank loads the same model folder, then `fully_shard` (torch FSDP2)
wraps every decoder layer and then the root, so each rank keeps 1/world of every parameter,
gradient and AdamW moment (DTensors sharded on dim 0); a layer's full weights exist only
during its forward / backward (all-gather), and gradients are reduce-scattered.

Checkpoints are the single-process learner's, byte-format for byte-format: every rank joins
`get_model_state_dict` / `get_optimizer_state_dict` (full_state_dict, cpu_offload), and rank 0
writes the usual HF folder + trainer_state.pt (train/checkpoint.py); the optimizer state is
converted from DCP's parameter names to the index keys `optimizer.state_dict()` uses, so a
single-process run resumes an FSDP2 checkpoint and the other way round. trainer_state.pt
also carries `rank_rng` (each rank's RNG state). Resume: every rank loads the checkpoint's
model folder, shards it, and `set_optimizer_state_dict` shards the saved moments.

Limits: ranks started here are local processes (on several machines they are Ray actors,
train/learner/ray_actors.py), no LoRA, no evaluator callables (validation loss via data.val works).
`kill -USR1` of a rank prints its stacks into its log.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from flywheel.errors import TrainError
from flywheel.train.checkpoint import load_state, rng_state, save_checkpoint, save_model_folder, set_rng_state
from flywheel.train.stop import request_stop, stop_requested


@dataclasses.dataclass
class Rank:
    """This process's place in the FSDP2 learner; the collectives a recipe needs around it."""

    rank: int
    world_size: int
    device: str  # "cpu" or "cuda:N"
    # this rank's connection to whoever started it (RankProcesses(channels=True)), else None
    channel: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model, seed: int):
        """Shard `model` (each decoder layer, then the root) with gradients reduced as a SUM;
        then seed this rank's random streams (dropout) as seed + rank, after the model and any
        adapter init drew theirs identically on every rank."""
        from torch.distributed.fsdp import FSDPModule, fully_shard

        from flywheel.train.lora import is_peft

        if is_peft(model):
            raise TrainError("train.strategy=fsdp2 does not train LoRA adapters (train.lora); "
                             "use train.strategy=single")
        from torch.distributed.device_mesh import init_device_mesh

        # the mesh names the device: fully_shard's default mesh is CUDA wherever CUDA exists
        mesh = init_device_mesh("cuda" if self.device.startswith("cuda") else "cpu", (self.world_size,))
        for layer in _decoder_layers(model):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(1.0)  # the loss is already normalised globally
                m.set_force_sum_reduction_for_comms(True)  # gloo: SUM only
        torch.manual_seed(seed + self.rank)
        return model

    def share(self, items: list) -> list:
        """This rank's contiguous share of `items` (near-equal: sizes differ by at most one)."""
        size, extra = divmod(len(items), self.world_size)
        start = self.rank * size + min(self.rank, extra)
        return items[start:start + size + (1 if self.rank < extra else 0)]

    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return t.tolist()

    def agree_stop(self, deadline) -> bool:
        """Whether to stop now, the same answer on every rank: a stop requested of any rank
        (made this rank's too, so `interrupted()` agrees) or a deadline passed on any."""
        t = torch.tensor([float(stop_requested()), float(deadline.passed())], device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t[0] > 0 and not stop_requested():
            request_stop()
        return bool(t.max() > 0)

    def grad_sync(self, model, on: bool) -> None:
        """Reduce-scatter gradients after this backward (on) or accumulate them unsharded (off:
        every micro-batch but a step's last)."""
        model.set_requires_gradient_sync(on)

    def full_model_state(self, model) -> dict:
        """The full state dict on CPU on rank 0 ({} elsewhere); every rank must call it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def full_optimizer_state(self, model, optimizer) -> dict:
        """`optimizer.state_dict()` as a single-process optimizer over the same parameters
        would return it (index keys), full tensors on CPU, on rank 0 ({} elsewhere)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return {}
        index = {name: i for i, name in enumerate(_param_names(model, optimizer))}
        return {"state": {index[name]: v for name, v in osd["state"].items()},
                "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]}

    def load_optimizer_state(self, model, optimizer, state: dict) -> None:
        """Shard a full index-keyed optimizer state (a checkpoint's) into this rank's optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = _param_names(model, optimizer)
        osd = {"state": {names[i]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))

    def save_checkpoint(self, root: Path, step: int, model, optimizer, tokenizer, state: dict, keep: int) -> Path:
        """train/checkpoint.py's save_checkpoint, from a sharded learner: every rank joins the
        gathers, rank 0 writes. `state` is trainer_state(...); its optimizer entry is replaced
        by the full one and `rank_rng` added."""
        full = self.full_model_state(model)
        state = {**state, "optimizer": self.full_optimizer_state(model, optimizer)}
        rngs = [None] * self.world_size
        dist.all_gather_object(rngs, rng_state())
        state["rank_rng"] = rngs
        dest = Path(root) / "checkpoints" / f"step_{step:08d}"
        if self.is_main:
            dest = save_checkpoint(root, step, _Gathered(model, full), tokenizer, state, keep=keep)
        dist.barrier()  # no rank runs ahead of a checkpoint that is not yet on disk
        return dest

    def save_model_folder(self, model, tokenizer, dest: Path) -> None:
        full = self.full_model_state(model)
        if self.is_main:
            save_model_folder(_Gathered(model, full), tokenizer, dest)
        dist.barrier()

    def restore(self, ckpt: Path, model, optimizer, scheduler, order, log: Callable[[str], None]) -> int:
        """run_state.restore_trainer_state for a sharded learner (the weights were loaded from
        the checkpoint's folder before sharding); each rank takes back its own RNG state when
        the checkpoint has one for it (an FSDP2 run of the same world size)."""
        state = load_state(ckpt)
        self.load_optimizer_state(model, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if order is not None:  # None: the caller keeps the data order (rl_learner.py)
            order.load_state_dict(state["data_order"])
        rngs = state.get("rank_rng") or []
        set_rng_state(rngs[self.rank] if len(rngs) == self.world_size else state["rng"])
        log(f"resumed from {ckpt} (step {state['step']})")
        return state["step"]

    def _comm_device(self) -> str:
        return self.device if self.device.startswith("cuda") else "cpu"


class _Gathered:
    """A sharded model seen through its gathered full state dict: what save_checkpoint and
    save_model_folder call (`save_pretrained`) writes the full weights."""

    def __init__(self, model, state_dict: dict):
        self.model, self.state_dict = model, state_dict

    def save_pretrained(self, path, **kw):
        return self.model.save_pretrained(path, state_dict=self.state_dict, **kw)


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks (what transformers names `_no_split_modules`), in order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise TrainError(f"train.strategy=fsdp2: cannot find the decoder layers of {type(model).__name__} "
                         f"(its _no_split_modules is {sorted(names) or 'empty'})")
    return layers


def _param_names(model, optimizer) -> list[str]:
    """The parameter name of each optimizer index (param groups in order, as state_dict counts)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]
