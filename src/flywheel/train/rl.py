"""RL recipe (GRPO family), synchronous and in one process for now.

Each step: take `groups_per_step` training tasks -> play `group_size` episodes on each with
the LocalEngine (token in, token out; rollout/episodes.py) -> one learner update
(train/rl_step.py) -> copy the new weights into the engine (version + 1). Held-out greedy
accuracy and pass@k are measured at the start, every `eval.every` steps and at the end.
Checkpoints hold the model, optimizer, step (= policy version), RNG and data cursor;
`resume=true` continues from the newest.

Not yet here (issue 4 continues): rollout workers in their own processes overlapping with
the learner (`max_off_policy_steps` > 0), the shared-memory weight transport between them.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from flywheel.config import RLConfig
from flywheel.train.batching import DataOrder
from flywheel.train.checkpoint import save_checkpoint, save_model_folder
from flywheel.train.metrics import MetricsWriter
from flywheel.train.progress import StepProgress
from flywheel.train.rl_step import RLStepConfig, rl_step
from flywheel.train.run_state import TrainError, restore_trainer_state, start_run, trainer_state
from flywheel.train.schedule import warmup_cosine


@dataclass
class RLResult:
    output_dir: Path
    final_model: Path
    steps: int
    evals: list[dict] = field(default_factory=list)


def evaluate(env, engine, renderer, cfg: RLConfig) -> dict[str, float]:
    """Greedy accuracy (reward == 1) and pass@k on the held-out split."""
    from flywheel.inference import SamplingParams
    from flywheel.rollout.episodes import play_groups

    tasks = env.tasks("test", n=cfg.eval.tasks, seed=0)
    greedy = asyncio.run(play_groups(env, tasks, 1, engine, SamplingParams(
        temperature=0.0, max_tokens=cfg.sampling.max_tokens), renderer))
    out = {"eval/greedy_accuracy": sum(g.trajectories[0].reward >= 1.0 for g in greedy) / len(tasks)}
    if cfg.eval.pass_k > 1:
        k = cfg.eval.pass_k
        sampled = asyncio.run(play_groups(env, tasks, k, engine, _params(cfg), renderer))
        out[f"eval/pass@{k}"] = sum(any(t.reward >= 1.0 for t in g.trajectories) for g in sampled) / len(tasks)
    return out


def _params(cfg: RLConfig):
    from flywheel.inference import SamplingParams

    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens)


def run_rl(cfg: RLConfig, log: Callable[[str], None] = print) -> RLResult:
    from flywheel.envs import load_env
    from flywheel.inference import LocalEngine
    from flywheel.models import ChatRenderer, load
    from flywheel.rollout.episodes import play_groups

    if cfg.max_off_policy_steps > 0:
        raise TrainError("max_off_policy_steps > 0 (asynchronous rollouts) is not available yet; use 0")
    out = Path(cfg.output_dir)
    ckpt = start_run(out, cfg.resume, cfg.threads, cfg.train.seed, log)
    env = load_env(cfg.env.name, **cfg.env.settings)
    model, tokenizer = load(ckpt or cfg.model, device=cfg.device)
    ref_model = None
    if cfg.algo.kl_beta:
        ref_model, _ = load(cfg.model, device=cfg.device)
    engine = LocalEngine(copy.deepcopy(model), tokenizer, seed=cfg.train.seed)
    renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None
    oc = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=oc.lr, betas=oc.betas, eps=oc.eps, weight_decay=oc.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, oc.warmup_steps, cfg.train.steps, oc.min_lr_ratio))
    tasks = env.tasks("train", seed=cfg.train.seed)
    order = DataOrder(len(tasks), cfg.train.seed)
    step = 0
    if ckpt is not None:
        step = engine.version = restore_trainer_state(ckpt, opt, sched, order, log)
    algo = RLStepConfig(advantage=cfg.algo.advantage, eps_low=cfg.algo.eps_low, eps_high=cfg.algo.eps_high,
                        aggregation=cfg.algo.aggregation, max_tokens=cfg.sampling.max_tokens,
                        dynamic_sampling=cfg.algo.dynamic_sampling, is_cap=cfg.algo.is_cap,
                        kl_beta=cfg.algo.kl_beta, grad_clip=cfg.optim.grad_clip)
    metrics_out = MetricsWriter(out / "metrics.jsonl", out / "tensorboard" if cfg.log.tensorboard else None)
    evals: list[dict] = []
    names = [n for n, _ in model.named_parameters()]

    def run_eval() -> None:
        record = evaluate(env, engine, renderer, cfg)
        evals.append({"step": step, **record})
        metrics_out.log(step, **record)
        log(f"step {step}: " + ", ".join(f"{k}={v:.3f}" for k, v in record.items()))

    if step == 0:
        run_eval()
    skipped_in_row = 0
    with StepProgress(cfg.train.steps, start=step, enabled=cfg.log.progress, description="rl",
                      metric="reward") as progress:
        while step < cfg.train.steps:
            t0 = time.perf_counter()
            batch = [tasks[i] for i in order.take(cfg.train.groups_per_step)]
            groups = asyncio.run(play_groups(env, batch, cfg.train.group_size, engine, _params(cfg), renderer))
            t1 = time.perf_counter()
            lr = sched.get_last_lr()[0]
            m = rl_step(model, opt, groups, algo, tokenizer.pad_token_id, ref_model)
            sched.step()
            t2 = time.perf_counter()
            skipped_in_row = skipped_in_row + 1 if m.get("skipped") and m.get("groups", 1) else 0
            if skipped_in_row >= cfg.max_skipped_steps:
                raise TrainError(f"step {step + 1}: {skipped_in_row} updates in a row had a non-finite loss or "
                                 "gradient; stopping (see metrics.jsonl)")
            step += 1
            with torch.no_grad():
                engine.update_weights({n: p for n, p in zip(names, model.parameters())}, version=step)
            t3 = time.perf_counter()
            rewards = [t.reward for g in groups for t in g.trajectories]
            samples = len(rewards)
            tokens = sum(len(t.ids) for g in groups for t in g.trajectories)
            record = {**m, "reward_mean": sum(rewards) / samples, "tokens_per_s": tokens / (t3 - t0), "lr": lr,
                      "reward_std": float(torch.tensor(rewards).std()) if samples > 1 else 0.0,
                      "samples_per_s": samples / (t3 - t0), "time/generate_s": t1 - t0,
                      "time/train_s": t2 - t1, "time/weight_sync_s": t3 - t2}
            if step % cfg.log.every == 0 or step == cfg.train.steps:
                metrics_out.log(step, **record)
            progress.update(step, loss=record["reward_mean"], tokens_per_s=record["tokens_per_s"])
            if cfg.eval.every and step % cfg.eval.every == 0 and step < cfg.train.steps:
                run_eval()
            if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step < cfg.train.steps:
                save_checkpoint(out, step, model, tokenizer, trainer_state(step, opt, sched, order, cfg),
                                keep=cfg.checkpoint.keep)
    run_eval()
    save_checkpoint(out, step, model, tokenizer, trainer_state(step, opt, sched, order, cfg),
                    keep=cfg.checkpoint.keep)
    final = out / "final"
    save_model_folder(model, tokenizer, final)
    metrics_out.close()
    return RLResult(out, final, step, evals)


__all__ = ["RLResult", "evaluate", "run_rl"]
