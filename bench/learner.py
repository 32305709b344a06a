"""Where the RL learner runs, the same run otherwise: in the driver process, as local rank
processes (`train.strategy: fsdp2`, 1 and 2 ranks) and as a Ray actor
(`rollout.ray.learner: actors`), in one run.

The run: arithmetic GRPO from the peer protocol's tiny model (Qwen2, hidden 256, 4 layers),
S steps of 8 groups of 8, max_tokens 6, one step off-policy, one rollout worker process
(the Ray variant: one rollout actor on this node), the same seed; the learner 1 torch thread
per rank. Per run, over the steps after the first two (start-up, the first evaluation and
the first weights left out, the same for all): samples/s = samples trained / the wall time of
those steps; train ms = median `time/train_s` (the update, its round trip to the ranks
included); sync ms = median `time/weight_sync_s` (the new weights gathered to rank 0, brought
to the driver and published to the rollout workers). Rounds rotate which variant goes first;
quoted: median (range) over rounds. This machine has 2 cores: two ranks and a rollout worker
share them, so the 2-rank figure measures the sharded path's overhead, not a speed-up.

Smoke run (prints, appends nothing): `python bench/learner.py --smoke`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VARIANTS = {  # name -> (train settings, rollout settings)
    "driver": ({}, {}),
    "1 local rank (fsdp2)": ({"strategy": "fsdp2", "world_size": 1}, {}),
    "2 local ranks (fsdp2)": ({"strategy": "fsdp2", "world_size": 2}, {}),
    "1 Ray actor": ({}, {"backend": "ray", "ray": {"learner": "actors", "learner_cpus": 0.5, "worker_cpus": 0.5}}),
}


def run(model: Path, out: Path, steps: int, train: dict, rollout: dict) -> dict[str, float]:
    from flywheel.config import RLConfig, validate
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    cfg = validate(dict(
        model=str(model), output_dir=str(out), env={"name": "arithmetic"},
        train={"steps": steps, "groups_per_step": 8, "group_size": 8, "seed": 0, **train},
        sampling={"temperature": 1.0, "max_tokens": 6}, optim={"lr": 1e-4}, eval={"tasks": 20},
        log={"progress": False}, checkpoint={"every": 0}, threads=1, max_off_policy_steps=1,
        rollout={"workers": 1, "threads": 1, **rollout}), RLConfig)
    run_rl(cfg, log=lambda m: None)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "time/step_s" in r and r["step"] > 2]
    return {"samples_s": 64 * len(rows) / sum(r["time/step_s"] for r in rows),
            "train_ms": 1e3 * statistics.median(r["time/train_s"] for r in rows),
            "sync_ms": 1e3 * statistics.median(r["time/weight_sync_s"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--smoke", action="store_true", help="a short run that writes nothing")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps = 1, 4
    threads = common.set_threads(1)

    import ray

    ray.init(num_cpus=2, include_dashboard=False, namespace="bench-learner", log_to_driver=False)
    model = common.tiny_model()
    work = common.WORK / "learner"
    got: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    try:
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                train, rollout = VARIANTS[name]
                result = run(model, work / f"{r}-{time.time_ns()}", args.steps, train, rollout)
                got[name].append(result)
                print(f"round {r} {name}: " + ", ".join(f"{k}={v:.1f}" for k, v in result.items()), flush=True)
    finally:
        ray.shutdown()
    mr = common.median_range
    lines = [f"Machine: {common.machine_line(threads)}, ray {ray.__version__}. {args.rounds} rounds of "
             f"{args.steps} steps (8 groups of 8, max_tokens 6, one step off-policy, one rollout worker); "
             "steps 3 on. Figures: median (range, n).", "",
             "| learner | samples/s | train ms / step | weight sync ms / step |", "|---|---|---|---|"]
    for name, rows in got.items():
        lines.append(f"| {name} | {mr([x['samples_s'] for x in rows], '{:.1f}')} | "
                     f"{mr([x['train_ms'] for x in rows], '{:.0f}')} | {mr([x['sync_ms'] for x in rows], '{:.1f}')} |")

    def med(name: str, key: str) -> float:
        return statistics.median(x[key] for x in got[name])

    last = (f"learner: driver_samples_s={med('driver', 'samples_s'):.1f} "
            f"ranks1_samples_s={med('1 local rank (fsdp2)', 'samples_s'):.1f} "
            f"ranks2_samples_s={med('2 local ranks (fsdp2)', 'samples_s'):.1f} "
            f"ray_actor_samples_s={med('1 Ray actor', 'samples_s'):.1f} "
            f"driver_sync_ms={med('driver', 'sync_ms'):.1f} ranks1_sync_ms={med('1 local rank (fsdp2)', 'sync_ms'):.1f} "
            f"ray_actor_sync_ms={med('1 Ray actor', 'sync_ms'):.1f} rounds={args.rounds}")
    common.append_report("bench/learner.py: the RL learner in the driver, as local FSDP2 ranks, as a Ray actor",
                         "\n".join(lines), last, write=not args.smoke)


if __name__ == "__main__":
    main()
