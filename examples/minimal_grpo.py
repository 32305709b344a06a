"""Minimal GRPO on one page, written against flywheel's pieces: the whole inner loop of
`flywheel rl` (train/rl.py) without its feeder, worker processes, checkpoints and logging.

    python examples/minimal_grpo.py                       # a fresh tiny model on `ab+cd=`
    python examples/minimal_grpo.py --model runs/sft-arith-128/final --steps 40 --eval-tasks 200
    python examples/minimal_grpo.py --env examples/custom_env.py:load --max-tokens 32 --steps 2

Each step: pick tasks -> play G episodes per task with the sampler (token ids, the sampler's
logprobs, the verifier's reward) -> group advantages (reward minus the group's mean, over its
std) -> clipped policy-gradient loss on the sampled tokens only -> optimizer step -> copy the
new weights into the sampler as version `step`.

A random model earns ~0 reward on `ab+cd=`, so every advantage is 0 and nothing is learnt
(grad_norm 0): learning needs a model that already gets some answers right, such as the
warm start of the second command:
    flywheel model tiny --out runs/tiny-128 --hidden 128 --layers 2 --heads 2 --ffn 512
    flywheel data arithmetic --out runs/data
    flywheel sft configs/sft_arithmetic.yaml model=runs/tiny-128 output_dir=runs/sft-arith-128 \
      optim.warmup_steps=100 optim.min_lr_ratio=1.0 eval.every=20 "eval.stop_at={eval/heldout_accuracy: 0.3}"
A run this short is noisy and may end below where it started; `flywheel rl` adds what a real
run needs (dynamic sampling, minibatches, worker processes, evaluation, checkpoints).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import random
import tempfile
import time

import torch

from flywheel.envs import load_env
from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import ChatRenderer, TinySpec, build_tiny_model, load
from flywheel.rollout.advantages import grpo_advantages
from flywheel.rollout.evaluate import evaluate
from flywheel.rollout.play import SamplerPolicy, play
from flywheel.train.losses import policy_loss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local Hugging Face model folder (default: build a fresh tiny model)")
    ap.add_argument("--env", default="arithmetic", help="built-in name, 'pkg.module:load' or 'file.py:load'")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=8, help="tasks per step")
    ap.add_argument("--group-size", type=int, default=8, help="attempts per task (G)")
    ap.add_argument("--max-tokens", type=int, default=6, help="new tokens per assistant turn")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-tasks", type=int, default=100, help="held-out tasks scored greedily before and after")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)

    # the policy (trained here) and the sampler (an engine over its own copy of the weights)
    path = args.model or build_tiny_model(tempfile.mkdtemp(prefix="tiny-"),
                                          TinySpec(hidden=64, layers=2, heads=4, ffn=256, seed=args.seed))
    model, tokenizer = load(path)
    engine = LocalEngine(copy.deepcopy(model), tokenizer, seed=args.seed)  # it fuses weights in place
    renderer = ChatRenderer(tokenizer) if tokenizer.chat_template else None  # for chat (tool) tasks
    env = load_env(args.env)
    tasks, heldout = env.tasks("train", seed=args.seed), env.tasks("test", n=args.eval_tasks, seed=0)
    # "processed" logprobs: of the distribution sampled from (temperature applied), what the loss compares to
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, logprobs_mode="processed")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)

    def heldout_success() -> float:
        return evaluate(engine, env, heldout, max_tokens=args.max_tokens, renderer=renderer).success

    if args.eval_tasks:
        print(f"held-out greedy success before: {heldout_success():.3f}")
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        # 1. rollouts: G episodes per task through the Env API, token in, token out
        groups = asyncio.run(play(env, rng.sample(tasks, args.groups), SamplerPolicy(engine, params, renderer),
                                  group_size=args.group_size))
        trajs = [t for g in groups for t in g.trajectories]
        # 2. GRPO advantages: each attempt against the others at the same task
        advantages = torch.cat([grpo_advantages(torch.tensor([t.reward for t in g.trajectories]))
                                for g in groups])
        # 3. a right-padded batch; position t of the logits predicts token t + 1
        T = max(len(t.ids) for t in trajs)

        def padded(rows, fill, dtype):
            return torch.tensor([list(r) + [fill] * (T - len(r)) for r in rows], dtype=dtype)

        ids = padded([t.ids for t in trajs], tokenizer.pad_token_id, torch.long)
        attention = padded([[1] * len(t.ids) for t in trajs], 0, torch.long)
        mask = padded([t.loss_mask for t in trajs], 0, torch.float32)[:, 1:]  # 1 on sampled tokens only
        behavior = padded([t.behavior_logprobs for t in trajs], 0.0, torch.float32)[:, 1:]
        # 4. the loss: log p of the sampled tokens under softmax(logits / T), the sampled distribution
        model.train(False)  # no dropout: on-policy, the learner's logprobs equal the sampler's
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / args.temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss, metrics = policy_loss(logp, logp.detach(), advantages, mask, eps_low=0.2, eps_high=0.28,
                                    behavior_logp_B_T=behavior)
        # 5. the update
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # 0 when every advantage is 0
        optimizer.step()
        # 6. fresh weights to the sampler; its next samples carry policy version `step`
        engine.update_weights(dict(model.named_parameters()), version=step)
        rewards = [t.reward for t in trajs]
        print(f"step {step}: reward {sum(rewards) / len(rewards):.3f}  grad_norm {float(grad_norm):.4f}  "
              f"clip {metrics['clip_fraction']:.2f}  {time.perf_counter() - t0:.2f} s", flush=True)
    if args.eval_tasks:
        print(f"held-out greedy success after: {heldout_success():.3f}")


if __name__ == "__main__":
    main()
