"""code_repair verification rate: the env's grader vs cold `python -m pytest -q`, same run.

A verification grades one fixed instance of the bundled corpus (minilib): its FAIL_TO_PASS and
PASS_TO_PASS tests (~90) must all pass. Three ways, on the same prepared folders:
  grade:   what the env does per episode: fresh copy of the base, carry the change over, run
           the tests in the bubblewrap sandbox with the lean runner forked from a warm SandboxPool
  runner:  only the lean-runner call of `grade` (no copying)
  pytest:  the peer, as its users run it: `python -m pytest -q -p no:cacheprovider <test ids>` in a
           plain subprocess (no sandbox, cold interpreter) in the fixed folder
Sequential runs use one verification thread (one core); the concurrent row runs `--threads`
verifications at once on a pool of that size. Medians over --repeats; each repeat verifies
--instances instances once. A second peer row runs pytest with PYTEST_DISABLE_PLUGIN_AUTOLOAD=1.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2, help="concurrent verifications (and pool size)")
    ap.add_argument("--peer-instances", type=int, default=5, help="instances per repeat for the (slow) pytest rows")
    ap.add_argument("--no-report", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = ap.parse_args()
    from flywheel.envs.code_repair import CodeRepairEnvironment
    from flywheel.envs.grading import grade, run_tests, shared_pool
    from flywheel.envs.patches import apply_patch
    from flywheel.envs.repo import copy_tree, read_instances
    from flywheel.envs.synth_bugs import cached_corpus_instances

    instances = read_instances(cached_corpus_instances("minilib", cache_dir=common.WORK / "cache"))[:args.instances]
    env = CodeRepairEnvironment(instances)
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-cr-"))
    prepared = []
    for i, inst in enumerate(instances):
        base, fixed = env.base_snapshot(inst), tmp / f"f{i}"  # the env's base: buggy, with compiled pycs
        copy_tree(base, fixed, keep_pycache=True)  # the agent's workspace, as the env makes it
        apply_patch(fixed, inst.patch)
        prepared.append((inst, base, fixed))
    pool = shared_pool(size=args.threads)
    n_tests = statistics.mean(len(i.FAIL_TO_PASS) + len(i.PASS_TO_PASS) for i in instances)

    def v_grade(job):
        inst, base, fixed = job
        assert grade(inst, base, fixed, pool).resolved, inst.instance_id

    def v_runner(job):
        inst, _, fixed = job
        run = run_tests(fixed, inst.FAIL_TO_PASS + inst.PASS_TO_PASS, pool)
        assert run.error is None and all(map(run.passed, inst.FAIL_TO_PASS + inst.PASS_TO_PASS))

    def v_pytest(job, lean: bool = False):
        inst, _, fixed = job
        env_vars = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        if lean:
            env_vars["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *inst.FAIL_TO_PASS, *inst.PASS_TO_PASS], cwd=fixed, capture_output=True, text=True,
                              env=env_vars)
        assert proc.returncode == 0, proc.stdout[-500:]

    def rate(fn, threads: int = 1, jobs=prepared) -> tuple[float, list[float]]:
        def once():
            if threads == 1:
                for job in jobs:
                    fn(job)
            else:
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(fn, jobs))
        once()  # warm-up, dropped
        t, times = common.median_time(once, args.repeats)
        return len(jobs) / t, [len(jobs) / x for x in times]

    rows = {"grade (env, sandboxed)": rate(v_grade), "runner only (sandboxed)": rate(v_runner),
            "cold pytest (no sandbox)": rate(v_pytest, jobs=prepared[:args.peer_instances]),
            "cold pytest, plugin autoload off (no sandbox)": rate(lambda job: v_pytest(job, lean=True),
                                                                  jobs=prepared[:args.peer_instances]),
            f"grade, {args.threads} threads": rate(v_grade, args.threads)}
    shutil.rmtree(tmp, ignore_errors=True)
    ours, peer = rows["grade (env, sandboxed)"][0], rows["cold pytest (no sandbox)"][0]
    lean = rows["cold pytest, plugin autoload off (no sandbox)"][0]
    conc = rows[f"grade, {args.threads} threads"][0]
    load1 = os.getloadavg()[0]
    body = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
            f"verification threads: 1 (sequential rows) and {args.threads} (last row); load average at the end "
            f"{load1:.2f}. {len(prepared)} instances of the bundled corpus ({args.peer_instances} for the pytest rows), "
            f"{n_tests:.0f} tests each; medians of {args.repeats} repeats.", "",
            "| verifier | verifications/s (median) | per repeat | ms / verification |", "|---|---|---|---|"]
    for name, (r, reps) in rows.items():
        body.append(f"| {name} | {r:.1f} | {' '.join(f'{x:.1f}' for x in reps)} | {1000 / r:.1f} |")
    body += ["", f"grade vs cold pytest: {ours / peer:.1f}x (vs pytest without its plugins: {ours / lean:.1f}x); "
                 f"{args.threads} threads: {conc / args.threads:.1f} verifications/s per thread. The venv's pytest "
                 f"plugins ({_plugins()}) are part of a cold pytest start as users run it."]
    last = (f"code_repair: verifications_per_s={ours:.1f} ratio={ours / peer:.1f} pytest_per_s={peer:.1f} "
            f"ratio_vs_lean_pytest={ours / lean:.1f} "
            f"runner_per_s={rows['runner only (sandboxed)'][0]:.1f} concurrent_per_s={conc:.1f} "
            f"threads={args.threads} tests_per_verification={n_tests:.0f}")
    common.append_report("code_repair verification rate (grader vs cold pytest)", "\n".join(body), last,
                         write=not args.no_report)


def _plugins() -> str:
    from importlib.metadata import entry_points

    return ", ".join(sorted({ep.dist.name for ep in entry_points(group="pytest11") if ep.dist})) or "none"


if __name__ == "__main__":
    main()
