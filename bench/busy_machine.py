"""The demo base model's SFT beside a busy process: torch's default threads (what `flywheel
model demo-base` ran with before issue 35) vs the threads flywheel now chooses, same run.

Each repeat starts a CPU-bound competitor (`python -c "while True: pass"`), waits a second, and
runs both arms, in alternating order, as child processes that do what `flywheel model
demo-base` does (cli/model.py: set the threads, then demo/base.py's `base_model`) with a short
step count in a temporary cache folder. Then the same pair with no competitor. An arm's step
time is the median interval between consecutive rows of its metrics.jsonl (one row per step),
its first 5 steps dropped. The chosen arm says why it chose its count; each arm says whether
the oversubscription warning (flywheel/cpu_wait.py) fired and at what wait share.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

WARMUP = 5  # steps dropped from each arm's step times
COMPETITOR = "while True: pass"


def arm(kind: str, root: Path, steps: int) -> None:
    """A child: demo-base's build with `steps` SFT steps, threads as `kind` says; prints one JSON line."""
    from dataclasses import replace

    import torch

    from flywheel.cpu_wait import CpuOversubscribed
    from flywheel.demo.base import BASE_RECIPE, base_model

    said: list[str] = []
    if kind == "chosen":
        from flywheel.threads import use_threads

        use_threads(None, log=said.append)  # what cli/options.py's set_threads does, said here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CpuOversubscribed)
        final = base_model(replace(BASE_RECIPE, steps=steps), root=root, log=lambda m: None)
    rows = [json.loads(line) for line in (final.parent / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in rows if "loss" in r]
    gaps = [b - a for a, b in zip(times, times[1:])][WARMUP:]
    warned = [str(w.message) for w in caught if w.category is CpuOversubscribed]
    print(json.dumps({"kind": kind, "threads": torch.get_num_threads(), "why": said,
                      "s_per_step": statistics.median(gaps), "steps": len(gaps),
                      "warned": warned[0].split(" of the time")[0].split("waited for a CPU ")[-1] if warned else ""}))


def run_arm(kind: str, template: Path, work: Path, steps: int) -> dict:
    root = work / f"{kind}-{time.monotonic_ns()}"
    shutil.copytree(template, root)  # the tiny model, built once; base_model writes its demos and SFT here
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["FLYWHEEL_CACHE_DIR"] = str(work / "cache")
    done = subprocess.run([sys.executable, __file__, "--arm", kind, "--root", str(root), "--steps", str(steps)],
                          capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode:
        raise SystemExit(f"arm {kind} failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(root, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def pair(template: Path, work: Path, steps: int, busy: bool, flip: bool) -> dict[str, dict]:
    competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR]) if busy else None
    try:
        if competitor:
            time.sleep(1.0)
        kinds = ["chosen", "default"] if flip else ["default", "chosen"]
        return {k: run_arm(k, template, work, steps) for k in kinds}
    finally:
        if competitor:
            competitor.kill()
            competitor.wait()


def _why(arm_result: dict) -> str:
    """'torch threads: 1 (2 CPUs allowed, 1.0 busy ...)' -> '2 CPUs allowed, 1.0 busy ...'."""
    said = " ".join(arm_result["why"])
    return said[said.find("(") + 1:said.rfind(")")] if "(" in said else said


def report(results: list[dict[str, dict]], label: str) -> tuple[list[str], float, float, float]:
    lines = []
    for i, r in enumerate(results, 1):
        d, c = r["default"], r["chosen"]
        lines.append(f"| {label} {i} | {d['threads']} | {d['s_per_step']:.3f} | {d['warned'] or '-'} | "
                     f"{c['threads']} ({_why(c)}) | {c['s_per_step']:.3f} | "
                     f"{c['warned'] or '-'} | {d['s_per_step'] / c['s_per_step']:.2f} |")
    default = [r["default"]["s_per_step"] for r in results]
    chosen = [r["chosen"]["s_per_step"] for r in results]
    ratios = [d / c for d, c in zip(default, chosen)]
    return lines, statistics.median(default), statistics.median(chosen), statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3, help="busy pairs, then idle pairs")
    ap.add_argument("--steps", type=int, default=40, help="SFT steps per arm (the first 5 are warm-up)")
    ap.add_argument("--no-write", action="store_true", help="print, do not append to docs/benchmarks.md")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.arm:
        return arm(args.arm, args.root, args.steps)
    from dataclasses import replace

    from flywheel.demo.base import BASE_RECIPE
    from flywheel.models import TinySpec, build_tiny_model

    work = Path(tempfile.mkdtemp(prefix="flywheel-busy-"))
    try:
        template = work / "template"
        r = replace(BASE_RECIPE, steps=args.steps)
        build_tiny_model(template / f"demo-base-{r.key()}" / "tiny", TinySpec(hidden=r.hidden, layers=r.layers, heads=r.heads, ffn=r.ffn,
                                                     **({"template": r.template} if hasattr(r, "template") else {})))
        busy = [pair(template, work, args.steps, True, i % 2 == 1) for i in range(args.repeats)]
        idle = [pair(template, work, args.steps, False, i % 2 == 1) for i in range(args.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    busy_lines, busy_d, busy_c, busy_ratio = report(busy, "busy")
    idle_lines, idle_d, idle_c, idle_ratio = report(idle, "no competitor")

    def spread(rs, kind):
        return common.median_range([x[kind]["s_per_step"] for x in rs], "{:.3f}")

    body = "\n".join([
        f"Machine: {common.machine_line(0).rsplit(', ', 1)[0]}; threads per arm in the table. "
        f"Demo base recipe (hidden {r.hidden}, {r.layers} layers, {r.heads} heads, batch {r.batch}), "
        f"{args.steps} SFT steps per arm, first {WARMUP} dropped; s/step = median interval of metrics.jsonl "
        f"rows. Busy: one `python -c \"{COMPETITOR}\"` beside the arm. default = torch's default threads "
        "(before issue 35); chosen = flywheel/threads.py's choice (`flywheel model demo-base` now). Other "
        "engineers' work shares this machine too; the pairs are run back to back, order alternating.",
        "", "| pair | default threads | default s/step | warned (wait share) | chosen threads (why) | "
            "chosen s/step | warned | default / chosen |",
        "|---|---|---|---|---|---|---|---|", *busy_lines, *idle_lines, "",
        f"Busy: default {spread(busy, 'default')} s/step, chosen {spread(busy, 'chosen')} s/step, "
        f"ratio {busy_ratio:.2f} (median of pairs). No competitor: default {spread(idle, 'default')}, "
        f"chosen {spread(idle, 'chosen')}, ratio {idle_ratio:.2f}."])
    last = (f"busy_machine: ratio={busy_ratio:.2f} default_s_per_step={busy_d:.3f} chosen_s_per_step={busy_c:.3f} "
            f"idle_ratio={idle_ratio:.2f} idle_default_s_per_step={idle_d:.3f} idle_chosen_s_per_step={idle_c:.3f}")
    common.append_report("bench/busy_machine.py: demo-base SFT beside a busy process, torch's default threads vs "
                         "flywheel's choice", body, last, write=not args.no_write)


if __name__ == "__main__":
    main()
