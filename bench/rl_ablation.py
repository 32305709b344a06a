"""Which of flywheel's RL choices make it learn faster per step: one difference at a time.

The protocol is bench/rl_vs_trl.py's (same warm start, task, batch shape, lr, held-out
evaluation and sustained-target rule). Every variant below is the baseline (flywheel as that
benchmark ran it before this ablation) with one setting changed; TRL's GRPOTrainer runs on the same seeds as the peer row. Reported per
variant over `--seeds`: the step at which the held-out greedy accuracy reaches `--target` and
stays there (per seed and median), the final accuracy, the accuracy at `--early` steps, and
the samples generated per step. Clock times are not compared here (bench/rl_vs_trl.py does
that on a quiet machine); learning per step is, so this may run beside other work.

What the variants are, and what peers report of each:
- sync: max_off_policy_steps 0 (TRL's on-policy step) against the benchmark's 1 step off-policy
  with truncated importance sampling (Yao et al. 2025).
- linear: TRL's linear decay to 0 against flywheel's cosine.
- dynamic: DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): groups whose rewards
  are all equal are replaced by new tasks, up to 3x the groups a step.
- dynamic_linear: dynamic sampling with linear decay, the two that helped alone.
- dr_grpo: advantages not divided by the group's std (Liu et al. 2025, arXiv:2503.20783).
- sequence: the loss averaged per sequence, then over sequences (the original GRPO), against
  the token mean (DAPO's, TRL 1.16's default `dapo`).
- minibatches2: two optimizer updates per step on half the groups each, the PPO ratio to the
  step's start (more updates per sample; ScaleRL-style off-policy reuse).
- minibatches2_cispo: the same with CISPO's clipped, detached weight (MiniMax-M1).
Not run, because they cannot change this benchmark: eps_high > eps_low (clip-higher) and CISPO
at one minibatch (the ratio is 1: nothing is clipped, as in TRL's num_iterations=1); dropping
solved prompts (`train.drop_solved`: 500 steps x 8 tasks never revisit one of the 9,800); FP32
logits (the learner already computes its logprobs in fp32 on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import rl_vs_trl  # noqa: E402

# The baseline is flywheel as bench/rl_vs_trl.py ran it before this ablation (cosine decay, no
# dynamic sampling); every other variant changes one thing from it (dynamic_linear: two).
BASELINE = {"algo": {"dynamic_sampling": False}, "optim": {"decay": "cosine"}}


def _from_baseline(**changes: dict) -> dict:
    return {section: {**BASELINE.get(section, {}), **settings} if isinstance(settings, dict) else settings
            for section, settings in {**BASELINE, **changes}.items()}


VARIANTS: dict[str, tuple[str, dict]] = {
    "baseline": ("1 step off-policy, cosine to 0, GRPO, token mean, no dynamic sampling", BASELINE),
    "sync": ("synchronous (max_off_policy_steps 0)", _from_baseline(max_off_policy_steps=0)),
    "linear": ("linear decay to 0 (TRL's schedule)", _from_baseline(optim={"decay": "linear"})),
    "dynamic": ("dynamic sampling, up to 3x groups a step", _from_baseline(algo={"dynamic_sampling": True})),
    "dynamic_linear": ("dynamic sampling and TRL's linear decay (the two best alone): flywheel's recipe",
                       _from_baseline(algo={"dynamic_sampling": True}, optim={"decay": "linear"})),
    "batch_std": ("flywheel's recipe, advantages scaled by the step's batch std (ScaleRL), not each group's",
                  _from_baseline(algo={"dynamic_sampling": True, "advantage": "grpo_batch"}, optim={"decay": "linear"})),
    "dr_grpo": ("advantages not scaled by the group std", _from_baseline(algo={"advantage": "dr_grpo"})),
    "sequence": ("per-sequence mean loss", _from_baseline(algo={"aggregation": "sequence"})),
    "minibatches2": ("2 updates a step, PPO clip 0.2", _from_baseline(train={"minibatches": 2})),
    "minibatches2_cispo": ("2 updates a step, CISPO weight clipped to [0.8, 1.2]",
                           _from_baseline(train={"minibatches": 2}, algo={"objective": "cispo"})),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--k", type=int, default=1, help="the baseline's max_off_policy_steps")
    ap.add_argument("--target", type=float, default=0.75)
    ap.add_argument("--early", type=int, default=50, help="also report the accuracy at this step")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--warm-target", type=float, default=0.35)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-trl", action="store_true", help="skip the peer row")
    ap.add_argument("--no-report", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    rl_vs_trl.check_same_heldout()
    model, sft_steps, sft_acc = rl_vs_trl.warm_start(args.warm_target)
    rows: dict[str, list[rl_vs_trl.Run]] = {}
    if not args.no_trl:
        rows["TRL GRPOTrainer"] = [rl_vs_trl.run_trl(model, s, args, threads) for s in args.seeds]
        print(f"TRL: {[r.step_at_target(args.target) for r in rows['TRL GRPOTrainer']]}", flush=True)
    for name in args.variants:
        rows[name] = [rl_vs_trl.run_flywheel(model, s, args, threads, VARIANTS[name][1])[0] for s in args.seeds]
        print(f"{name}: {[r.step_at_target(args.target) for r in rows[name]]}", flush=True)

    def at(run: rl_vs_trl.Run, step: int) -> float:
        return next(a for s, a, _ in run.evals if s >= step)

    def step_or_inf(run: rl_vs_trl.Run) -> float:
        step = run.step_at_target(args.target)
        return float("inf") if step is None else float(step)

    lines = ["| run | what differs | step at target, per seed | median step at target | "
             f"accuracy at step {args.early} | final held-out | samples a step |", "|---|---|---|---|---|---|---|"]
    for name, runs in rows.items():
        what = VARIANTS[name][0] if name in VARIANTS else "the peer (bench/peers/trl_grpo.py), linear to 0"
        lines.append(f"| {name} | {what} | {', '.join(str(r.step_at_target(args.target)) for r in runs)} | "
                     f"{common.median_range([step_or_inf(r) for r in runs], '{:.0f}')} | "
                     f"{common.median_range([at(r, args.early) for r in runs], '{:.3f}')} | "
                     f"{common.median_range([r.final for r in runs], '{:.3f}')} | "
                     f"{statistics.median([r.samples / args.steps for r in runs]):.0f} |")
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Warm start: {sft_steps} SFT steps, held-out greedy {sft_acc:.3f}. "
        f"Every run: 8 prompts x 8 generations, <= 6 tokens, {args.steps} steps, lr {args.lr:g}, greedy evaluation "
        f"on the same 200 held-out pairs every {args.eval_every} steps; target {args.target:.2f} sustained to the "
        f"end. Seeds {', '.join(map(str, args.seeds))}; median (range). Steps, not seconds: runs may share the "
        "machine.", "", *lines, "", "Evaluations (step: accuracy):",
        *[f"- {name} seed {r.seed}: " + ", ".join(f"{s}: {a:.3f}" for s, a, _ in r.evals)
          for name, runs in rows.items() for r in runs]])
    flywheel_rows = {n: rs for n, rs in rows.items() if n in VARIANTS}
    best = min(flywheel_rows, key=lambda n: (statistics.median([step_or_inf(r) for r in flywheel_rows[n]]),
                                             -statistics.median([r.final for r in flywheel_rows[n]])))
    medians = " ".join(f"{n}={statistics.median([step_or_inf(r) for r in rs]):.0f}" for n, rs in rows.items()
                       if n in VARIANTS)
    trl = rows.get("TRL GRPOTrainer")
    last = (f"rl_ablation: best={best} {medians} "
            + (f"trl={statistics.median([step_or_inf(r) for r in trl]):.0f} " if trl else "")
            + f"seeds={len(args.seeds)} steps={args.steps} target={args.target:.2f}")
    common.append_report("bench/rl_ablation.py: flywheel's RL choices one at a time, steps to target",
                         body, last, write=not args.no_report)


if __name__ == "__main__":
    main()
