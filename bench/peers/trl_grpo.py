"""The peer: TRL's GRPOTrainer on the `ab+cd=` task, as bench/rl_vs_trl.py runs it.

The reference protocol of shared/peers/trl_grpo_cpu (scripts/03_grpo.py), brought into the
repository so the benchmark runs from a clone alone, with what the symmetric protocol needs on
top: a seed, and greedy evaluation on the 200 held-out pairs at a fixed step schedule by a
callback, outside the clock. It depends on TRL and transformers only, never on flywheel, so it
is the peer's own path; its held-out split is the protocol's (seed 1234), and rl_vs_trl.py
checks that flywheel's arithmetic environment holds the same 200 pairs.

Clock: the sum of per-step wall times (TrainerCallback on_step_begin -> on_step_end: generation,
reward, loss, backward, optimizer step). The evaluation callback runs after on_step_end, so its
time is outside every step, as flywheel's evaluations are outside its step times.

Writes one JSON summary (--out): versions, settings, evaluations [{step, accuracy,
train_s (clock at that step), eval_s}], steps, samples, train_s, trainer_wall_s.
Pinned versions: bench/peers/README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

import trl
from trl import GRPOConfig, GRPOTrainer

N_HELDOUT = 200
SPLIT_SEED = 1234
_LEADING_NUMBER = re.compile(r"\s*(\d+)")


def split_pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(train pairs, 200 held-out pairs): all 10,000 (a, b) with 0 <= a, b < 100, shuffled by
    seed 1234; the first 200 are held out."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(SPLIT_SEED).shuffle(pairs)
    return pairs[N_HELDOUT:], pairs[:N_HELDOUT]


def prompt_of(a: int, b: int) -> str:
    return f"{a:02d}+{b:02d}="  # 6 characters = 6 tokens of the char-level tokenizer


def is_correct(completion: str, answer: str) -> bool:
    m = _LEADING_NUMBER.match(completion)
    return bool(m) and m.group(1) == answer


@torch.no_grad()
def greedy_accuracy(model, tok, pairs, max_new_tokens: int = 6) -> float:
    """Share of `pairs` whose greedy completion starts with the right sum (HF generate, one batch)."""
    was_training = model.training
    model.eval()
    enc = tok([prompt_of(a, b) for a, b in pairs], return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    completions = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    model.train(was_training)
    return sum(is_correct(c, str(a + b)) for (a, b), c in zip(pairs, completions)) / len(pairs)


class StepClock(TrainerCallback):
    """Sums per-step wall time; must be registered before EvalEvery (callbacks run in order)."""

    def __init__(self):
        self.train_s, self.steps, self._t0 = 0.0, 0, 0.0

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        self.train_s += time.perf_counter() - self._t0
        self.steps = state.global_step


class EvalEvery(TrainerCallback):
    """Greedy held-out accuracy after every `every` steps and after the last, outside the clock."""

    def __init__(self, clock: StepClock, tok, pairs, every: int, last: int):
        self.clock, self.tok, self.pairs, self.every, self.last = clock, tok, pairs, every, last
        self.evaluations: list[dict] = []

    def evaluate(self, model, step: int) -> None:
        t0 = time.perf_counter()
        acc = greedy_accuracy(model, self.tok, self.pairs)
        self.evaluations.append(dict(step=step, accuracy=acc, train_s=round(self.clock.train_s, 4),
                                     eval_s=round(time.perf_counter() - t0, 4)))

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step % self.every == 0 or state.global_step == self.last:
            self.evaluate(model, state.global_step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the warm-start model folder (tokenizer included)")
    ap.add_argument("--out", required=True, help="where the JSON summary goes")
    ap.add_argument("--work", required=True, help="TRL's output_dir (nothing is saved there but its logs)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bs", type=int, default=64, help="completions per step (8 prompts x 8 generations)")
    ap.add_argument("--num-generations", type=int, default=8)
    ap.add_argument("--max-completion-length", type=int, default=6)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train_pairs, heldout = split_pairs()
    ds = Dataset.from_dict({"prompt": [prompt_of(a, b) for a, b in train_pairs],
                            "answer": [str(a + b) for a, b in train_pairs]})

    def correct_sum(prompts, completions, answer, **kwargs):
        return [1.0 if is_correct(c, a) else 0.0 for c, a in zip(completions, answer)]

    cfg = GRPOConfig(
        output_dir=args.work, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        per_device_train_batch_size=args.bs, gradient_accumulation_steps=1,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length,
        max_steps=args.steps, learning_rate=args.lr, beta=0.0, temperature=1.0,
        logging_steps=1, save_strategy="no", report_to="none", seed=args.seed, data_seed=args.seed,
        dataloader_num_workers=0)
    clock = StepClock()
    evals = EvalEvery(clock, tok, heldout, args.eval_every, args.steps)
    evals.evaluate(model, 0)
    trainer = GRPOTrainer(model=model, reward_funcs=correct_sum, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[clock, evals])
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    summary = dict(versions=dict(torch=torch.__version__, transformers=__import__("transformers").__version__,
                                 trl=trl.__version__),
                   args=vars(args), evaluations=evals.evaluations, steps=clock.steps,
                   samples=clock.steps * args.bs, train_s=round(clock.train_s, 3), trainer_wall_s=round(wall, 3),
                   eval_s=round(sum(e["eval_s"] for e in evals.evaluations), 3))
    with open(args.out, "w") as f:
        json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
