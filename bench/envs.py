"""Environment throughput: 1,000 concurrent calculator episodes with the scripted policy
(no model), env steps/s and step latency, against a plain-asyncio reference in the same run.

The reference does the same work per step without the env layer: the scripted policy's
text, a regex for the call, the calculator's evaluator, a final-answer check. The ratio says
what the Env API (parsing, validation, limits, rubric, metrics) costs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def run_flywheel(env, tasks, concurrency):
    from flywheel.rollout.play import play

    t0 = time.perf_counter()
    results = asyncio.run(play(env, tasks, env.scripted_policy(), concurrency=concurrency))
    dt = time.perf_counter() - t0
    steps = sum(r.steps for r in results)
    lat = sorted(x for r in results for x in r.step_latencies_s)
    assert all(r.reward == 1.0 for r in results), "scripted calculator episodes must all succeed"
    return steps / dt, lat[len(lat) // 2], lat[int(len(lat) * 0.99)]


def run_reference(tasks, concurrency):
    from flywheel.envs.calculator import evaluate, final_number

    call = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
    gate = asyncio.Semaphore(concurrency)

    async def episode(task):
        async with gate:
            text = f'<tool_call>\n{json.dumps({"name": "calc", "arguments": {"expression": task.metadata["expression"]}})}\n</tool_call>'
            args = json.loads(call.search(text).group(1))["arguments"]
            result = str(evaluate(args["expression"]))
            await asyncio.sleep(0)
            return float(final_number(f"The answer is {result}.") == task.answer)

    async def main():
        return await asyncio.gather(*(episode(t) for t in tasks))

    t0 = time.perf_counter()
    rewards = asyncio.run(main())
    assert all(r == 1.0 for r in rewards)
    return 2 * len(tasks) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--episodes", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    threads = common.set_threads(args.threads)
    from flywheel.envs import load_env

    env = load_env("calculator")
    tasks = env.tasks("test", n=args.episodes)
    run_flywheel(env, tasks[:50], 50)  # warm-up
    ours, p50s, p99s, ref = [], [], [], []
    for _ in range(args.repeats):
        sps, p50, p99 = run_flywheel(env, tasks, args.episodes)
        ours.append(sps), p50s.append(p50), p99s.append(p99)
        ref.append(run_reference(tasks, args.episodes))
    o, r = statistics.median(ours), statistics.median(ref)
    body = "\n".join([
        f"Machine: {common.machine_line(threads)}. {args.episodes} calculator episodes at once (2 env steps each: "
        f"a tool call, then the answer), scripted policy, {args.repeats} repeats; medians.", "",
        "| system | env steps/s | step latency p50 | p99 |", "|---|---|---|---|",
        f"| flywheel Env API (ToolEnv + runner) | {o:,.0f} | {statistics.median(p50s) * 1e6:.0f} us | "
        f"{statistics.median(p99s) * 1e6:.0f} us |",
        f"| bare asyncio, same work without the env layer | {r:,.0f} | - | - |"])
    last = (f"envs: steps_per_s={o:.0f} p99_step_ms={statistics.median(p99s) * 1e3:.3f} "
            f"reference_steps_per_s={r:.0f} ratio={o / r:.2f} episodes={args.episodes}")
    common.append_report("bench/envs.py: 1,000 concurrent calculator episodes", body, last)


if __name__ == "__main__":
    main()
