"""flywheel's GRPO update and TRL's side by side on identical batches (issue 36, §1).

One batch: 8 train prompts of the `ab+cd=` task x 8 completions sampled from the warm start
(HF generate, temperature 1, TRL's completion mask: every token up to and including the
first eos). Its rewards, then:
- TRL: GRPOTrainer (bench/peers/trl_grpo.py's config) computes its loss on the batch with its
  own `compute_loss`, advantages as its `_generate_and_score_completions` makes them
  (group mean, group sample std + 1e-4);
- flywheel: the same trajectories through `train/rl_step.update` (advantages by
  rollout/advantages.py), on a copy of the same model, gradients read before the optimizer.
Reported per batch: both losses, the gradients' cosine and norm ratio (after clipping to 1.0, as
both clip before their optimizer step), and
the cosine of the parameter changes after one optimizer step each (its own optimizer:
torch AdamW for both, TRL's through its Trainer settings). `--batches N` repeats on fresh
batches. A cosine below 0.999 says the updates differ; the table in docs/benchmarks.md says
which difference does it.

Needs the bench extra (trl). Prints `rl_update_parity: ...` last.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import common  # noqa: E402


def sample_batch(model, tok, pairs, generations: int, max_new: int, seed: int):
    """(prompt_ids (P*G, 6), completion_ids (P*G, T), completion_mask, rewards (P*G,)) sampled by HF generate."""
    import trl_grpo

    torch.manual_seed(seed)
    prompts = [trl_grpo.prompt_of(a, b) for a, b in pairs for _ in range(generations)]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    completion = out[:, enc["input_ids"].shape[1]:]
    is_eos = completion == tok.eos_token_id
    eos_idx = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full((len(prompts),), completion.shape[1]))
    mask = (torch.arange(completion.shape[1])[None] <= eos_idx[:, None]).long()
    texts = tok.batch_decode(completion, skip_special_tokens=True)
    answers = [str(a + b) for a, b in pairs for _ in range(generations)]
    rewards = torch.tensor([1.0 if trl_grpo.is_correct(c, a) else 0.0 for c, a in zip(texts, answers)])
    return enc["input_ids"], completion, mask, rewards


def trl_update(model, tok, batch, generations: int, lr: float, work: Path):
    """(loss, gradient vector, parameter change) of TRL's GRPOTrainer on the batch."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompt_ids, completion, mask, rewards = batch
    grouped = rewards.view(-1, generations)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
    cfg = GRPOConfig(output_dir=str(work), use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
                     per_device_train_batch_size=len(rewards), gradient_accumulation_steps=1,
                     num_generations=generations, max_completion_length=completion.shape[1], max_steps=1,
                     learning_rate=lr, beta=0.0, temperature=1.0, report_to="none", save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": ["00+00="]}), processing_class=tok)
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before compute_loss
    model.train()
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones_like(prompt_ids), "completion_ids": completion,
              "completion_mask": mask, "advantages": adv, "num_items_in_batch": mask.sum()}
    before = [p.detach().clone() for p in model.parameters()]
    trainer.optimizer.zero_grad()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)  # as its Trainer does
    grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    trainer.optimizer.step()
    delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
    return float(loss.detach()), grad, delta


class GradTap:
    """An optimizer stand-in for rl_step.update: keeps the gradient, then steps the real one."""

    def __init__(self, optimizer):
        self.optimizer, self.grad = optimizer, None

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self):
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.grad = torch.cat([p.grad.reshape(-1) for p in params])
        self.optimizer.step()


