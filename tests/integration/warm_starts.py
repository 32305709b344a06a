"""Warm starts built from nothing on a CPU, fixtures of the calculator RL test and of
bench/async.py (which puts this folder on its path): a tiny model taught a task's format by
SFT, so that RL has a policy that is imperfect but not hopeless. Each function is cached by its
output folder: a complete `final/` is returned as it is."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from flywheel.config import SFTConfig, validate
from flywheel.envs import load_env
from flywheel.envs.arithmetic import Pair, prompt_of, split_pairs, write_sft_jsonl
from flywheel.models import TinySpec, build_tiny_model
from flywheel.rollout.demos import make_demos
from flywheel.train.env_eval import calculator_bare_success, heldout_success
from flywheel.train.metrics import read_metrics
from flywheel.train.sft import run_sft

CALCULATOR = {"chain_prob": 0.0}  # "a * b" with 3-4-digit numbers, as configs/calculator_grpo.yaml
COPY_TARGET = 0.8  # stage 1 stops once this share of held-out bare episodes succeed


def calculator_warm_start(out: str | Path, demos: int = 4000, log: Callable[[str], None] = lambda m: None) -> Path:
    """configs/sft_calculator.yaml's recipe for the `calculator` env with chain_prob=0: a
    64-hidden, 2-layer, 4-head tiny model, SFT first on bare scripted demos (~180 tokens a row
    instead of ~1,000), where copying digits into the call and out of the result is learnt, until
    COPY_TARGET of held-out bare episodes succeed (checked every 50 steps, at most 1,500 steps),
    then 200 steps on full demos. The copying emerges abruptly and, for these 3-4-digit
    products, not in every build within the budget: it logs a warning when stage 1 ends below
    the target (docs/benchmarks.md, "Measurements behind choices in the code")."""
    root = Path(out)
    final = root / "sft" / "final"
    if (final / "config.json").exists():
        return final
    env = load_env("calculator", **CALCULATOR)
    model = root / "tiny"
    if not (model / "config.json").exists():
        build_tiny_model(model, TinySpec(hidden=64, layers=2, heads=4, ffn=256))
    bare, full = root / "demos_bare.jsonl", root / "demos.jsonl"
    make_demos(env, demos, out=bare, bare=True)
    make_demos(env, demos, out=full)
    until_copying = {"every": 50, "stop_at": {"eval/success": COPY_TARGET}}
    stages = [(model, bare, root / "sft-bare", 1500, 16, 3e-3, 30, until_copying, calculator_bare_success),
              (root / "sft-bare" / "final", full, root / "sft", 200, 8, 1e-3, 10, {}, None)]
    for start, data, stage_out, steps, batch, lr, warmup, evaluation, evaluator in stages:
        log(f"calculator warm start: SFT {stage_out.name} (up to {steps} steps)")
        result = run_sft(validate(dict(model=str(start), output_dir=str(stage_out), resume=True,
                                       data={"train": [str(data)], "format": "chat"},
                                       train={"steps": steps, "batch_size": batch, "micro_batch_size": batch},
                                       optim={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": 0.1,
                                              "weight_decay": 0.01},
                                       eval=evaluation, log={"progress": False}, threads=1), SFTConfig),
                         evaluator=evaluator, log=log)
        if evaluator is not None and result.last.get("eval/success", 0.0) < COPY_TARGET:
            log(f"warning: {stage_out.name} ended at held-out bare success {result.last.get('eval/success')}, "
                f"below {COPY_TARGET}: the copying did not emerge in {steps} steps")
    return final


# "What is 12 times 57?" with 1-2-digit numbers, no system prompt or tool block
CALCULATOR_FROM_MEMORY = {"chain_prob": 0.0, "bare_prompt": True, "max_turns": 3, "operator": "*",
                          "template": "What is {a} times {b}?", "max_digits": 2}


def calculator_from_memory_warm_start(out: str | Path, direct_share: float = 0.7, seed: int = 0,
                                      log: Callable[[str], None] = lambda m: None) -> tuple[Path, float]:
    """A policy that can use its calculator but answers multiplications from memory: RL's job
    is to make it call the tool (env `calculator` with CALCULATOR_FROM_MEMORY). Returns (model,
    held-out success of the tool path after stage 1).

    A 64-hidden, 2-layer, 4-head tiny model; stage 1: SFT on 3,000 scripted tool episodes until
    80 % of 20 held-out episodes succeed (checked every 50 steps, at most 1,500: the copying
    into the call and out of the result emerges abruptly, at a step that varies by machine);
    then 200 more steps at lr 1e-3, because copying that just emerged holds under greedy
    decoding but not under sampling at temperature 1, and RL needs sampled successes to
    reward; stage 2: 80 steps on 1,000 demos of which `direct_share` answer at once ("The
    answer is 684."), after which greedy decoding answers directly and fails while sampling
    still calls the tool in some episodes. The measurements behind these choices are in
    docs/benchmarks.md ("Measurements behind choices in the code")."""
    root = Path(out)
    final = root / "stage2" / "final"

    def copying() -> float:
        evals = [r["eval/success"] for r in read_metrics(root / "stage1" / "metrics.jsonl") if "eval/success" in r]
        return evals[-1] if evals else 0.0

    if (final / "config.json").exists():
        return final, copying()
    env = load_env("calculator", **CALCULATOR_FROM_MEMORY)
    tiny = root / "tiny"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny, TinySpec(hidden=64, layers=2, heads=4, ffn=256, seed=seed))
    rows, _ = make_demos(env, 3000, out=root / "tool.jsonl")
    rng = random.Random(seed)
    with open(root / "mixed.jsonl", "w", encoding="utf-8") as f:
        for row in rows[:1000]:
            if rng.random() < direct_share:  # the same question answered from memory
                question, result = row["messages"][0], row["messages"][2]["content"]
                row = {"messages": [question, {"role": "assistant", "content": f"The answer is {result}."}],
                       "tools": []}
            f.write(json.dumps(row) + "\n")

    def sft(start: Path, data: str, stage: str, steps: int, lr: float, warmup: int, min_lr_ratio: float,
            evaluation: dict, evaluator=None) -> None:
        log(f"calculator-from-memory warm start: SFT {stage} (up to {steps} steps)")
        return run_sft(validate(dict(
            model=str(start), output_dir=str(root / stage), resume=True,
            data={"train": [str(root / data)], "format": "chat"},
            train={"steps": steps, "batch_size": 16, "micro_batch_size": 16, "seed": seed},
            optim={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": min_lr_ratio, "weight_decay": 0.01},
            eval=evaluation, log={"progress": False}), SFTConfig), evaluator=evaluator, log=log)

    stage1 = root / "stage1" / "final"
    if not (stage1 / "config.json").exists():  # else resuming would train on past its stop
        sft(tiny, "tool.jsonl", "stage1", 1500, 3e-3, 30, 0.1,
            {"every": 50, "stop_at": {"eval/success": 0.8}}, heldout_success(env, tasks=20))
    consolidated = root / "stage1b" / "final"
    if not (consolidated / "config.json").exists():
        sft(stage1, "tool.jsonl", "stage1b", 200, 1e-3, 5, 0.1, {})
    sft(consolidated, "mixed.jsonl", "stage2", 80, 1e-3, 5, 1.0, {})
    return final, copying()


# ---------------------------------------------------------------- the arithmetic RL start

FORGET_BASE = 0.55  # the flawed teacher forgets the carry in 55 % of the cases whose carrying digit sum is 10 ...
FORGET_SLOPE = 0.04  # ... and 4 points more per unit of that sum above 10 (87 % at 18)
FLAWED_COPIES = 20  # rows per training pair, so that each pair's share of wrong answers is exact


def carryless_sum(a: int, b: int) -> int:
    """Two-digit addition with every carry forgotten, digit by digit mod 10: 57 + 68 -> 15
    (7 + 8 = 15 writes 5, 5 + 6 = 11 writes 1), 23 + 45 -> 68 (no carry: the true sum)."""
    return (a // 10 + b // 10) % 10 * 10 + (a % 10 + b % 10) % 10


def forget_rate(a: int, b: int) -> float:
    """The share of the flawed teacher's answers to `a+b` that forget the carries: 0 without a
    carry; else FORGET_BASE + FORGET_SLOPE * (s - 10), s the first carrying digit sum (the
    units' when they carry, else the tens'): 57 + 68 (units 15) -> 0.75, 50 + 60 (tens 11) -> 0.59."""
    units, tens = a % 10 + b % 10, a // 10 + b // 10
    s = units if units >= 10 else tens
    return FORGET_BASE + FORGET_SLOPE * (s - 10) if s >= 10 else 0.0


def flawed_rows(pairs: list[Pair], copies: int = FLAWED_COPIES) -> list[dict]:
    """`copies` prompt/completion rows per pair, round(forget_rate * copies) of them answered
    with carryless_sum and the rest with the sum (the share is exact per pair, so the model
    learns a rate, not which copy is which)."""
    rows = []
    for a, b in pairs:
        wrong = round(forget_rate(a, b) * copies)
        rows += [{"prompt": prompt_of(a, b), "completion": str(carryless_sum(a, b) if i < wrong else a + b)}
                 for i in range(copies)]
    return rows


def arith_carry_warm_start(out: str | Path, clean_steps: int = 600, flawed_steps: int = 200, device: str = "cpu",
                           threads: int | None = 2, log: Callable[[str], None] = lambda m: None) -> Path:
    """The RL learning tests' start on `ab+cd=` (the peer protocol's tiny model, hidden 256,
    4 layers): a policy with a systematic error that sampling sometimes avoids, reached on a
    plateau rather than inside a jump.
    1. SFT on the training pairs, `clean_steps` at lr 1e-3 (100 warm-up, cosine to 1e-4), batch
       128: the addition is learnt in an abrupt jump whose step moves with the CPU's rounding
       (~325 here, ~350 under aten-avx2), then held: 0.99 held-out greedy at step 600 on both.
    2. SFT on a flawed teacher (flawed_rows), `flawed_steps` at lr 3e-4 (10 warm-up, cosine to
       3e-5): the model now forgets carries at a rate that grows with the digit sum, so greedy
       decoding fails most carrying pairs (held-out greedy 0.38-0.50 over the last checks) while
       sampling at temperature 1 still carries in 13-45 % of them: RL's reward has something
       to reinforce, and each carrying sum's class flips at its own point.
    Measured on this machine and under ATEN_CPU_CAPABILITY=avx2 (docs/benchmarks.md, "The
    arithmetic warm start on a plateau"). Cached by its folder: a complete final model is
    returned as it is."""
    root = Path(out)
    final = root / "flawed" / "final"
    if (final / "config.json").exists():
        return final
    tiny = root / "tiny"
    if not (tiny / "config.json").exists():
        build_tiny_model(tiny, TinySpec())
    train = split_pairs()[0]
    clean = write_sft_jsonl(root / "clean.jsonl", train)
    flawed = root / "flawed.jsonl"
    flawed.write_text("".join(json.dumps(r) + "\n" for r in flawed_rows(train)))
    stages = [(tiny, clean, root / "clean", clean_steps, 1e-3, 100),
              (root / "clean" / "final", flawed, root / "flawed", flawed_steps, 3e-4, 10)]
    for start, data, stage_out, steps, lr, warmup in stages:
        if (stage_out / "final" / "config.json").exists():
            continue
        log(f"arithmetic warm start: SFT {stage_out.name} ({steps} steps)")
        run_sft(validate(dict(model=str(start), output_dir=str(stage_out), device=device, threads=threads,
                              data={"train": [str(data)], "format": "prompt_completion"},
                              train={"steps": steps, "batch_size": 128, "micro_batch_size": 128},
                              optim={"lr": lr, "warmup_steps": warmup, "min_lr_ratio": 0.1, "weight_decay": 0.01},
                              checkpoint={"every": 0}, log={"progress": False}), SFTConfig), log=log)
    return final
