"""RL recipe (GRPO family): rollouts, learner updates and weight publishing, overlapped.

Each learner step: take `groups_per_step` trajectory groups fresh enough for the current
policy version from the feeder (orchestrate/feeder.py) -> one update (train/rl_step.py) ->
publish the new weights as version + 1. Where the groups come from:
  - `rollout.workers = 0`: played in this process, right when asked (synchronous, k = 0);
  - `rollout.workers >= 1`: worker processes (orchestrate/worker.py), each with a LocalEngine,
    reading weights through a shared-memory transport. With `max_off_policy_steps` k >= 1
    they generate the next steps while this one trains.
Held-out greedy accuracy and pass@k are measured at the start, every `eval.every` steps and
at the end; eval tasks of which some repeat a train problem (`Environment.problem_key`) are
refused before training, a set wholly made of them is warned about. Checkpoints hold the
model, optimizer, scheduler, step (= policy version), RNG, data order and the tasks drawn but
not yet trained; `resume=true` continues from the newest.
`rollouts.jsonl` records, per step, the tasks trained, their rewards and staleness.
With `train.lora` the learner trains an adapter (train/lora.py); the engines get the merged
weights at each publish, checkpoints and the final model are adapter folders.
The learner (train/learner/rl_learner.py: model, optimizer, schedule) runs in this process, or
as `train.world_size` FSDP2 ranks (`train.strategy: fsdp2`) in local processes or on Ray actors
(`rollout.ray.learner: actors`), driven from here through the same calls
(train/learner/protocol.py's Learner); rollouts, the feeder, evaluation and the logs stay here.
"""

from __future__ import annotations

import json
import time
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from flywheel.config import RLConfig
from flywheel.envs.splits import eval_overlap
from flywheel.rollout.data_order import DataOrder
from flywheel.rollout.refill import varied_rewards
from flywheel.rollout.evaluate import evaluate
from flywheel.inference.lora import adapter_base, is_adapter_folder
from flywheel.train.checkpoint import load_state
from flywheel.train.metrics import MetricsWriter, drop_rows_after
from flywheel.train.progress import StepProgress
from flywheel.errors import TrainError
from flywheel.train.run_state import start_run
from flywheel.train.stop import Deadline, interrupted, interrupted_message
from flywheel.threads import choose_threads, cpu_facts, usable_cpus
from flywheel.cpu_wait import CpuWait
from flywheel.weights.shm import recorded_segment_name

SHM_RECORD = "rollout-weights.shm"  # name of the run's shared-memory segment, for cleanup after a kill


@dataclass
class RLResult:
    output_dir: Path
    final_model: Path | None  # None when interrupted
    steps: int
    evals: list[dict] = field(default_factory=list)
    # Counted over the steps this call ran (a resumed run: only those after its checkpoint, so
    # the ledger records of a run's pieces never overlap):
    # loss tokens of every update applied (rl_step's trained_tokens: sampled tokens of the groups
    # trained, after dynamic sampling; a skipped update counts none);
    tokens_trained: int = 0
    # tokens sampled by the rollouts received (loss_mask tokens of every group delivered, those
    # dropped as too stale or uninformative included; held-out evaluations not counted);
    tokens_generated: int = 0
    # wall seconds the learner waited for rollouts (all of the generation when synchronous,
    # what training did not hide when asynchronous)
    rollout_seconds: float = 0.0
    interrupted: bool = False  # a stop request ended it early: checkpointed, no final model (train.stop)


def _eval_record(env, engine, renderer, cfg: RLConfig) -> dict[str, float]:
    """Held-out greedy accuracy, the mean of each episode metric the environment reports
    (greedy; e.g. calculator's reward/used_tool) and pass@k, as "eval/..." metrics."""
    result = evaluate(engine, env, env.tasks("test", n=cfg.eval.tasks, seed=0), max_tokens=cfg.sampling.max_tokens,
                      renderer=renderer, pass_k=cfg.eval.pass_k, sampling=_params(cfg))
    out = {"eval/greedy_accuracy": result.success, **{f"eval/{k}": v for k, v in result.metrics.items()}}
    if result.pass_at_k is not None:
        out[f"eval/pass@{cfg.eval.pass_k}"] = result.pass_at_k
    return out


