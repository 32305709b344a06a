"""The FSDP2 learner strategy (`train.strategy: fsdp2`): one learner sharded over
`train.world_size` torch.distributed processes on this machine (NCCL on GPUs, gloo on CPU).

What is sharded. Each rank loads the same model folder, then `fully_shard` (torch FSDP2)
wraps every decoder layer and then the root, so each rank keeps 1/world of every parameter,
gradient and AdamW moment (DTensors sharded on dim 0); a layer's full weights exist only
during its forward / backward (all-gather), and gradients are reduce-scattered.

The batch. Every rank builds the same global batch (same data order, same groups), takes its
contiguous share (`Rank.share`) and scales its loss so that the reduce-scatter, run as a plain
SUM (`set_gradient_divide_factor(1.0)` + `set_force_sum_reduction_for_comms`: gloo has no
AVG / PREMUL_SUM), yields the gradient of the single-process loss on the whole batch:
- SFT: the loss is nll_sum / (trained tokens of the *whole* step), a normaliser every rank
  counts from the global batch, so no reduction is needed (train/sft.py);
- RL (`rl_step_fsdp2`): a minibatch's trajectories are split across ranks (partial groups;
  advantages are assigned on whole groups first, on every rank alike); rl_step's `update`
  normalises by the rank's own tokens (aggregation "token") or rows ("sequence",
  "constant"), so the gradient reaching the logits is multiplied by local / global of that
  normaliser. A rank left without a trajectory runs one with weight 0 (FSDP's collectives
  need every rank in every forward and backward).
The update then equals the single-process update up to float summation order, which AdamW
can turn into steps of up to lr on parameters whose gradient is noise-level
(tests/integration/test_fsdp2.py holds the bounds). The device mesh is given explicitly ("cpu" or "cuda"):
fully_shard's default mesh is CUDA wherever CUDA exists.

Checkpoints are the single-process learner's, byte-format for byte-format: every rank joins
`get_model_state_dict` / `get_optimizer_state_dict` (full_state_dict, cpu_offload), and rank 0
writes the usual HF folder + trainer_state.pt (train/checkpoint.py); the optimizer state is
converted from DCP's parameter names to the index keys `optimizer.state_dict()` uses, so a
single-process run resumes an FSDP2 checkpoint and the other way round. trainer_state.pt
also carries `rank_rng` (each rank's RNG state). Resume: every rank loads the checkpoint's
model folder, shards it, and `set_optimizer_state_dict` shards the saved moments.

Processes. `launch` (in the calling process) hosts the rendezvous store (a TCPStore on
127.0.0.1, port chosen by the OS: no race for a free port), starts `world_size` fresh
interpreters (`python -m flywheel.train.fsdp2 JOB`), writes their pids to
OUTPUT/fsdp2/ranks.json and each rank's output to OUTPUT/fsdp2/rank{r}.log, and relays
rank 0's log lines. If any rank dies (a SIGKILL, an exception), the launcher SIGKILLs the
others and raises: the rank's own exception when it raised one, else TrainError naming the
rank and signal. Since checkpoints are renamed into place whole, `resume: true` then
continues from the newest complete one exactly as after a single-process kill. Ranks die
with the launcher (PR_SET_PDEATHSIG on Linux). A stop requested of the launcher (SIGTERM /
request_stop) is forwarded as SIGTERM; ranks agree on stopping once per step (all-reduce of
the stop and deadline flags), so all stop after the same step and checkpoint together.

RL: run_rl drives `train.world_size` ranks of train/learner.py's RLLearner through
train/learner_group.py (`RankProcesses(channels=True)`: a socket per rank to the driver), each
updating with `rl_step_fsdp2`; `run_rl_updates` runs the update alone on given groups.

Limits: ranks started here are local processes (on several machines they are Ray actors,
train/ray_learner.py), no LoRA, no evaluator callables (validation loss via data.val works).
`kill -USR1` of a rank prints its stacks into its log.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
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
from flywheel.train.checkpoint import load_state, rng_state, save_checkpoint, save_model_folder, set_rng_state
from flywheel.train.stop import request_stop, stop_requested

_ENV_RANK, _ENV_WORLD, _ENV_PORT = "FLYWHEEL_FSDP2_RANK", "FLYWHEEL_FSDP2_WORLD", "FLYWHEEL_FSDP2_PORT"
_ENV_CHANNEL = "FLYWHEEL_FSDP2_CHANNEL"  # a rank's end of its connection to the launcher (RankProcesses)
_HOST = "127.0.0.1"


# ---------------------------------------------------------------------------------- in a rank


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
        if order is not None:  # None: the caller keeps the data order (train/learner.py)
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


# ---------------------------------------------------------------------------------- RL update


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


@contextlib.contextmanager
def _scaled_logit_gradients(model, scale: float):
    """Multiply every gradient that reaches `model`'s output logits by `scale` (so every
    parameter gradient: the loss depends on the parameters only through the logits)."""
    if scale == 1.0:
        yield
        return

    def hook(module, args, output):
        output.logits = _ScaleGrad.apply(output.logits, scale)
        return output

    handle = model.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def rl_share(groups: list, rank: Rank, aggregation: str) -> tuple[list, float]:
    """(this rank's partial groups, its gradient scale) for one RL update on `groups`
    (advantages assigned): the update's trajectories split contiguously across ranks, and
    local / global of the normaliser `aggregation` divides by (loss tokens or rows)."""
    trajs = [(gi, t, a) for gi, g in enumerate(groups) for t, a in zip(g.trajectories, g.advantages)]
    mine = rank.share(trajs)
    empty = not mine
    if empty:  # fewer trajectories than ranks: run one with weight 0
        mine = trajs[:1]
    parts: dict[int, Any] = {}
    for gi, t, a in mine:
        if gi not in parts:
            parts[gi] = dataclasses.replace(groups[gi], trajectories=[], advantages=[])
        parts[gi].trajectories.append(t)
        parts[gi].advantages.append(a)
    if empty:
        return list(parts.values()), 0.0
    if aggregation == "token":
        def count(rows):
            return sum(sum(t.loss_mask[1:]) for _, t, _ in rows)
        local, total = max(1, count(mine)), max(1, count(trajs))
    else:  # "sequence" and "constant" divide by rows
        local, total = len(mine), len(trajs)
    return list(parts.values()), local / total


def rl_step_fsdp2(model, optimizer, groups: list, cfg, pad_id: int, rank: Rank, ref_model=None,
                  ref_context=contextlib.nullcontext) -> dict[str, float]:
    """train/rl_step.rl_step on a sharded learner: every rank passes the same `groups`; each
    runs rl_step's `update` on its share of every minibatch with its gradient scale
    (`rl_share`), and the reduce-scatter sums the shares into the single-process gradient.
    Metrics: loss summed over ranks (the global loss), trained_tokens summed, the other
    means weighted by each rank's tokens; grad_norm is already global. Plans of one model
    call only (RLStepConfig.one_forward); a non-finite loss on any rank skips the update on all."""
    from flywheel.train.rl_step import assign_advantages, merge_minibatches, proximal_logprobs, split_groups, update

    groups = assign_advantages(groups, cfg.advantage, cfg.dynamic_sampling)
    if not groups:
        return {"skipped": 1.0, "groups": 0.0}
    # one model call per update on every rank (plain or prefix-tree plans): the KV-cache prefix
    # plan makes one or two from each rank's rows, and ranks whose module calls differ wait on
    # each other's all-gathers and reduce-scatters forever
    cfg = dataclasses.replace(cfg, one_forward=True)
    parts = []
    shares = [rl_share(chunk, rank, cfg.aggregation) for chunk in split_groups(groups, cfg.minibatches)]
    # every rank makes the same calls: a proximal pass per later minibatch (rl_step.rl_step's rule)
    proximal = [None] + [proximal_logprobs(model, mine, cfg, pad_id, ref_model) for mine, _ in shares[1:]]
    for (mine, scale), before in zip(shares, proximal):
        with _scaled_logit_gradients(model, scale):
            m = update(model, optimizer, mine, cfg, pad_id, ref_model, ref_context,
                       all_finite=lambda finite: rank.sum([float(not finite)])[0] == 0, proximal_N=before)
        parts.append(_global_metrics(m, scale, rank))
    return merge_minibatches(groups, parts)


def _global_metrics(m: dict, scale: float, rank: Rank) -> dict:
    if m.get("skipped"):
        return m
    n = m["trained_tokens"] if scale else 0.0
    keys = sorted(k for k in m if k not in ("loss", "trained_tokens", "grad_norm", "skipped", "shared_prefix"))
    sums = rank.sum([m["loss"] * scale, n] + [m[k] * n for k in keys])
    out = dict(m, loss=sums[0], trained_tokens=sums[1])
    out.update({k: v / max(sums[1], 1.0) for k, v in zip(keys, sums[2:])})
    return out


# ---------------------------------------------------------------------------------- launcher


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
                    [sys.executable, "-m", "flywheel.train.fsdp2", str(job)], env=env, pass_fds=fds,
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


# ---------------------------------------------------------------------------------- recipes


def launch_sft(cfg, log: Callable[[str], None] = print):
    """run_sft under FSDP2: every rank runs run_sft's loop on its share of each batch."""
    tc = cfg.train
    if tc.batch_size % tc.world_size:
        raise TrainError(f"train.batch_size ({tc.batch_size}) must be a multiple of train.world_size "
                         f"({tc.world_size}) under train.strategy=fsdp2: each rank takes an equal share")
    if tc.lora is not None:
        raise TrainError("train.strategy=fsdp2 does not train LoRA adapters (train.lora); use train.strategy=single")
    if cfg.eval.evaluator:
        raise TrainError(f"train.strategy=fsdp2 does not run eval.evaluator ({cfg.eval.evaluator!r}); validate "
                         "with data.val / data.val_fraction, or evaluate the checkpoints")
    device = "cuda" if cfg.device.startswith("cuda") else cfg.device
    return launch("flywheel.train.fsdp2:_sft_rank", cfg.model_dump(mode="json"), tc.world_size, device,
                  cfg.output_dir, log, threads=cfg.threads)


def _sft_rank(cfg_json: dict, rank: Rank):
    from flywheel.config import SFTConfig
    from flywheel.train.sft import run_sft

    cfg = SFTConfig.model_validate(cfg_json)
    cfg = cfg.model_copy(update={"device": rank.device, "log": cfg.log.model_copy(update={"progress": False})})
    return run_sft(cfg, log=lambda m: print(m, flush=True), dist=rank)


def run_rl_updates(model: str | Path, batches: list[list], step_cfg, out_dir: str | Path, lr: float,
                   world_size: int = 1, device: str = "cpu", weight_decay: float = 0.0,
                   log: Callable[[str], None] = print) -> tuple[Path, list[dict]]:
    """Offline RL updates: `rl_step` on each list of trajectory groups in `batches`, from the
    model folder `model` with AdamW(lr), under FSDP2 on `world_size` ranks (world_size 1: in
    this process, unsharded). Writes the trained model to out_dir/final; returns (that
    folder, each step's metrics)."""
    payload = {"model": str(model), "batches": batches, "step_cfg": step_cfg, "out": str(out_dir), "lr": lr,
               "weight_decay": weight_decay}
    if world_size == 1:
        return _rl_updates(payload, None)
    return launch("flywheel.train.fsdp2:_rl_updates", payload, world_size, device, out_dir, log)


def _rl_updates(payload: dict, rank: Rank | None):
    from flywheel.models import load
    from flywheel.train.rl_step import rl_step

    model, tokenizer = load(payload["model"], dtype="float32", device=rank.device if rank else "cpu")
    if rank is not None:
        model = rank.wrap(model, seed=0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=payload["lr"],
                            weight_decay=payload["weight_decay"])
    history = []
    for groups in payload["batches"]:
        groups = [dataclasses.replace(g, advantages=[]) for g in groups]
        if rank is None:
            history.append(rl_step(model, opt, groups, payload["step_cfg"], tokenizer.pad_token_id))
        else:
            history.append(rl_step_fsdp2(model, opt, groups, payload["step_cfg"], tokenizer.pad_token_id, rank))
    final = Path(payload["out"]) / "final"
    if rank is None:
        save_model_folder(model, tokenizer, final)
    else:
        rank.save_model_folder(model, tokenizer, final)
    return final, history


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1]))
