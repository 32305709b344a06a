"""The same RL run on `rollout.backend: local` and on `rollout.backend: ray` (one node), and the
weight hand-off on Ray (shared memory on the learner's node, the object store beyond it)
against one memcpy, in one run.

Throughput. Arithmetic GRPO from the peer protocol's tiny model (Qwen2, hidden 256, 4 layers,
random weights): S steps of 8 groups of 8, max_tokens 6, one step off-policy, one rollout
worker (local: a worker process; ray: a rollout actor on a Ray instance this script starts
once; both on this node, so both read weights from the run's shared-memory segment), learner and
worker 1 thread each, the same seed. samples/s of a run = samples trained over the wall time
of its steps after the first two (metrics.jsonl `time/step_s`: start-up, the first
evaluation and the first weights are left out, the same for both). Rounds alternate which
backend goes first; the ratio ray / local is paired per round; quoted: median (range).

Weights. The paths `flywheel rl` uses on Ray: `RayRollouts.publish` and the actor's pickup
(`WorkResult.weight_load_s`), for an actor on the learner's node (the run's shared-memory
segment: the engine binds the leased buffer, or reorders from it for packed kernels) and
for one that reads the object store as actors on other nodes do (the learner's tensors put
there, the WeightBoard told; the actor fetches them and `LocalEngine.update_weights`), and
for one in the run's broadcast group (`rollout.ray.weights: broadcast`, gloo here: publish is
the broadcast, which returns once the actor's receiving thread has the bytes; pickup copies
them into the engine), against
`dst.copy_(src)` of every parameter into preallocated tensors (one copy of the bytes). The
pickup's time splits in two (`WorkResult.kernel_rebuild_s`): the bytes reaching the engine
(bind, fetch or receive, and copy) and the engine rebuilding its kernels from them (packed
kernels: oneDNN's reorder, a copy into a blocked layout; dense kernels: nothing to speak of).
Two ratios, per round: hand-off = memcpy / (publish + pickup - rebuild), what the issue's goal
reads (the weights moved); ready = memcpy / (publish + pickup), until the engine decodes on
them. The tiny model and a ~100M-parameter Qwen2 (bench/weights.py's), both packed. Both
sides on this one node.

Smoke run (prints, appends nothing): `python bench/backends.py --smoke`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

HANDOFFS = {"shared_memory": "shared memory (learner node)", "object_store": "object store (other nodes)",
            "broadcast": "broadcast group (gloo)"}


def rl_samples_per_s(backend: str, model: Path, out: Path, steps: int) -> float:
    from flywheel.config import RLConfig, validate
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    cfg = validate(dict(
        model=str(model), output_dir=str(out), env={"name": "arithmetic"},
        train={"steps": steps, "groups_per_step": 8, "group_size": 8, "seed": 0},
        sampling={"temperature": 1.0, "max_tokens": 6}, optim={"lr": 1e-4}, eval={"tasks": 20},
        log={"progress": False}, checkpoint={"every": 0}, threads=1, max_off_policy_steps=1,
        rollout={"workers": 1, "threads": 1, "backend": backend}), RLConfig)
    run_rl(cfg, log=lambda m: None)
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "time/step_s" in r and r["step"] > 2]
    return 64 * len(rows) / sum(r["time/step_s"] for r in rows)


def publish_vs_memcpy(folder: Path, rounds: int, how: str) -> dict:
    """Medians over rounds of memcpy and of the Ray hand-off (publish + pickup), in seconds.
    how: "shared_memory" (the actor reads the run's segment: an actor on the learner's node, as
    `flywheel rl` sets it up), "object_store" (what an actor on another node reads) or
    "broadcast" (`rollout.ray.weights: broadcast`: the gloo group, publish = the broadcast)."""
    import torch

    from flywheel.config import RayConfig
    from flywheel.envs import load_env
    from flywheel.models import load
    from flywheel.orchestrate.pool import rollout_transport
    from flywheel.orchestrate.ray_rollouts import RayRollouts
    from flywheel.orchestrate.worker import WorkerSpec, WorkItem

    model, _ = load(folder)
    params = {k: v.detach() for k, v in model.named_parameters()}
    copies = {k: torch.empty_like(v) for k, v in params.items()}
    nbytes = sum(v.numel() * v.element_size() for v in params.values())
    transport = rollout_transport(model, 1) if how == "shared_memory" else None
    spec = WorkerSpec(model=str(folder), env_name="arithmetic", env_settings={},
                      transport_name=transport.name if transport else "",
                      sampling={"temperature": 1.0, "max_tokens": 1}, group_size=1, threads=1)
    config = RayConfig(weights="broadcast" if how == "broadcast" else "store")
    source = RayRollouts(spec, 1, config, log=lambda m: None, transport=transport)
    task = load_env("arithmetic").tasks("train", n=1, seed=0)
    memcpy, publish, pickup, rebuild = [], [], [], []
    try:
        for version in range(rounds + 1):  # version 0 warms the actor up
            t0 = time.perf_counter()
            for k, v in params.items():
                copies[k].copy_(v)
            t1 = time.perf_counter()
            source.publish(params, version)
            t2 = time.perf_counter()
            source.submit(WorkItem(version, task, version))
            results = []
            while not results:
                results = source.poll(1.0)
            if version == 0:
                continue
            memcpy.append(t1 - t0)
            publish.append(t2 - t1)
            pickup.append(results[0].weight_load_s)
            rebuild.append(results[0].kernel_rebuild_s)
    finally:
        source.close()
        if transport is not None:
            transport.close()
    moved = [m / (p + q - k) for m, p, q, k in zip(memcpy, publish, pickup, rebuild)]
    ready = [m / (p + q) for m, p, q in zip(memcpy, publish, pickup)]
    med = statistics.median
    return {"mb": nbytes / 1e6, "memcpy": med(memcpy), "publish": med(publish), "pickup": med(pickup),
            "rebuild": med(rebuild), "ratio": med(moved), "ratios": moved, "ready": med(ready), "readies": ready}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--weight-rounds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a short run that writes nothing")
    args = ap.parse_args()
    if args.smoke:
        args.rounds, args.steps, args.weight_rounds = 1, 4, 2
    threads = common.set_threads(1)

    import ray

    from weights import qwen2_100m_folder

    ray.init(num_cpus=2, include_dashboard=False, namespace="bench-backends", log_to_driver=False)
    model = common.tiny_model()
    work = common.WORK / "backends"
    rates: dict[str, list[float]] = {"local": [], "ray": []}
    ratios = []
    try:
        for r in range(args.rounds):
            order = ("local", "ray") if r % 2 == 0 else ("ray", "local")
            got = {}
            for backend in order:
                out = work / f"{backend}-{r}-{time.time_ns()}"
                got[backend] = rl_samples_per_s(backend, model, out, args.steps)
                print(f"round {r} {backend}: {got[backend]:.1f} samples/s", flush=True)
            for b in got:
                rates[b].append(got[b])
            ratios.append(got["ray"] / got["local"])
        weights = {}
        for name, folder in [("tiny", model)] + ([] if args.smoke else [("100M", qwen2_100m_folder())]):
            for how in HANDOFFS:
                weights[(name, how)] = publish_vs_memcpy(folder, args.weight_rounds, how)
    finally:
        ray.shutdown()
    mr = common.median_range
    lines = [f"Machine: {common.machine_line(threads)}, ray {ray.__version__}. {args.rounds} rounds of "
             f"{args.steps} steps (8 groups of 8, max_tokens 6, one step off-policy, one rollout worker); "
             "samples/s over steps 3 on. Figures: median (range, n).", "",
             "| backend | samples/s |", "|---|---|",
             f"| local (worker process, shared memory) | {mr(rates['local'], '{:.1f}')} |",
             f"| ray (rollout actor on this node: shared memory) | {mr(rates['ray'], '{:.1f}')} |", "",
             f"ray / local, paired per round: {mr(ratios)}.", "",
             "| model | actor reads | MB | memcpy ms | publish ms | pickup ms | of which kernel rebuild ms "
             "| **hand-off**: memcpy / (publish + pickup - rebuild) | ready: memcpy / (publish + pickup) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (name, how), w in weights.items():
        lines.append(f"| {name} | {HANDOFFS[how]} | "
                     f"{w['mb']:.0f} | {w['memcpy'] * 1e3:.1f} | {w['publish'] * 1e3:.1f} | "
                     f"{w['pickup'] * 1e3:.1f} | {w['rebuild'] * 1e3:.1f} | {mr(w['ratios'])} | {mr(w['readies'])} |")
    big = "100M" if ("100M", "shared_memory") in weights else "tiny"
    last = (f"backends: ratio={statistics.median(ratios):.2f} local_samples_s={statistics.median(rates['local']):.1f} "
            f"ray_samples_s={statistics.median(rates['ray']):.1f} "
            f"handoff_ratio_tiny={weights[('tiny', 'shared_memory')]['ratio']:.2f} "
            f"handoff_ratio_100m={weights[(big, 'shared_memory')]['ratio']:.2f} "
            f"ready_ratio_100m={weights[(big, 'shared_memory')]['ready']:.2f} "
            f"object_store_handoff_100m={weights[(big, 'object_store')]['ratio']:.2f} "
            f"broadcast_handoff_100m={weights[(big, 'broadcast')]['ratio']:.2f} rounds={args.rounds}")
    common.append_report("bench/backends.py: the same RL run on local processes and on Ray; weights through Ray",
                         "\n".join(lines), last, write=not args.smoke)


if __name__ == "__main__":
    main()