def _check_held_out(env, train: list, cfg: RLConfig, log: Callable[[str], None]) -> None:
    """Refuse eval tasks of which some repeat a train problem (`Environment.problem_key`): the
    held-out figures would not be held out. Warn when all of them do: an evaluation on train
    tasks by choice (the loop's replay when no held-out traces exist)."""
    overlap = eval_overlap(train, env.tasks("test", n=cfg.eval.tasks, seed=0), env.problem_key)
    if overlap and not overlap.whole:
        raise TrainError(f"env {cfg.env.name!r}: {overlap.message()}; the held-out figures would not be held "
                         "out: give train and test tasks that share no problem")
    if overlap:
        message = (f"env {cfg.env.name!r}: every eval task is a train task ({overlap.message()}): "
                   "the eval figures measure training problems, not held-out ones")
        log(f"warning: {message}")
        warnings.warn(message, stacklevel=3)


def _params(cfg: RLConfig):
    from flywheel.inference import SamplingParams

    return SamplingParams(**_sampling(cfg))


def _sampling(cfg: RLConfig) -> dict:
    """Rollout sampling settings. Logprobs are "processed": of the distribution sampled from
    (temperature, then top-k / top-p), the behaviour policy that importance sampling corrects
    the learner's softmax(logits / temperature) against (train/rl_step.py)."""
    s = cfg.sampling
    return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k, "max_tokens": s.max_tokens,
            "logprobs_mode": "processed"}


def _workers(cfg: RLConfig) -> int:
    k, n = cfg.max_off_policy_steps, cfg.rollout.workers
    if cfg.rollout.engine == "vllm":
        from flywheel.inference.vllm_sampler import require_vllm

        require_vllm()  # before anything runs, with the install command: never mid-run
    if cfg.rollout.backend == "ray":
        if n == 0:
            raise TrainError("rollout.backend=ray plays episodes on rollout actors: set rollout.workers >= 1 "
                             "(or rollout.backend=local with rollout.workers=0 to generate in this process)")
        return 1 if n is None else n
    if n is None:
        return 1 if k > 0 else 0
    if k > 0 and n == 0:
        raise TrainError(f"max_off_policy_steps={k} overlaps rollouts with training, which needs rollout "
                         "worker processes: set rollout.workers >= 1 (or max_off_policy_steps=0)")
    return n


def _worker_threads(cfg: RLConfig, n_workers: int) -> int | None:
    """Per rollout worker process: `rollout.threads`; else 1 when asynchronous (the learner
    keeps the rest); else `threads`; else (synchronous: the learner waits while they generate)
    the CPUs this process may use shared among the workers (flywheel/threads.py)."""
    if cfg.rollout.threads:
        return cfg.rollout.threads
    if cfg.max_off_policy_steps > 0:
        return 1
    if cfg.threads or not n_workers:
        return cfg.threads
    return choose_threads(cpu_facts(measure_busy=False), processes=n_workers).threads


def _learner_threads(cfg: RLConfig, n_workers: int) -> int | None:
    """`threads`, or when asynchronous the CPUs this process may use (affinity, cgroup quota)
    that the workers leave: on a small machine a torch thread pool that shares a core with a
    busy process slows down several-fold."""
    if cfg.threads or not (n_workers and cfg.max_off_policy_steps > 0):
        return cfg.threads
    return max(1, usable_cpus() - n_workers * (_worker_threads(cfg, n_workers) or 1))


