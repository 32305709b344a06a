"""The SWE layer's costs on the shipped real-project instances, and a thousand bash episodes.

Measured on the path the harness and the `swe` environment use:
- workspace setup: `new_workspace(instance_base(inst))` (hard links to the cached base), per
  instance of the shipped files, --setup-repeats times each; p50 and p90 in ms. Beside it, a
  full copy of the same tree (shutil.copytree) as the reference it replaces.
- sandbox overhead: the same pytest command (the instance's FAIL_TO_PASS + PASS_TO_PASS with the
  harness's plugin) on the same gold-patched workspace, in the bubblewrap sandbox
  (`run_pytest`) and bare (subprocess, same environment variables), interleaved,
  --overhead-repeats times per instance on one instance per project; the ratio of medians.
- instances per second per core: `evaluate(inst, inst.patch)` over every shipped instance
  with 1 and with 2 worker threads; instances / wall / cores used.
- 1,000 concurrent bash episodes (bench/scale_sim.py's style: no model, a scripted agent):
  the `swe` environment on a small generated project, every episode playing 3 bash commands
  (look, fix with sed, run its failing test) then `submit`, graded by the harness; all in
  flight at once through `play`. Reported: wall, episodes/s, sandboxed commands/s, the
  resolved share (must be 1.0) and the driver's peak RSS growth.
`--smoke`: small sizes, writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def setup_times(instances, repeats: int) -> tuple[list[float], list[float]]:
    from flywheel.envs.swe.workspace import instance_base, new_workspace

    linked, copied = [], []
    for inst in instances:
        base = instance_base(inst)
        for _ in range(repeats):
            t0 = time.perf_counter()
            ws = new_workspace(base)
            linked.append(1000 * (time.perf_counter() - t0))
            shutil.rmtree(ws)
            t0 = time.perf_counter()
            dst = Path(tempfile.mkdtemp()) / "ws"
            shutil.copytree(base, dst, symlinks=True)
            copied.append(1000 * (time.perf_counter() - t0))
            shutil.rmtree(dst.parent)
    return linked, copied


def overhead(instances, repeats: int) -> list[tuple[str, float, float]]:
    """(instance, median sandboxed s, median bare s) for one instance per repository."""
    from flywheel.envs.swe.harness import apply_submission, pytest_argv, run_pytest, test_env
    from flywheel.envs.swe.prepared import prepare_env
    from flywheel.envs.swe.workspace import instance_base, new_workspace

    out, seen = [], set()
    for inst in instances:
        if inst.repo in seen:
            continue
        seen.add(inst.repo)
        base, env = instance_base(inst), prepare_env(inst.environment, inst.env_key)
        ws = new_workspace(base)
        apply_submission(ws, base, inst, inst.patch)
        nodes = inst.FAIL_TO_PASS + inst.PASS_TO_PASS
        boxed, bare = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            run = run_pytest(ws, env, nodes)
            boxed.append(time.perf_counter() - t0)
            assert run.error is None and all(run.passed(n) for n in nodes), run.output_tail
            t0 = time.perf_counter()
            proc = subprocess.run(pytest_argv(env, nodes), cwd=ws, env=test_env(env), capture_output=True)
            bare.append(time.perf_counter() - t0)
            assert proc.returncode == 0, proc.stdout[-500:]
        shutil.rmtree(ws)
        out.append((inst.instance_id, statistics.median(boxed), statistics.median(bare)))
    return out


def throughput(instances, workers: int) -> tuple[float, int]:
    from flywheel.envs.swe.harness import evaluate

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(lambda i: evaluate(i, i.patch), instances))
    wall = time.perf_counter() - t0
    return len(instances) / wall / workers, sum(r.resolved for r in results)


def many_episodes(n: int, tmp: Path) -> dict:
    from flywheel.envs.base import Policy
    from flywheel.envs.patches import make_diff
    from flywheel.envs.swe.env import SUBMIT, SWEEnvironment
    from flywheel.envs.swe.instance import Source, SWEInstance
    from flywheel.envs.tool_env import ToolLimits
    from flywheel.rollout.play import play

    root = tmp / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    code = "def double(x):\n    return 2 * x\n"
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(code)
    (root / "tests" / "test_mod.py").write_text("from pkg.mod import double\n\n\ndef test_double():\n"
                                                "    assert double(3) == 6\n\n\ndef test_zero():\n"
                                                "    assert double(0) == 0\n")
    buggy = code.replace("2 * x", "2 + x")
    inst = SWEInstance("bench__double__1", "local/proj", "folder", "double(3) is 5", make_diff("pkg/mod.py", buggy, code),
                       "", ["tests/test_mod.py::test_double"], ["tests/test_mod.py::test_zero"], "0.1",
                       Source(kind="folder", path=str(root)), bug_patch=make_diff("pkg/mod.py", code, buggy),
                       split="train")
    env = SWEEnvironment([inst], "bench", ToolLimits(max_turns=6, max_tool_calls_per_turn=1,
                                                      max_observation_tokens=512, episode_timeout_s=3600))
    commands = ["cat pkg/mod.py", "sed -i 's/2 + x/2 * x/' pkg/mod.py",
                "python -m pytest -q -p no:cacheprovider tests/test_mod.py::test_double"]

    class Agent(Policy):
        async def act(self, task, history, tools, episode=0):
            i = sum(1 for m in history if m.get("role") == "assistant")
            command = commands[i] if i < len(commands) else SUBMIT
            return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command}})}</tool_call>"

    tasks = env.tasks("train") * n
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    results = asyncio.run(play(env, tasks, Agent(), concurrency=n, timeout_s=3600))
    wall = time.perf_counter() - t0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    resolved = sum(r.reward == 1.0 for r in results) / len(results)
    return dict(episodes=n, wall_s=wall, episodes_per_s=n / wall, commands_per_s=n * len(commands) / wall,
                resolved=resolved, rss_growth_mb=(rss1 - rss0) / 1024)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--setup-repeats", type=int, default=None)
    ap.add_argument("--overhead-repeats", type=int, default=None)
    ap.add_argument("--episodes", type=int, default=None)
    args = ap.parse_args()
    common.fill_sizes(args, dict(setup_repeats=2, overhead_repeats=1, episodes=20),
                      dict(setup_repeats=5, overhead_repeats=5, episodes=1000))
    from flywheel.envs.swe.instance import read_instances
    from flywheel.envs.swe.synthesize import shipped_files

    instances = [i for f in shipped_files() for i in read_instances(f)]
    if args.smoke:
        instances = [next(i for i in instances if i.repo == r) for r in sorted({i.repo for i in instances})]
    linked, copied = setup_times(instances, args.setup_repeats)
    over = overhead(instances, args.overhead_repeats)
    ratio = statistics.median(b / r for _, b, r in over)
    per_core = {w: throughput(instances, w) for w in (1, 2)}
    with tempfile.TemporaryDirectory() as tmp:
        many = many_episodes(args.episodes, Path(tmp))
    cores = os.cpu_count()
    body = "\n".join([
        f"Machine: {common.machine_line(2)}. {len(instances)} shipped instances from "
        f"{len({i.repo for i in instances})} projects.", "",
        "| measure | value |", "|---|---|",
        f"| workspace setup, hard links (p50 / p90) | {percentile(linked, .5):.2f} / {percentile(linked, .9):.2f} ms "
        f"(n={len(linked)}) |",
        f"| the same tree copied (p50 / p90), the reference | {percentile(copied, .5):.2f} / "
        f"{percentile(copied, .9):.2f} ms |",
        *[f"| pytest on {iid} (F2P + P2P), sandboxed / bare | {b:.2f} s / {r:.2f} s = {b / r:.2f}x |"
          for iid, b, r in over],
        f"| evaluate(gold), instances/s per core, 1 worker | {per_core[1][0]:.3f} ({per_core[1][1]}/{len(instances)} "
        f"resolved) |",
        f"| evaluate(gold), instances/s per core, 2 workers | {per_core[2][0]:.3f} ({per_core[2][1]}/{len(instances)} "
        f"resolved) |",
        f"| {many['episodes']} concurrent bash episodes (3 commands + submit, graded) | {many['wall_s']:.1f} s wall, "
        f"{many['episodes_per_s']:.2f} episodes/s, {many['commands_per_s']:.1f} sandboxed commands/s, resolved "
        f"{many['resolved']:.3f}, driver peak RSS +{many['rss_growth_mb']:.0f} MB |",
    ])
    last = (f"swe: setup_p50_ms={percentile(linked, .5):.2f} copy_p50_ms={percentile(copied, .5):.2f} "
            f"overhead_ratio={ratio:.2f} instances_per_s_per_core={per_core[1][0]:.3f} "
            f"episodes={many['episodes']} episodes_per_s={many['episodes_per_s']:.2f} resolved={many['resolved']:.3f} "
            f"cores={cores}")
    common.append_report("bench/swe.py: SWE workspaces, sandboxed pytest, a thousand bash episodes", body, last,
                         write=not args.smoke)


if __name__ == "__main__":
    main()
