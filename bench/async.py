"""Asynchronous (one step off-policy) vs synchronous RL, same run, same model, same batch shape.

The peer is flywheel itself with `max_off_policy_steps=0` (generation in the learner's process,
then the update), at its better generation thread count (1 or all: small-batch decoding is
bound by op dispatch, so one thread is often faster). The candidate is `max_off_policy_steps=1`:
rollout worker processes (1 thread each) generate step s + 1 while step s trains, the learner
on the cores left. Measured: total samples over total training time of each run (the sum of
all its step times, the first steps and slow ones included; evaluations excluded), the
variants interleaved `--repeats` times. Per repeat, ratio = the better async variant / the
better sync variant (each chosen by its median over repeats); reported: the median and range
of the per-repeat ratios. The whole run's wall time (model loads, worker start-up) is shown
beside it as context.

The ceiling: two synchronous runs at once, 1 thread each, independent (no weights shared, no
waiting on each other), their samples/s summed. It is what the two cores give this work when
both are busy with the cheapest arrangement (1-thread kernels, full batches, nothing to
coordinate); an asynchronous run does the same work and more (weight pick-ups, smaller batches
per worker), so its ratio to the synchronous peer can reach this one but should not be expected
past it. Measured in the same repeats, interleaved with the variants.

Two workloads:
  - calculator: multi-turn tool use (bare prompts, "What is a + b?" with 2-3 digit numbers, the
    calc tool) where every call takes `--tool-latency-s`; the policy is the demo's base model
    (flywheel.demo.base, cached), which calls the tool in nearly every episode. A synchronous
    step decodes on one core while the other idles, and waits on the tools; two workers fill
    both cores and each other's tool waits, while the learner trains.
  - arithmetic: the shared `ab+cd=` task, one turn, no tools.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "integration"))  # warm_starts
import common  # noqa: E402
from warm_starts import CALCULATOR_FROM_MEMORY, calculator_from_memory_warm_start  # noqa: E402

CALCULATOR = {"chain_prob": 0.0, "bare_prompt": True, "max_turns": 3, "operator": "+",
              "template": "What is {a} + {b}?", "max_digits": 3}


def variants(threads: int) -> dict[str, dict]:
    """name -> (k, rollout workers, learner threads, generation threads per process)."""
    out = {"sync, generation 1 thread": dict(k=0, workers=0, learner=threads, gen=1)}
    if threads > 1:
        out[f"sync, generation {threads} threads"] = dict(k=0, workers=0, learner=threads, gen=threads)
    learner = max(1, threads - 1)
    out[f"async, 1 worker + learner {learner} thread(s)"] = dict(k=1, workers=1, learner=learner, gen=1)
    out[f"async, 2 workers + learner {learner} thread(s)"] = dict(k=1, workers=2, learner=learner, gen=1)
    return out


def run(model: Path, env: dict, v: dict, steps: int, groups: int, group_size: int,
        max_tokens: int, tag: str = "") -> tuple[list[dict], float]:
    """(the per-step metrics records, the wall time of the whole run_rl call)."""
    from flywheel.config import RLConfig, validate
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    out = common.WORK / f"async-k{v['k']}-w{v['workers']}{tag}"
    shutil.rmtree(out, ignore_errors=True)
    cfg = validate(dict(model=str(model), output_dir=str(out), env=env,
                        train={"steps": steps, "groups_per_step": groups, "group_size": group_size},
                        sampling={"temperature": 1.0, "max_tokens": max_tokens},
                        optim={"lr": 1e-5}, eval={"tasks": 1}, checkpoint={"every": 0},
                        log={"progress": False}, max_off_policy_steps=v["k"],
                        rollout={"threads": v["gen"], "workers": v["workers"]}, threads=v["learner"]), RLConfig)
    t0 = time.perf_counter()
    run_rl(cfg, log=lambda m: None)
    wall = time.perf_counter() - t0
    records = [r for r in read_metrics(out / "metrics.jsonl") if "time/step_s" in r]
    if len(records) != steps:
        sys.exit(f"{out}/metrics.jsonl has {len(records)} step records, not {steps}")
    return records, wall


def samples_per_s(records: list[dict], per_step: int) -> float:
    """Samples trained over the steps' summed times (`per_step` samples each)."""
    return per_step * len(records) / sum(r["time/step_s"] for r in records)


