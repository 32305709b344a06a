"""The flagship demo, run `--runs` times with different world seeds: median and range of every
figure of its `demo:` line.

Each run is `python -m flywheel.demo --seed S --out bench-work/demo-S` (the defaults of `make
demo` otherwise; `-- --base smollm2-135m-instruct` runs the real-model demo), in its own process; the base model is built once and cached, so every run
starts from the same model and differs only in its traffic (which questions users ask, which
failures they correct). README quotes this table, not a single run.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

_PAIR = re.compile(r"(\w+)=([-+]?[0-9.]+|nan|inf)")


_GENERAL = re.compile(r"^general ability against the base: forward KL ([0-9.]+) per token.*?\(([0-9.]+|nan) points lost\)"
                      r"(?:.*\(net (-?[0-9.]+|nan) points lost\))?", re.M)


def parse_demo_line(text: str) -> dict[str, float]:
    """The key=value figures of the last line starting with 'demo:' in a run's output, and for
    a pretrained base its general-ability line's KL and points lost, one-sided and net
    (general_kl, simple_lost, simple_net_lost; a line of before 2026-12-07 has no net)."""
    lines = [ln for ln in text.splitlines() if ln.startswith("demo:")]
    if not lines:
        raise ValueError("the run printed no 'demo:' line")
    figures = {k: float(v) for k, v in _PAIR.findall(lines[-1])}
    if general := _GENERAL.search(text):
        figures.update(general_kl=float(general.group(1)), simple_lost=float(general.group(2)))
        if general.group(3) is not None:
            figures["simple_net_lost"] = float(general.group(3))
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    ap.add_argument("demo_args", nargs="*", help="passed to the demo after `--`, e.g. -- --days 2")
    args = ap.parse_args()
    runs: list[dict[str, float]] = []
    minutes: list[float] = []
    for seed in range(args.first_seed, args.first_seed + args.runs):
        out = common.WORK / f"demo-{seed}"
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "flywheel.demo", "--seed", str(seed), "--out", str(out),
                               "--threads", str(args.threads), *args.demo_args],
                              capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
        if done.returncode != 0:
            sys.exit(f"demo seed {seed} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        minutes.append((time.perf_counter() - t0) / 60)
        runs.append(parse_demo_line(done.stdout))
        print(f"seed {seed}: " + " ".join(f"{k}={v:g}" for k, v in runs[-1].items()), flush=True)
    keys = list(runs[0])
    rows = ["| figure | median | range | per run (seed order) |", "|---|---|---|---|"]
    for k in keys:
        vals = [r.get(k, math.nan) for r in runs]
        rows.append(f"| {k} | {statistics.median(vals):.3g} | {min(vals):.3g} to {max(vals):.3g} | "
                    + ", ".join(f"{v:.3g}" for v in vals) + " |")
    body = "\n".join([
        f"Machine: {common.machine_line(args.threads)}. {args.runs} runs of the demo, world seeds "
        f"{args.first_seed}-{args.first_seed + args.runs - 1}, the same cached base model; extra demo arguments: "
        f"{' '.join(args.demo_args) or 'none'}. Minutes per run: {', '.join(f'{m:.1f}' for m in minutes)}.", "",
        *rows])
    med = {k: statistics.median(r.get(k, math.nan) for r in runs) for k in keys}
    last = "demo: " + " ".join(f"{k}={v:.3g}" for k, v in med.items()) + f" runs={args.runs} stat=median"
    common.append_report("bench/demo.py: the flagship demo over several world seeds", body, last,
                         write=not args.no_report)


if __name__ == "__main__":
    main()
