"""flywheel GRPO vs TRL's GRPOTrainer on the shared `ab+cd=` task: one rule for both.

Both systems start from the same SFT warm start (run until held-out greedy accuracy reaches
`--warm-target`) and train with the same batch shape: 8 prompts x 8 generations per step, at
most 6 new tokens, temperature 1, lr `--lr`, `--steps` steps, each decaying linearly to 0.
flywheel runs its RL recipe: dynamic sampling replaces groups whose rewards are all equal
(up to 3x the groups a step; every sample generated counts in its samples/s), as measured
best by bench/rl_ablation.py.

TRL runs the peer protocol of bench/peers/trl_grpo.py. flywheel runs `flywheel rl`'s own path,
`run_rl`, with one rollout worker process, one step off-policy (`--k`).

Measured the same way for both:
- Evaluation: greedy, on the same 200 held-out pairs (checked: flywheel's arithmetic test
  split is the peer's), at the same schedule (step 0, every `--eval-every` steps, the last
  step), outside the clock.
- Clock: the sum of per-step wall times, evaluations and set-up excluded. For TRL a step is
  generation, reward, loss, backward and optimizer step, from on_step_begin (after the
  trainer's set-up); for flywheel it is waiting for rollouts, the update and the weight
  publish, from after its rollout worker has started (run_rl waits for it before step 1; the
  wait is printed under Checks). The whole run's wall, set-up included, is a column of its own.
- Time to target: the clock at the first evaluation from which every later evaluation stays at
  or above `--target` (the sustained rule; touching it once does not count). A run that
  ends below the target has not reached it.
- samples/s: total samples over total clock.
- `--seeds` seeds each, interleaved (TRL seed s, then flywheel seed s). Reported: the median
  and range of time-to-target, final accuracy and samples/s; the ratio is the median over
  seeds of the same-seed pairs' ratios.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PEER = Path(__file__).resolve().parent / "peers" / "trl_grpo.py"


@dataclass
class Run:
    system: str
    seed: int
    evals: list[tuple[int, float, float]]  # (step, held-out greedy accuracy, clock s at that step)
    train_s: float  # the clock at the end: the sum of all step times
    samples: int
    wall_s: float  # the whole run call, evaluations and start-up included (context only)

    def time_to_target(self, target: float) -> float:
        at = common.sustained_at([a for _, a, _ in self.evals], target)
        return self.evals[at][2] if at is not None else math.inf

    def step_at_target(self, target: float) -> int | None:
        at = common.sustained_at([a for _, a, _ in self.evals], target)
        return self.evals[at][0] if at is not None else None

    @property
    def final(self) -> float:
        return self.evals[-1][1]

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.train_s


def speedup(peer_s: float, ours_s: float) -> float:
    """peer time / our time; inf when only we reached the target, 0 when only the peer did,
    nan when neither did."""
    if math.isinf(peer_s) and math.isinf(ours_s):
        return math.nan
    return math.inf if math.isinf(peer_s) else (0.0 if math.isinf(ours_s) else peer_s / ours_s)


def warm_start(target: float, first: int = 200, every: int = 25, most: int = 1000) -> tuple[Path, int, float]:
    """SFT warm start (constant lr after warm-up), run until the held-out greedy accuracy first
    reaches `target` (checked every `every` steps after `first`), cached. Returns (model, steps,
    accuracy). A step count alone is not portable: this model learns addition abruptly, and
    300 steps gave 0.09 or 0.225 with different initialisations."""
    from flywheel.models import load
    from flywheel.train.env_eval import arithmetic_heldout_accuracy

    out = common.WORK / f"sft-until-{target:g}"
    done = out / "reached.json"
    if done.exists():
        info = json.loads(done.read_text())
        return out / "final", info["steps"], info["accuracy"]
    steps, acc = first, 0.0
    while steps <= most:
        final = common.arith_sft(out, steps, warmup_steps=100, min_lr_ratio=1.0)
        acc = arithmetic_heldout_accuracy(*load(final))["heldout_accuracy"]
        if acc >= target:
            done.write_text(json.dumps({"steps": steps, "accuracy": acc}))
            return out / "final", steps, acc
        steps += every
    sys.exit(f"the SFT warm start did not reach held-out {target} in {most} steps (last: {acc:.3f})")


def check_same_heldout() -> None:
    """flywheel's arithmetic test tasks are exactly the peer's 200 held-out prompts."""
    sys.path.insert(0, str(PEER.parent))
    import trl_grpo
    from flywheel.envs import load_env

    ours = sorted(t.prompt for t in load_env("arithmetic").tasks("test"))
    peer = sorted(trl_grpo.prompt_of(a, b) for a, b in trl_grpo.split_pairs()[1])
    if ours != peer:
        sys.exit("flywheel's arithmetic test split is not the peer's held-out set: the comparison would be unfair")


def run_trl(model: Path, seed: int, args, threads: int) -> Run:
    work = common.WORK / "trl"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    summary = work / "summary.json"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, str(PEER), "--model", str(model), "--out", str(summary), "--work", str(work),
                    "--steps", str(args.steps), "--lr", str(args.lr), "--seed", str(seed),
                    "--eval-every", str(args.eval_every), "--threads", str(threads)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    s = json.loads(summary.read_text())
    evals = [(e["step"], e["accuracy"], e["train_s"]) for e in s["evaluations"]]
    return Run("TRL", seed, evals, s["train_s"], s["samples"], wall)


def flywheel_config(model: Path, out: Path, seed: int, steps: int, lr: float, k: int, eval_every: int,
                    threads: int, overrides: dict | None = None) -> dict:
    """flywheel's run of this protocol as an RLConfig dict; `overrides` (section -> settings)
    change one thing at a time (bench/rl_ablation.py)."""
    cfg = dict(model=str(model), output_dir=str(out), env={"name": "arithmetic"},
               train={"steps": steps, "groups_per_step": 8, "group_size": 8, "seed": seed},
               sampling={"temperature": 1.0, "max_tokens": 6},
               # flywheel's RL recipe: dynamic sampling (refilled) and RL's default linear decay to 0,
               # the winners of bench/rl_ablation.py
               algo={"advantage": "grpo", "eps_low": 0.2, "eps_high": 0.2, "dynamic_sampling": True},
               optim={"lr": lr, "warmup_steps": 0, "min_lr_ratio": 0.0, "weight_decay": 0.0},
               eval={"every": eval_every, "tasks": 200, "pass_k": 1}, checkpoint={"every": 0},
               log={"progress": False}, max_off_policy_steps=k, rollout={"threads": 1},
               threads=threads if k == 0 else max(1, threads - 1))  # the same thread budget
    for section, settings in (overrides or {}).items():
        cfg[section] = {**cfg[section], **settings} if isinstance(settings, dict) else settings
    return cfg


def run_flywheel(model: Path, seed: int, args, threads: int, overrides: dict | None = None) -> tuple[Run, dict]:
    from flywheel.config import RLConfig, validate
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    out = common.WORK / "flywheel-rl"
    shutil.rmtree(out, ignore_errors=True)
    k = (overrides or {}).get("max_off_policy_steps", args.k)
    cfg = validate(flywheel_config(model, out, seed, args.steps, args.lr, k, args.eval_every, threads, overrides),
                   RLConfig)
    t0 = time.perf_counter()
    run_rl(cfg, log=lambda m: None)
    wall = time.perf_counter() - t0
    records = read_metrics(out / "metrics.jsonl")
    step_s = {r["step"]: r["time/step_s"] for r in records if "time/step_s" in r}
    wait_s = {r["step"]: r["time/rollout_wait_s"] for r in records if "time/rollout_wait_s" in r}
    if sorted(step_s) != list(range(1, args.steps + 1)):
        sys.exit("flywheel's metrics.jsonl lacks some steps' times (log.every must be 1)")
    clock, evals = {0: 0.0}, []
    for s in range(1, args.steps + 1):
        clock[s] = clock[s - 1] + step_s[s]
    for r in records:
        if "eval/greedy_accuracy" in r:
            evals.append((r["step"], r["eval/greedy_accuracy"], clock[r["step"]]))
    # the rollout worker keeps generating while the learner evaluates: how much of the next step's
    # wait that saves is the evaluations' effect on flywheel's clock. The worker's start-up is
    # outside the clock, as TRL's trainer set-up is outside its (run_rl waits for it before step 1
    # and records the wait in step 1's row)
    after = [wait_s[s + 1] for s, _, _ in evals if s > 0 and s + 1 in wait_s]
    others = [w for s, w in wait_s.items() if s > 1 and (s - 1) % args.eval_every]
    bias = dict(wait_after_eval_ms=1000 * statistics.mean(after) if after else math.nan, wait_other_ms=1000 * statistics.mean(others),
                startup_wait_s=next(r["time/startup_wait_s"] for r in records if "time/startup_wait_s" in r),
                final_model=out / "final")
    # every group generated for training: those dynamic sampling discarded count, and those the
    # buffer dropped as too stale (a running total), 8 samples each
    steps = [r for r in records if "time/step_s" in r]
    samples = sum(8 * (r.get("groups", 8) + r.get("rollout/discarded_groups", 0)) for r in steps)
    samples += 8 * int(max((r.get("buffer/dropped_groups", 0) for r in steps), default=0))
    return Run("flywheel", seed, evals, clock[args.steps], int(samples), wall), bias


def peer_accuracy(model_dir: Path) -> float:
    """The peer's own evaluator (HF generate) on a model folder: the cross-check of the two evaluators."""
    import torch
    import trl_grpo
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return trl_grpo.greedy_accuracy(model, AutoTokenizer.from_pretrained(model_dir), trl_grpo.split_pairs()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-4, help="both systems' learning rate")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--target", type=float, default=0.75, help="the held-out greedy accuracy both must hold")
    ap.add_argument("--k", type=int, default=1, help="flywheel's max_off_policy_steps (0 = synchronous)")
    ap.add_argument("--warm-target", type=float, default=0.35,
                    help="the SFT warm start runs until held-out greedy accuracy reaches this")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--flywheel", type=json.loads, default={}, metavar="JSON",
                    help='flywheel settings changed from the protocol\'s, by section, e.g. '
                         '\'{"algo": {"dynamic_sampling": true}}\' (bench/rl_ablation.py measures each alone)')
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    check_same_heldout()
    model, sft_steps, sft_acc = warm_start(args.warm_target)
    runs: list[tuple[Run, Run, dict]] = []
    for seed in args.seeds:
        trl = run_trl(model, seed, args, threads)
        fw, bias = run_flywheel(model, seed, args, threads, args.flywheel)
        bias["peer_eval_of_final"] = peer_accuracy(bias.pop("final_model"))
        runs.append((trl, fw, bias))
        print(f"seed {seed}: TRL {trl.time_to_target(args.target):.1f} s to target, final {trl.final:.3f}; "
              f"flywheel {fw.time_to_target(args.target):.1f} s, final {fw.final:.3f}", flush=True)

    t = args.target
    ratios = [speedup(trl.time_to_target(t), fw.time_to_target(t)) for trl, fw, _ in runs]
    sps_ratios = [fw.samples_per_s / trl.samples_per_s for trl, fw, _ in runs]
    mode = ("synchronous" if args.k == 0 else
            f"{args.k} step off-policy; learner {max(1, threads - 1)} thread(s) + 1 rollout worker process, 1 thread")
    if args.flywheel:
        mode += f"; {json.dumps(args.flywheel)}"

    def row(system: str, rs: list[Run]) -> str:
        return (f"| {system} | {common.median_range([r.time_to_target(t) for r in rs], '{:.1f}')} | "
                f"{', '.join(str(r.step_at_target(t)) for r in rs)} | "
                f"{common.median_range([r.final for r in rs], '{:.3f}')} | "
                f"{common.median_range([r.samples_per_s for r in rs], '{:.0f}')} | "
                f"{common.median_range([r.train_s for r in rs], '{:.1f}')} | "
                f"{common.median_range([r.wall_s for r in rs], '{:.1f}')} |")

    curves = [f"- {r.system} seed {r.seed}: " + ", ".join(f"{s}: {a:.3f}" for s, a, _ in r.evals)
              for trl, fw, _ in runs for r in (trl, fw)]
    checks = [f"seed {fw.seed}: flywheel's final model {fw.final:.3f} by its own evaluator, "
              f"{b['peer_eval_of_final']:.3f} by the peer's; rollout wait in the step after an evaluation "
              f"{b['wait_after_eval_ms']:.1f} ms vs {b['wait_other_ms']:.1f} ms in other steps after the first; "
              f"worker start-up still waited for before step 1 (after the learner's build and step 0's "
              f"evaluation), outside the clock: {b['startup_wait_s']:.2f} s"
              for _, fw, b in runs]
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Warm start: {sft_steps} SFT steps, held-out greedy {sft_acc:.3f}. "
        f"Both: 8 prompts x 8 generations, <= 6 tokens, {args.steps} steps, lr {args.lr:g}, evaluated greedy on the "
        f"same 200 held-out pairs at step 0, every {args.eval_every} steps and the last, outside the clock. "
        f"flywheel: {mode}, dynamic sampling, linear to 0; TRL GRPOTrainer "
        f"(bench/peers/trl_grpo.py), linear to 0. Target: held-out greedy >= {t:.2f} from some evaluation to the end "
        f"of the run (sustained). Seeds {', '.join(map(str, args.seeds))}; median (range).", "",
        "| system | time to target (clock) | step at target, per seed | final held-out | samples/s | "
        "clock, whole run | run wall incl. evals and start-up |",
        "|---|---|---|---|---|---|---|",
        row("TRL GRPOTrainer", [trl for trl, _, _ in runs]),
        row(f"flywheel rl ({mode})", [fw for _, fw, _ in runs]), "",
        f"Time-to-target ratio TRL / flywheel per seed: {', '.join(f'{r:.2f}' for r in ratios)}; "
        f"samples/s ratio per seed: {', '.join(f'{r:.2f}' for r in sps_ratios)}.", "",
        "Checks:", *[f"- {c}" for c in checks], "", "Evaluations (step: accuracy):", *curves])
    last = (f"rl_vs_trl: ratio={statistics.median(ratios):.2f} ratio_min={min(ratios):.2f} "
            f"ratio_max={max(ratios):.2f} samples_ratio={statistics.median(sps_ratios):.2f} seeds={len(runs)} "
            f"rule=sustained target={t:.2f} "
            f"flywheel_time_to_target_s={statistics.median([fw.time_to_target(t) for _, fw, _ in runs]):.1f} "
            f"trl_time_to_target_s={statistics.median([trl.time_to_target(t) for trl, _, _ in runs]):.1f} "
            f"flywheel_final={statistics.median([fw.final for _, fw, _ in runs]):.3f} "
            f"trl_final={statistics.median([trl.final for trl, _, _ in runs]):.3f} "
            f"k={args.k} lr={args.lr:g} warm_start={sft_acc:.3f} threads={threads}")
    common.append_report("bench/rl_vs_trl.py: flywheel GRPO vs TRL GRPOTrainer, one rule for both", body, last,
                         write=not args.no_report)


if __name__ == "__main__":
    main()