ONE_THREAD_SYNC = dict(k=0, workers=0, learner=1, gen=1)


def run_pair(model: Path, env: dict, steps: int, groups: int, group_size: int, max_tokens: int) -> float:
    """The ceiling: two 1-thread synchronous runs started together in their own processes
    (`--one-run`); the sum of their samples / their step times' sums."""
    spec = json.dumps(dict(model=str(model), env=env, steps=steps, groups=groups, group_size=group_size,
                           max_tokens=max_tokens))
    procs = [subprocess.Popen([sys.executable, __file__, "--one-run", spec, f"--tag=-pair{i}"],
                              stdout=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a ceiling run failed: exit codes {[p.returncode for p in procs]}")
    return sum(json.loads(o.strip().splitlines()[-1])["sps"] for o in outs)


def one_run(spec: str, tag: str) -> None:
    """A ceiling half: one 1-thread synchronous run; prints {"sps": ...} as its last line."""
    common.set_threads(1)
    s = json.loads(spec)
    records, _ = run(Path(s["model"]), s["env"], ONE_THREAD_SYNC, s["steps"], s["groups"], s["group_size"],
                     s["max_tokens"], tag=tag)
    print(json.dumps({"sps": samples_per_s(records, s["groups"] * s["group_size"])}))


def calculator_rl(steps: int, threads: int) -> tuple[float, float]:
    """Held-out greedy success (100 test tasks) before and after `steps` of GRPO, one step
    off-policy, from tests/integration/warm_starts.calculator_from_memory_warm_start (a policy
    that answers "What is 12 times 57?" from memory although it can call its calculator; cached)."""
    from flywheel.config import RLConfig, validate
    from flywheel.train.rl import run_rl

    model, _ = calculator_from_memory_warm_start(common.WORK / "calculator-from-memory")
    out = common.WORK / "calculator-rl"
    shutil.rmtree(out, ignore_errors=True)
    cfg = validate(dict(model=str(model), output_dir=str(out),
                        env={"name": "calculator", "settings": CALCULATOR_FROM_MEMORY},
                        train={"steps": steps, "groups_per_step": 4, "group_size": 8},
                        sampling={"temperature": 1.0, "max_tokens": 128}, optim={"lr": 1e-4},
                        eval={"tasks": 100}, checkpoint={"every": 0}, log={"progress": False},
                        max_off_policy_steps=1, threads=max(1, threads - 1)), RLConfig)
    result = run_rl(cfg, log=lambda m: None)
    return result.evals[0]["eval/greedy_accuracy"], result.evals[-1]["eval/greedy_accuracy"]


def measure(name: str, model: Path, env: dict, args, groups: int, group_size: int, max_tokens: int,
            threads: int) -> dict:
    runs = variants(threads)
    sps: dict[str, list[float]] = {n: [] for n in runs}  # total samples / total step time, per repeat
    wall_sps: dict[str, list[float]] = {n: [] for n in runs}  # total samples / run wall, per repeat
    steady: dict[str, list[float]] = {n: [] for n in runs}  # the same without step 1, for every variant alike
    first: dict[str, list[float]] = {n: [] for n in runs}  # step 1's seconds (an async run's include its workers' start)
    split: dict[str, dict] = {}
    ceiling: list[float] = []  # the pair's summed samples/s, per repeat
    for _ in range(args.repeats):
        ceiling.append(run_pair(model, env, args.steps, groups, group_size, max_tokens))
        for n, v in runs.items():
            records, wall = run(model, env, v, args.steps, groups, group_size, max_tokens)
            sps[n].append(samples_per_s(records, groups * group_size))
            wall_sps[n].append(groups * group_size * len(records) / wall)
            steady[n].append(samples_per_s(records[1:], groups * group_size))
            first[n].append(records[0]["time/step_s"])
            split[n] = {key: statistics.median(r.get(key, 0.0) for r in records)
                        for key in ("time/rollout_wait_s", "time/train_s", "rollout/generate_s", "reward_mean")}
    med = {n: statistics.median(v) for n, v in sps.items()}
    best_sync = max((n for n in med if n.startswith("sync")), key=med.get)
    best_async = max((n for n in med if n.startswith("async")), key=med.get)
    ratios = [a / b for a, b in zip(sps[best_async], sps[best_sync])]
    wall_ratios = [a / b for a, b in zip(wall_sps[best_async], wall_sps[best_sync])]
    steady_ratios = [a / b for a, b in zip(steady[best_async], steady[best_sync])]
    # what overlapping generation with training alone could give, from the better sync run's own
    # times: (rollout + learn) / max(rollout, learn) (more workers than one can go past it)
    rollout, learn = split[best_sync]["time/rollout_wait_s"], split[best_sync]["time/train_s"]
    limit = (rollout + learn) / max(rollout, learn, 1e-9)
    ceiling_ratios = [c / b for c, b in zip(ceiling, sps[best_sync])]
    return {"ceiling": ceiling, "ceiling_ratios": ceiling_ratios,
            "ceiling_ratio": statistics.median(ceiling_ratios),
            "ceiling_share": statistics.median(ratios) / statistics.median(ceiling_ratios),
            "name": name, "med": med, "runs": sps, "split": split, "best_sync": best_sync,
            "overlap_limit": limit, "overlap_share": statistics.median(ratios) / limit,
            "best_async": best_async, "ratios": ratios, "ratio": statistics.median(ratios),
            "wall_ratio": statistics.median(wall_ratios), "steady_ratios": steady_ratios,
            "steady_ratio": statistics.median(steady_ratios),
            "first_async_s": statistics.median(first[best_async]), "first_sync_s": statistics.median(first[best_sync])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--tool-latencies-ms", type=float, nargs="+", default=[20.0, 0.0],
                    help="calculator rows, one per latency of every calc call; the first is the headline")
    ap.add_argument("--groups", type=int, default=8, help="calculator tasks per step (x 8 attempts)")
    ap.add_argument("--calculator-rl-steps", type=int, default=20,
                    help="GRPO steps of the held-out success report (calculator from memory); 0 = skip")
    ap.add_argument("--one-run", metavar="JSON", help=argparse.SUPPRESS)  # a ceiling half (run_pair)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_run:
        return one_run(args.one_run, args.tag)
    threads = common.set_threads(args.threads)
    from flywheel.demo.base import base_model

    results = [
        *(measure(f"calculator, tools {ms:g} ms", base_model(), {"name": "calculator", "settings": {
            **CALCULATOR, "tool_latency_s": ms / 1000}},
                  args, groups=args.groups, group_size=8, max_tokens=128, threads=threads)
          for ms in args.tool_latencies_ms),
        measure("arithmetic", common.warm_model(), {"name": "arithmetic"}, args, groups=8, group_size=8,
                max_tokens=6, threads=threads),
    ]
    names = list(results[0]["med"])
    rows = ["| workload | " + " | ".join(f"{n} samples/s" for n in names) + " | ratio, median (range) | "
            "ratio of run walls | without step 1: ratio (range) | step 1 s, async / sync | overlap limit "
            "(sync's own times) | share of it | ceiling samples/s | ceiling / sync, median (range) | "
            "async ratio / ceiling ratio |",
            "|---|" + "---|" * (len(names) + 9)]
    for r in results:
        cells = [f"**{r['med'][n]:.1f}**" if n in (r["best_sync"], r["best_async"]) else f"{r['med'][n]:.1f}"
                 for n in names]
        rows.append(f"| {r['name']} | " + " | ".join(cells) + f" | {r['ratio']:.2f} "
                    f"({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) | {r['wall_ratio']:.2f} | "
                    f"{r['steady_ratio']:.2f} ({min(r['steady_ratios']):.2f}-{max(r['steady_ratios']):.2f}) | "
                    f"{r['first_async_s']:.2f} / {r['first_sync_s']:.2f} | {r['overlap_limit']:.2f} | "
                    f"{r['overlap_share']:.2f} | {statistics.median(r['ceiling']):.1f} | "
                    f"{r['ceiling_ratio']:.2f} ({min(r['ceiling_ratios']):.2f}-{max(r['ceiling_ratios']):.2f}) | "
                    f"{r['ceiling_share']:.2f} |")
    split_rows = ["| workload | variant | learner waits s | learner trains s | generation s (per item) | reward |",
                  "|---|---|---|---|---|---|"]
    for r in results:
        for n in names:
            sp = r["split"][n]
            split_rows.append(f"| {r['name']} | {n} | {sp['time/rollout_wait_s']:.3f} | {sp['time/train_s']:.3f} | "
                              f"{sp['rollout/generate_s']:.3f} | {sp['reward_mean']:.2f} |")
    calc, arith = results[0], results[-1]
    rl_line, rl_before, rl_after = "", float("nan"), float("nan")
    if args.calculator_rl_steps:
        rl_before, rl_after = calculator_rl(args.calculator_rl_steps, threads)
        rl_line = (f"Calculator RL (\"What is a times b?\", 1-2 digits, bare prompts; warm start "
                   "tests/integration/warm_starts.calculator_from_memory_warm_start, which can call calc but "
                   f"answers from memory; GRPO 4 x 8 at temperature 1, lr 1e-4, {args.calculator_rl_steps} steps, one step "
                   f"off-policy, no tool latency): held-out greedy success {rl_before:.2f} -> {rl_after:.2f} "
                   "(100 test tasks).")
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. Each run: {args.steps} steps; samples/s = total samples / "
        f"the sum of all step times; the variants interleaved, {args.repeats} runs each (medians of runs); "
        "ratio = the better async variant / the better sync variant (bold), per repeat, median (range); "
        "ratio of run walls: the same over each run_rl call's wall time (start-up included), median. "
        "Without step 1: the same ratio with every variant's first step left out, context beside the headline "
        "(run_rl starts rollout workers before it builds the learner and waits for them before step 1, off the "
        "step clock; the run-wall ratio still counts that start-up). Overlap limit: (rollout + learn) / "
        "max(rollout, learn) from the better sync run's own median step times, what overlapping the two alone "
        "could give; two workers generating at once can pass it. Ceiling: two 1-thread synchronous runs "
        "started together in their own processes, samples/s summed, per repeat over the better sync variant: "
        "what the two cores give this work with nothing to coordinate. "
        f"Calculator: {args.groups} tasks x 8 attempts per step, <= 128 tokens per turn, bare prompts "
        f"(a + b, 2-3 digits), every calc call sleeps the row's latency; policy: the demo's "
        "base model. Arithmetic: 8 x 8, <= 6 tokens. Threads: a sync run's learner uses all; async runs give "
        "each worker process 1 and the learner the rest (2 workers + learner: 3 processes on the cores).",
        "", *rows, "", *split_rows, "", *([rl_line, ""] if rl_line else []),
        "Per-run samples/s: " + "; ".join(f"{r['name']} " + ", ".join(
            f"{n} {['%.1f' % x for x in r['runs'][n]]}" for n in names) for r in results)])
    others = " ".join(f"ratio_tools_{ms:g}ms={r['ratio']:.2f}" for ms, r in zip(args.tool_latencies_ms, results))
    last = (f"async: ratio={calc['ratio']:.2f} ratio_min={min(calc['ratios']):.2f} "
            f"ratio_max={max(calc['ratios']):.2f} metric=total repeats={args.repeats} {others} "
            f"arithmetic_ratio={arith['ratio']:.2f} steady_ratio={calc['steady_ratio']:.2f} "
            f"arithmetic_steady_ratio={arith['steady_ratio']:.2f} first_step_async_s={calc['first_async_s']:.2f} "
            f"overlap_limit={calc['overlap_limit']:.2f} overlap_share={calc['overlap_share']:.2f} "
            f"arithmetic_overlap_limit={arith['overlap_limit']:.2f} arithmetic_overlap_share={arith['overlap_share']:.2f} "
            f"ceiling_ratio={calc['ceiling_ratio']:.2f} ceiling_share={calc['ceiling_share']:.2f} "
            f"arithmetic_ceiling_ratio={arith['ceiling_ratio']:.2f} "
            f"calculator_sync_sps={calc['med'][calc['best_sync']]:.1f} "
            f"calculator_async_sps={calc['med'][calc['best_async']]:.1f} "
            f"calculator_success_before={rl_before:.2f} calculator_success_after={rl_after:.2f} "
            f"tool_latency_ms={args.tool_latencies_ms[0]:g} threads={threads}")
    common.append_report("bench/async.py: one step off-policy vs synchronous RL", body, last)


if __name__ == "__main__":
    main()
