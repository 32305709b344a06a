"""Shared bench helpers: the peer protocol's tiny model, an SFT warm start, timing, reporting.

Benchmarks are not tests: each compares flywheel with a reference in the same run, reports
medians of repeated measurements and their ratio, appends a section to docs/benchmarks.md
and prints `NAME: key=value ...` as its last line.
"""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = Path(os.environ.get("FLYWHEEL_BENCH_DIR", ROOT / "bench-work"))
# the model of ../shared/peers/trl_grpo_cpu: Qwen2, hidden 256, 4 layers, 4 heads, ffn 1024, fp32
PEER_SPEC = dict(hidden=256, layers=4, heads=4, ffn=1024, seed=0)


def set_threads(n: int) -> int:
    import torch

    torch.set_num_threads(n)
    return torch.get_num_threads()


def tiny_model() -> Path:
    from flywheel.models import TinySpec, build_tiny_model

    path = WORK / "tiny"
    if not (path / "config.json").exists():
        build_tiny_model(path, TinySpec(**PEER_SPEC))
    return path


def arith_sft(out: Path, steps: int, **optim) -> Path:
    """SFT of the tiny model on the `ab+cd=` training pairs (batch 128, lr 1e-3, weight decay
    0.01, `optim` on top), resumed from `out` when it holds checkpoints; returns the final model."""
    from flywheel.config import SFTConfig, validate
    from flywheel.envs.arithmetic import split_pairs, write_sft_jsonl
    from flywheel.train.sft import run_sft

    data = write_sft_jsonl(WORK / "arithmetic_train.jsonl", split_pairs()[0])
    cfg = validate(dict(model=str(tiny_model()), output_dir=str(out),
                        data={"train": [str(data)], "format": "prompt_completion"},
                        train={"steps": steps, "batch_size": 128, "micro_batch_size": 128},
                        optim={"lr": 1e-3, "weight_decay": 0.01, **optim},
                        log={"progress": False}, resume=True), SFTConfig)
    return run_sft(cfg, log=lambda m: None).final_model


def warm_model(steps: int = 200) -> Path:
    """The tiny model after a short SFT on `ab+cd=` (cached): it answers in the task's format
    and ends each answer with its eos token, as a GRPO warm start does."""
    final = WORK / f"sft-{steps}" / "final"
    if (final / "config.json").exists():
        return final
    return arith_sft(WORK / f"sft-{steps}", steps, warmup_steps=30)


def fill_sizes(args, smoke: dict, full: dict):
    """Sizes the command line left unset (None) take the smoke or the full value (`--smoke`)."""
    for k, v in (smoke if args.smoke else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def matmul_rate(threads: int, size: int = 1024, repeats: int = 20) -> float:
    """FLOP/s of a large fp32 matmul on this machine now (the arithmetic-floor yardstick)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(3):
        a @ b
    t, _ = median_time(lambda: a @ b, repeats)
    return 2 * size ** 3 / t


def machine_line(threads: int) -> str:
    import torch
    import transformers

    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {threads} threads")


def append_report(title: str, body: str, last_line: str, write: bool = True) -> None:
    """Print the body and the last line; with `write`, also append them as a dated section with
    the command line to docs/benchmarks.md (development runs pass write=False)."""
    if not write:
        print(body)
        print(last_line)
        return
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = f"\n## {title} ({stamp})\n\nCommand: `{cmd}`\n\n{body.strip()}\n\n`{last_line}`\n"
    doc = ROOT / "docs" / "benchmarks.md"
    doc.parent.mkdir(exist_ok=True)
    if not doc.exists():
        doc.write_text("# Benchmarks\n\nEach section is appended by a script in `bench/`, which measures flywheel "
                       "and its reference in the same run (medians of repeated measurements).\n")
    with open(doc, "a") as f:
        f.write(section)
    print(body)
    print(last_line)


def sustained_at(accuracies: list[float], target: float) -> int | None:
    """Index of the first evaluation from which every later one (itself included) is at or
    above `target`; None when the last one is below it. The time-to-target rule of the RL
    benchmarks, the same for every system: touching the target and falling back does not count.
    sustained_at([.5, .9, .7, .9, .95], .9) == 3."""
    at = None
    for i, acc in enumerate(accuracies):
        if acc >= target:
            at = i if at is None else at
        else:
            at = None
    return at


def median_range(values: list[float], fmt: str = "{:.2f}") -> str:
    """'median (min-max, n=N)' of the finite values; not-reached runs (inf/nan) are counted
    as such, and the median is over all runs with inf above every finite value."""
    import math

    finite = [v for v in values if math.isfinite(v)]
    missed = len(values) - len(finite)
    ordered = sorted(finite) + [math.inf] * missed
    med = statistics.median(ordered) if ordered else math.nan
    text = "not reached" if not math.isfinite(med) else fmt.format(med)
    span = f"{fmt.format(min(finite))}-{fmt.format(max(finite))}" if finite else "-"
    return f"{text} ({span}, n={len(values)}{f', {missed} not reached' if missed else ''})"