def _rollout_source(cfg: RLConfig, engine_model, tokenizer, env, renderer, n_workers: int, worker_model: str,
                    stack: ExitStack, log: Callable[[str], None]):
    """The rollout source and the engine used for evaluation. engine_model: a plain model the
    evaluation engine owns (the start folder's, loaded with the learner's weights before the
    first evaluation); worker_model: the folder workers load before the first weights arrive.
    Worker processes start here, so they start while the learner builds."""
    from flywheel.inference import LocalEngine
    from flywheel.orchestrate.pool import InProcessRollouts, ProcessRollouts, rollout_transport
    from flywheel.orchestrate.worker import WorkerSpec

    # version -1: the first evaluation loads the learner's weights (engine_model is the start
    # folder's plain model, which for an adapter start is only its base)
    engine = LocalEngine(engine_model, tokenizer, seed=cfg.train.seed, version=-1)
    if n_workers == 0:
        if cfg.rollout.in_flight_updates:
            raise TrainError("rollout.in_flight_updates needs rollout worker processes: set rollout.workers >= 1")
        return InProcessRollouts(engine, env, cfg.train.group_size, _params(cfg), renderer,
                                 threads=cfg.rollout.threads, refill_ahead=cfg.rollout.refill_ahead), engine
    out = Path(cfg.output_dir)
    transport = None  # the shared-memory segment, a reader slot per worker; not for a broadcast group
    if not (cfg.rollout.backend == "ray" and cfg.rollout.ray.weights == "broadcast"):
        transport = rollout_transport(engine_model, n_workers, name=recorded_segment_name(out / SHM_RECORD, log))
        stack.callback(transport.close)
        stack.callback(lambda: (out / SHM_RECORD).unlink(missing_ok=True))
    if cfg.rollout.in_flight_updates and cfg.max_off_policy_steps == 0:
        log("warning: rollout.in_flight_updates with max_off_policy_steps=0: no update lands while a "
            "synchronous step's rollouts decode")
    spec = WorkerSpec(model=worker_model, env_name=cfg.env.name, env_settings=cfg.env.settings,
                      transport_name=transport.name if transport else "", group_size=cfg.train.group_size, threads=_worker_threads(cfg, n_workers),
                      seed=cfg.train.seed, device=cfg.device, sampling=_sampling(cfg), engine=cfg.rollout.engine,
                      in_flight=cfg.rollout.in_flight_updates, refill_ahead=cfg.rollout.refill_ahead)
    if cfg.rollout.backend == "ray":  # actors on this node read the segment; the others, the object store
        return _ray_source(cfg, n_workers, spec, transport, stack, log), engine
    source = ProcessRollouts(spec, n_workers, cfg.rollout.max_restarts, log)
    stack.callback(source.close)
    return source, engine


def _connect_ray(cfg: RLConfig, stack: ExitStack, log: Callable[[str], None]) -> None:
    """Join or start the run's Ray cluster (rollout.backend=ray), shut down at the end if started here."""
    try:
        import ray

        from flywheel.orchestrate.ray_rollouts import connect
    except ImportError as e:
        raise TrainError(f"rollout.backend=ray needs Ray: pip install 'flywheel[ray]' ({e})") from None
    if connect(cfg.rollout.ray, log):
        stack.callback(ray.shutdown)


def _ray_source(cfg: RLConfig, n_workers: int, spec, transport, stack: ExitStack, log: Callable[[str], None]):
    """Rollout actors on a Ray cluster (orchestrate/ray_rollouts.py), each built from `spec`."""
    from flywheel.orchestrate.ray_rollouts import RayRollouts

    source = RayRollouts(spec, n_workers, cfg.rollout.ray, cfg.rollout.max_restarts, log, transport=transport)
    stack.callback(source.close)
    return source


def _write_placement(cfg: RLConfig, source, learner, log: Callable[[str], None]) -> None:
    """Where each Ray actor went, and the learner's ranks (the driver for a learner in this
    process): logged and written to placement.json."""
    from flywheel.orchestrate.ray_rollouts import where

    here = {"actor": "driver", "rank": 0, **where()}  # a learner in this process, or local ranks (fsdp2/ranks.json)
    placement = {**source.placement(), "learner": learner.placement() or [here]}
    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.output_dir) / "placement.json").write_text(json.dumps(placement, indent=1) + "\n")
    for part, actors in placement.items():
        for a in actors:
            log(f"ray: {part} actor {a['actor']} on node {a['node_id'][:12]} ({a['ip']}), {a['resources']}")


def _in_flight_tokens(groups) -> int:
    """Sampled tokens of a newer version than their trajectory's first (in-flight updates)."""
    count = 0
    for g in groups:
        for t in g.trajectories:
            sampled = [v for v, m in zip(t.versions, t.loss_mask) if m]
            count += sum(v > sampled[0] for v in sampled) if sampled else 0
    return count


