"""The flagship demo until the full flywheel exists: build a tiny model, measure it on the
shared `ab+cd=` task, supervised-fine-tune it, and measure again.

    python -m flywheel.demo [--steps 400] [--out runs/demo]

Everything is built locally (no downloads) and runs on 2 CPU cores in a few minutes.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description="flywheel demo: tiny model -> SFT -> accuracy before and after")
    ap.add_argument("--out", default="runs/demo", help="working folder (recreated)")
    ap.add_argument("--steps", type=int, default=400, help="SFT optimizer steps (128 examples each)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from flywheel.config import SFTConfig, validate
    from flywheel.envs.arithmetic import greedy_accuracy, prompt_of, split_pairs, write_sft_jsonl
    from flywheel.inference import LocalEngine, SamplingParams
    from flywheel.models import TinySpec, build_tiny_model
    from flywheel.train.sft import run_sft

    console = Console()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    t_start = time.perf_counter()

    console.rule("[bold]1. build a tiny model")
    model_dir = build_tiny_model(out / "tiny", TinySpec())
    console.print(f"Qwen2 architecture, hidden 256, 4 layers, byte-level tokenizer -> {model_dir}")

    console.rule("[bold]2. generate the task")
    train, heldout = split_pairs()
    train_file = write_sft_jsonl(out / "data" / "train.jsonl", train)
    console.print(f"'ab+cd=' -> sum: {len(train)} training pairs, {len(heldout)} held-out pairs never trained on")

    before, _ = greedy_accuracy(LocalEngine.from_path(str(model_dir)), heldout)
    console.print(f"held-out greedy accuracy before training: [bold]{before:.1%}[/]")

    console.rule("[bold]3. supervised fine-tuning")
    cfg = validate(dict(
        model=str(model_dir), output_dir=str(out / "sft"),
        data={"train": [str(train_file)], "format": "prompt_completion"},
        train={"steps": args.steps, "batch_size": 128, "micro_batch_size": 128},
        optim={"lr": 1e-3, "warmup_steps": 100, "weight_decay": 0.01, "min_lr_ratio": 1.0},
        checkpoint={"every": 100}, threads=args.threads), SFTConfig)
    result = run_sft(cfg, log=console.print)

    console.rule("[bold]4. measure again")
    engine = LocalEngine.from_path(str(result.final_model), seed=0)
    after, rows = greedy_accuracy(engine, heldout)
    table = Table(title="held-out samples (greedy)")
    for col in ("prompt", "completion", "correct"):
        table.add_column(col)
    for prompt, completion, ok in rows[:8]:
        table.add_row(prompt, repr(completion), "yes" if ok else "no")
    console.print(table)
    a, b = heldout[0]
    samples = engine.generate([engine.encode(prompt_of(a, b))], SamplingParams(n=6, temperature=1.0, max_tokens=6))[0]
    console.print(f"6 samples at temperature 1 for {prompt_of(a, b)!r}: " + ", ".join(repr(s.text) for s in samples))
    console.rule()
    console.print(f"held-out greedy accuracy: [bold]{before:.1%} -> {after:.1%}[/] after {result.steps} SFT steps "
                  f"({time.perf_counter() - t_start:.0f} s in all)")
    console.print(f"model: {result.final_model}   metrics: {result.output_dir / 'metrics.jsonl'}")
    console.print(f"try:  flywheel generate --model {result.final_model} -p '12+34=' -n 4")


if __name__ == "__main__":
    main()
