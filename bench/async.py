"""Asynchronous (one step off-policy) vs synchronous RL, same run, same model, same batch shape.

The peer is flywheel itself with `max_off_policy_steps=0` (generation in the learner's process,
then the update); the candidate is `max_off_policy_steps=1` with one rollout worker process
generating step s + 1 while step s trains. Measured: steady-state samples/s, the median over
steps after the first `--skip` of each run (start-up and the first evaluation excluded),
runs interleaved sync / async `--repeats` times.

Two workloads:
  - calculator: multi-turn tool use where every `calc` call takes `--tool-latency-s` (a tool
    that takes real time); the warm start is an SFT on the environment's scripted demos, so
    the policy does call the tool. Here the worker waits on tools while the learner trains.
  - arithmetic: the shared `ab+cd=` task, one turn, no tools. On 2 cores generation is a
    small share of a step there, so little is expected.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def run(model: Path, env: dict, k: int, steps: int, groups: int, group_size: int, max_tokens: int,
        threads: int) -> list[dict]:
    from flywheel.config import RLConfig, validate
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    out = common.WORK / f"async-k{k}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = validate(dict(model=str(model), output_dir=str(out), env=env,
                        train={"steps": steps, "groups_per_step": groups, "group_size": group_size},
                        sampling={"temperature": 1.0, "max_tokens": max_tokens},
                        optim={"lr": 1e-5}, eval={"tasks": 1}, checkpoint={"every": 0},
                        log={"progress": False}, max_off_policy_steps=k, rollout={"threads": 1},
                        threads=threads if k == 0 else max(1, threads - 1)), RLConfig)  # the same thread budget
    run_rl(cfg, log=lambda m: None)
    return [r for r in read_metrics(out / "metrics.jsonl") if "time/step_s" in r]


def calculator_rl(model: Path, steps: int, threads: int) -> tuple[float, float]:
    """Held-out greedy success (100 test tasks) before and after `steps` of GRPO with
    configs/calculator_grpo.yaml's settings, one step off-policy."""
    from flywheel.config import RLConfig, load_config
    from flywheel.train.rl import run_rl

    out = common.WORK / "calculator-rl"
    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(common.ROOT / "configs" / "calculator_grpo.yaml", RLConfig, [
        f"model={model}", f"output_dir={out}", f"train.steps={steps}", "eval.every=0", "eval.pass_k=1",
        "checkpoint.every=0", "log.progress=false", "max_off_policy_steps=1", f"threads={max(1, threads - 1)}"])
    result = run_rl(cfg, log=lambda m: None)
    return result.evals[0]["eval/greedy_accuracy"], result.evals[-1]["eval/greedy_accuracy"]


def measure(name: str, model: Path, env: dict, args, groups: int, group_size: int, max_tokens: int,
            threads: int) -> dict:
    sps = {0: [], 1: []}
    split = {0: [], 1: []}
    for _ in range(args.repeats):
        for k in (0, 1):
            records = run(model, env, k, args.steps, groups, group_size, max_tokens, threads)[args.skip:]
            sps[k].append(statistics.median(r["samples_per_s"] for r in records))
            split[k].append({key: statistics.median(r.get(key, 0.0) for r in records)
                             for key in ("time/rollout_wait_s", "time/train_s", "rollout/generate_s",
                                         "staleness_mean", "reward_mean")})
    med = {k: statistics.median(v) for k, v in sps.items()}
    return {"name": name, "sync": med[0], "async": med[1], "ratio": med[1] / med[0], "runs": sps,
            "split": {k: split[k][-1] for k in split}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--skip", type=int, default=4, help="first steps of each run left out of the median")
    ap.add_argument("--tool-latency-s", type=float, default=0.02)
    ap.add_argument("--calculator-demos", type=int, default=4000)
    ap.add_argument("--calculator-rl-steps", type=int, default=100)
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    from flywheel.train.warm_starts import calculator_warm_start

    calc_model = calculator_warm_start(common.WORK / "calculator", args.calculator_demos)
    results = [
        measure("calculator", calc_model, {"name": "calculator", "settings": {"tool_latency_s": args.tool_latency_s,
                                                                "chain_prob": 0.0}},
                args, groups=4, group_size=8, max_tokens=128, threads=threads),
        measure("arithmetic", common.warm_model(), {"name": "arithmetic"}, args, groups=8, group_size=8,
                max_tokens=6, threads=threads),
    ]
    rows = ["| workload | sync samples/s | async (k=1) samples/s | ratio | sync: wait / train s | "
            "async: wait / train / worker generate s | reward |", "|---|---|---|---|---|---|---|"]
    for r in results:
        s0, s1 = r["split"][0], r["split"][1]
        rows.append(f"| {r['name']} | {r['sync']:.1f} | {r['async']:.1f} | {r['ratio']:.2f} | "
                    f"{s0['time/rollout_wait_s']:.3f} / {s0['time/train_s']:.3f} | "
                    f"{s1['time/rollout_wait_s']:.3f} / {s1['time/train_s']:.3f} / {s1['rollout/generate_s']:.3f} | "
                    f"{s1['reward_mean']:.2f} |")
    calc, arith = results
    rl_before, rl_after = calculator_rl(calc_model, args.calculator_rl_steps, threads)
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Each run: {args.steps} steps, median samples/s over steps "
        f"after the first {args.skip}; sync and async runs interleaved, {args.repeats} each (medians of runs). "
        f"Calculator (a * b, 3-4 digits): 4 tasks x 8 attempts per step, <= 128 tokens per turn, every calc "
        f"call sleeps {args.tool_latency_s * 1000:.0f} ms; warm start: configs/sft_calculator.yaml's two-stage "
        f"SFT on {args.calculator_demos} scripted demos. Arithmetic: 8 x 8, <= 6 tokens. Learner threads {threads}; "
        "the async run splits them: learner threads - 1, worker 1.", "", *rows, "",
        f"Calculator RL (configs/calculator_grpo.yaml, {args.calculator_rl_steps} steps, one step off-policy, "
        f"no tool latency): held-out greedy success {rl_before:.2f} -> {rl_after:.2f} (100 test tasks).", "",
        "Per-run samples/s: " + "; ".join(f"{r['name']} sync {['%.1f' % x for x in r['runs'][0]]}, "
                                         f"async {['%.1f' % x for x in r['runs'][1]]}" for r in results)])
    last = (f"async: ratio={calc['ratio']:.2f} arithmetic_ratio={arith['ratio']:.2f} "
            f"calculator_sync_sps={calc['sync']:.1f} calculator_async_sps={calc['async']:.1f} "
            f"calculator_success_before={rl_before:.2f} calculator_success_after={rl_after:.2f} "
            f"tool_latency_ms={args.tool_latency_s * 1000:.0f} threads={threads}")
    common.append_report("bench/async.py: one step off-policy vs synchronous RL", body, last)


if __name__ == "__main__":
    main()
