"""Where the peer protocol's warm start learns addition: held-out greedy accuracy every 25 steps.

    python bench/sft_curve.py [--steps 600] [--lr 1e-3 3e-4] [--settings default avx2 aten-avx2]

bench/rl_vs_trl.py starts both systems from the peer protocol's tiny model after SFT on
`ab+cd=` (batch 128, constant lr after 100 warm-up steps, weight decay 0.01) stopped at the
first check >= 0.35 (the RL learning tests did too, until this showed the stop moving with the
rounding; they now start from tests/integration/warm_starts.arith_carry_warm_start). This prints the whole curve per learning rate and CPU setting, each
run in a fresh process from the same initial weights:
- default: as is;
- avx2: ONEDNN_MAX_CPU_ISA=AVX2 (the issue's stand-in for another CPU kind);
- aten-avx2: ATEN_CPU_CAPABILITY=avx2 and MKL_ENABLE_INSTRUCTIONS=AVX2 (torch's own vector
  kernels and MKL's matmuls limited to AVX2).
A curve that jumps between two checks is one whose stopping point moves with float rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SETTINGS = {
    "default": {},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
EVERY = 25
WARM_TARGET = 0.35  # bench/rl_vs_trl.py --warm-target's default


def curve(out: Path, lr: float, steps: int, threads: int) -> list[float]:
    """SFT from the cached tiny model; the held-out greedy accuracy at every EVERY steps."""
    from flywheel.config import SFTConfig, validate
    from flywheel.envs import load_env
    from flywheel.envs.arithmetic import split_pairs, write_sft_jsonl
    from flywheel.train.env_eval import heldout_success
    from flywheel.train.sft import run_sft

    data = write_sft_jsonl(common.WORK / "arithmetic_train.jsonl", split_pairs()[0])
    accuracies: list[float] = []
    heldout = heldout_success(load_env("arithmetic"), tasks=200, max_tokens=6)

    def evaluator(model, tokenizer) -> dict:
        result = heldout(model, tokenizer)
        accuracies.append(result["success"])
        return result

    run_sft(validate(dict(
        model=str(common.tiny_model()), output_dir=str(out), data={"train": [str(data)], "format": "prompt_completion"},
        train={"steps": steps, "batch_size": 128, "micro_batch_size": 128},
        optim={"lr": lr, "warmup_steps": 100, "min_lr_ratio": 1.0, "weight_decay": 0.01},
        eval={"every": EVERY}, checkpoint={"every": 0}, log={"progress": False}, threads=threads), SFTConfig),
        evaluator=evaluator, log=lambda m: None)
    return accuracies


def stop_step(accuracies: list[float]) -> tuple[int, float] | None:
    """The warm start's rule: the first check >= WARM_TARGET, as (step, accuracy)."""
    return next(((EVERY * (i + 1), a) for i, a in enumerate(accuracies) if a >= WARM_TARGET), None)


def largest_jump(accuracies: list[float]) -> float:
    return max((b - a for a, b in zip(accuracies, accuracies[1:])), default=0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-3, 3e-4])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: "lr,out" -> one curve as JSON
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    if args.one:
        lr, out = args.one.split(",", 1)
        print(json.dumps(curve(Path(out), float(lr), args.steps, threads)))
        return
    common.tiny_model()  # built once, before the runs, so every run starts from the same weights
    rows, results = [], []
    for lr in args.lr:
        for name in args.settings:
            out = common.WORK / f"sft-curve-{name}-{lr:g}"
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--one", f"{lr},{out}", "--steps", str(args.steps),
                                   "--threads", str(threads)], env={**os.environ, **SETTINGS[name]},
                                  capture_output=True, text=True, check=True)
            accuracies = json.loads(proc.stdout.strip().splitlines()[-1])
            stop = stop_step(accuracies)
            results.append((name, lr, accuracies))
            rows.append(f"| {name} | {lr:g} | {stop[0] if stop else '-'} | {f'{stop[1]:.3f}' if stop else '-'} "
                        f"| {largest_jump(accuracies):+.3f} | {accuracies[-1]:.3f} | {time.perf_counter() - t0:.0f} |")
            print(rows[-1], flush=True)
    identical = {lr: len({json.dumps(a) for _, l, a in results if l == lr}) == 1 for lr in args.lr}
    curves = "\n".join(f"- {name}, lr {lr:g}: " + ", ".join(f"{EVERY * (i + 1)}: {a:.3f}" for i, a in enumerate(acc))
                       for name, lr, acc in results)
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. The peer protocol's tiny model, SFT on the `ab+cd=` training "
        f"pairs (batch 128, constant lr after 100 warm-up steps, weight decay 0.01), held-out greedy accuracy "
        f"on the 200 test pairs every {EVERY} steps; one run per row, each a fresh process from the same "
        f"initial weights. Stop: the warm start's rule, the first check >= {WARM_TARGET}.",
        "",
        "| setting | lr | stop step | accuracy there | largest rise between checks | last | s |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Curves (step: accuracy):",
        curves,
        "",
        "Curves identical across settings: " + ", ".join(f"lr {lr:g}: {'yes' if same else 'no'}"
                                                    for lr, same in identical.items()),
    ])
    first = results[0][2]
    last_line = (f"sft_curve: runs={len(results)} stop_step={stop_step(first)[0] if stop_step(first) else 'none'} "
                 f"largest_jump={largest_jump(first):.3f} identical_across_settings="
                 f"{int(all(identical.values()))}")
    common.append_report("bench/sft_curve.py: where the warm start's SFT learns addition", body, last_line)


if __name__ == "__main__":
    main()