def _resume(ckpt: Path, order: DataOrder, log: Callable[[str], None]) -> tuple[int, dict]:
    """(the checkpoint's step, its feeder state), its data order loaded into `order`; the
    learner restores its own state."""
    state = load_state(ckpt)
    order.load_state_dict(state["data_order"])
    log(f"resumed from {ckpt} (step {state['step']})")
    return state["step"], state.get("feeder", {})


def _log_rollouts(f, step: int, groups, staleness: list[int]) -> None:
    """rollouts.jsonl's row of a step: the tasks trained, their staleness and rewards."""
    f.write(json.dumps({"step": step, "tasks": [g.task_index for g in groups], "staleness": staleness,
                        "rewards": [[t.reward for t in g.trajectories] for g in groups]}) + "\n")
    f.flush()


def _check_skipped(in_row: int, m: dict, step: int, most: int) -> int:
    """Updates skipped in a row (a non-finite loss or gradient) after this step's metrics `m`
    (a step with no group to train does not count); TrainError at `most`."""
    in_row = in_row + 1 if m.get("skipped") and m.get("groups", 1) else 0
    if in_row >= most:
        raise TrainError(f"step {step + 1}: {in_row} updates in a row had a non-finite loss or gradient; "
                         "stopping (see metrics.jsonl)")
    return in_row


def _step_record(roll, rewards: list[float], staleness: list[int], times: tuple[float, float, float, float]) -> dict:
    """A step's rollout and timing metrics: `rewards` of every group taken (dynamic sampling's
    discards too: what the policy scored), `staleness` of those trained, `times` = (start, groups
    taken, update done, weights published) on perf_counter's clock."""
    t0, t1, t2, t3 = times
    samples = len(rewards)
    tokens = sum(sum(t.loss_mask) for g in roll.groups for t in g.trajectories)
    return {"reward_mean": sum(rewards) / samples,
            "reward_std": float(torch.tensor(rewards).std()) if samples > 1 else 0.0,
            "samples_per_s": samples / (t3 - t0), "tokens_per_s": tokens / (t3 - t0),
            "staleness_mean": sum(staleness) / max(1, len(staleness)), "time/step_s": t3 - t0,
            "rollout/in_flight_tokens": float(_in_flight_tokens(roll.groups)),
            "time/rollout_wait_s": t1 - t0, "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2,
            **{f"rollout/{k}": v for k, v in roll.work.items()},
            "rollout/discarded_groups": float(len(roll.discarded))}


def _open_logs(cfg: RLConfig, step: int, stack: ExitStack):
    """metrics.jsonl (and the sinks log.loggers lists) and rollouts.jsonl, appended from `step`
    on (a resumed run's rows past its checkpoint are dropped first); closed with the run."""
    out = Path(cfg.output_dir)
    metrics_out = MetricsWriter.for_run(out / "metrics.jsonl", cfg.log, start_step=step, config=cfg)
    stack.callback(metrics_out.close)
    drop_rows_after(out / "rollouts.jsonl", step)
    return metrics_out, stack.enter_context(open(out / "rollouts.jsonl", "a", encoding="utf-8"))


def run_rl(cfg: RLConfig, log: Callable[[str], None] = print) -> RLResult:
    with ExitStack() as stack:
        return _run(cfg, log, stack)