def flywheel_update(model, tok, batch, generations: int, lr: float, grad_clip: float | None):
    """(loss, gradient vector, parameter change) of flywheel's update on the same trajectories."""
    from flywheel.config import AlgoConfig
    from flywheel.train.rl_step import RLStepConfig, assign_advantages, update
    from flywheel.train.rl_step import token_logprobs
    from flywheel.types import Trajectory, TrajectoryGroup

    prompt_ids, completion, mask, rewards = batch
    ids = torch.cat([prompt_ids, completion], 1)
    with torch.no_grad():
        logp, _ = token_logprobs(model, ids, torch.ones_like(ids))  # (B, T - 1): the sampler's logprobs
    groups, P = [], prompt_ids.shape[1]
    for g in range(len(rewards) // generations):
        trajs = []
        for i in range(g * generations, (g + 1) * generations):
            n = int(mask[i].sum())
            row = ids[i, :P + n].tolist()
            behavior = [0.0] * P + logp[i, P - 1:P - 1 + n].tolist()
            trajs.append(Trajectory(f"t{g}", row, [0] * P + [1] * n, behavior, [-1] * P + [0] * n,
                                    reward=float(rewards[i])))
        groups.append(TrajectoryGroup(f"t{g}", trajs))
    cfg = RLStepConfig(algo=AlgoConfig(dynamic_sampling=False), grad_clip=grad_clip)
    groups = assign_advantages(groups, cfg.algo.advantage, cfg.algo.dynamic_sampling)
    opt = GradTap(torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0))
    before = [p.detach().clone() for p in model.parameters()]
    metrics = update(model, opt, groups, cfg, tok.pad_token_id)
    delta = torch.cat([(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before)])
    return metrics["loss"], opt.grad, delta


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float(a @ b / (a.norm() * b.norm()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="warm-start folder (default: bench/rl_vs_trl.py's, built if missing)")
    ap.add_argument("--batches", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-report", action="store_true")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    import rl_vs_trl
    import trl_grpo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = args.model or rl_vs_trl.warm_start(0.35)[0]
    tok = AutoTokenizer.from_pretrained(model_dir)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train = trl_grpo.split_pairs()[0]
    rows = []
    for b in range(args.batches):
        pairs = random.Random(b).sample(train, 8)
        batch = sample_batch(base, tok, pairs, 8, 6, seed=b)
        trl_loss, trl_grad, trl_delta = trl_update(copy.deepcopy(base), tok, batch, 8, args.lr,
                                                   common.WORK / "parity-trl")
        fw_loss, fw_grad, fw_delta = flywheel_update(copy.deepcopy(base), tok, batch, 8, args.lr, grad_clip=1.0)
        rows.append(dict(batch=b, reward=float(batch[3].mean()), trl_loss=trl_loss, fw_loss=fw_loss,
                         grad_cos=cosine(trl_grad, fw_grad), grad_ratio=float(fw_grad.norm() / trl_grad.norm()),
                         delta_cos=cosine(trl_delta, fw_delta), delta_ratio=float(fw_delta.norm() / trl_delta.norm())))
        print(rows[-1], flush=True)
    table = ["| batch | reward mean | TRL loss | flywheel loss | gradient cosine | gradient norm ratio (fw/TRL) | "
             "update cosine | update norm ratio |", "|---|---|---|---|---|---|---|---|"]
    table += [f"| {r['batch']} | {r['reward']:.3f} | {r['trl_loss']:.5f} | {r['fw_loss']:.5f} | {r['grad_cos']:.6f} | "
              f"{r['grad_ratio']:.4f} | {r['delta_cos']:.6f} | {r['delta_ratio']:.4f} |" for r in rows]
    body = "\n".join([f"Machine: {common.machine_line(threads)}. Model: {model_dir}.", "", *table])
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    last = (f"rl_update_parity: grad_cos={med('grad_cos'):.6f} grad_ratio={med('grad_ratio'):.4f} "
            f"update_cos={med('delta_cos'):.6f} update_ratio={med('delta_ratio'):.4f} batches={len(rows)}")
    common.append_report("bench/rl_update_parity.py: flywheel's and TRL's GRPO update on identical batches", body,
                         last, write=not args.no_report)


if __name__ == "__main__":
    main()