def _run(cfg: RLConfig, log: Callable[[str], None], stack: ExitStack) -> RLResult:
    from flywheel.envs import load_env
    from flywheel.models import ChatRenderer, load
    from flywheel.orchestrate.feeder import RolloutFeeder
    from flywheel.train.learner.start import start_learner

    n_workers = _workers(cfg)
    out = Path(cfg.output_dir)
    threads = _learner_threads(cfg, n_workers)
    ckpt = start_run(out, cfg.resume, threads, cfg.train.seed, log)
    env = load_env(cfg.env.name, **cfg.env.settings)
    tasks = env.tasks("train", seed=cfg.train.seed)
    _check_held_out(env, tasks, cfg, log)
    start = ckpt or cfg.model
    plain = adapter_base(start) if is_adapter_folder(start) else str(start)  # what engines load before weights
    engine_model, tokenizer = load(plain, dtype="float32", device=cfg.device)
    if cfg.rollout.backend == "ray":
        _connect_ray(cfg, stack, log)
    renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
    # workers start first: their start-up overlaps the learner's build and the first evaluation
    source, eval_engine = _rollout_source(cfg, engine_model, tokenizer, env, renderer, n_workers, plain, stack, log)
    # in this process, or ranks elsewhere (learner/group.py), publishing the engine model's parameters
    learner = start_learner(cfg, ckpt, log, threads, like=dict(engine_model.named_parameters()))
    stack.callback(learner.close)
    if cfg.rollout.backend == "ray":
        _write_placement(cfg, source, learner, log)
    order = DataOrder(len(tasks), cfg.train.seed)
    step, feeder_state = _resume(ckpt, order, log) if ckpt is not None else (0, {})
    feeder = RolloutFeeder(source, tasks, order, cfg.train.groups_per_step, cfg.max_off_policy_steps,
                           items_per_step=max(1, n_workers), keep=varied_rewards if cfg.algo.dynamic_sampling else None,
                           draw_limit=cfg.train.draw_limit, solved_at=cfg.train.drop_solved)
    feeder.load_state_dict(feeder_state)
    metrics_out, rollouts_log = _open_logs(cfg, step, stack)
    evals: list[dict] = []
    weights = learner.weights()
    source.publish(weights, step)

    def save() -> Path:
        return learner.save_checkpoint(step, {"data_order": order.state_dict(), "feeder": feeder.state_dict()})

    def run_eval() -> None:
        if eval_engine.version != step:
            with torch.no_grad():
                eval_engine.update_weights(weights, step)
        record = _eval_record(env, eval_engine, renderer, cfg)
        evals.append({"step": step, **record})
        metrics_out.log(step, **record)
        log(f"step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in record.items()))

    if step == 0:
        run_eval()
    # the step clock starts once every sampler can take work, as a trainer's starts after its set-up
    startup_wait_s: float | None = source.ready()
    deadline = Deadline(cfg.max_seconds)
    skipped_in_row = 0
    tokens_trained, tokens_generated, rollout_seconds = 0, 0, 0.0  # RLResult's
    cpu_wait = CpuWait()  # warns when this process's threads wait for a CPU (oversubscribed)
    with StepProgress(cfg.train.steps, start=step, enabled=cfg.log.progress, description="rl",
                      metric="reward") as progress:
        while step < cfg.train.steps and not deadline.passed():
            t0 = time.perf_counter()
            roll = feeder.take(step)
            groups = roll.groups
            t1 = time.perf_counter()
            staleness = [step - g.oldest_version for g in groups]
            # every group taken, those dynamic sampling discarded included: what the policy scored
            rewards = [t.reward for g in groups + roll.discarded for t in g.trajectories]
            m = learner.update(groups)
            lr = m.pop("lr")
            tokens_trained += int(m.get("trained_tokens", 0))
            tokens_generated += int(roll.work.get("tokens", 0))
            rollout_seconds += t1 - t0
            t2 = time.perf_counter()
            skipped_in_row = _check_skipped(skipped_in_row, m, step, cfg.max_skipped_steps)
            step += 1
            weights = learner.weights()
            source.publish(weights, step)
            if startup_wait_s is not None:  # the run's first step carries the wait before it
                m["time/startup_wait_s"], startup_wait_s = startup_wait_s, None
            record = {**m, "lr": lr, **_step_record(roll, rewards, staleness, (t0, t1, t2, time.perf_counter())),
                      **feeder.buffer.stats(), **source.stats(),
                      "rollout/regenerated_groups": float(feeder.regenerated_groups),
                      "rollout/solved_tasks": float(len(feeder.solved))}
            _log_rollouts(rollouts_log, step, groups, staleness)
            if step % cfg.log.every == 0 or step == cfg.train.steps:
                metrics_out.log(step, **record)
            progress.update(step, loss=record["reward_mean"], tokens_per_s=record["tokens_per_s"])
            cpu_wait.after_step(step)
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                run_eval()
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
                save()
    if interrupted(step, cfg.train.steps):
        log(interrupted_message(step, cfg.train.steps, save()))
        return RLResult(out, None, step, evals, tokens_trained, tokens_generated, rollout_seconds, interrupted=True)
    run_eval()
    save()
    final = out / "final"
    learner.save_final(final)
    return RLResult(out, final, step, evals, tokens_trained, tokens_generated, rollout_seconds)


__all__ = ["RLResult", "run_rl"]
