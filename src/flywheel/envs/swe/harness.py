"""The SWE-bench harness without Docker: a patch in, "resolved" out.

Per evaluation:
  1. a workspace from the instance's base (workspace.py: hard links, a few ms);
  2. the model's patch applied (one that does not apply resolves nothing); what it changed
     under test paths is put back as the base had it, then the instance's `test_patch` is
     applied (SWE-bench resets the test files its test_patch touches; resetting every test
     path is stricter and the same for any patch that leaves tests alone);
  3. FAIL_TO_PASS + PASS_TO_PASS run by pytest, in one call, inside the bubblewrap sandbox,
     with the repository version's prepared environment (prepared.py) mounted read-only;
  4. resolved = every FAIL_TO_PASS and every PASS_TO_PASS test passed (an expected failure,
     xfail, counts as passing, as in SWE-bench's grading).
`validate` runs each instance's gold patch (must resolve) and the empty patch (must not); an
instance failing either is dropped with its reason.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from flywheel.envs.patches import apply_patch, parse_patch
from flywheel.envs.repo import PatchError, is_test_path
from flywheel.envs.swe.instance import SWEInstance
from flywheel.envs.swe.prepared import PLUGIN, RESULTS_MARK, PreparedEnv, prepare_env
from flywheel.envs.swe.workspace import instance_base, link_tree, new_workspace
from flywheel.sandbox import Limits, Sandbox

PASSING = ("passed", "xfailed")
TEST_LIMITS = Limits(wall_s=300.0, cpu_s=300, memory_mb=2048, processes=64, output_bytes=8 << 20,
                     workspace_files=50_000, workspace_mb=512)


@dataclass
class TestRun:
    outcomes: dict[str, str]  # node id -> passed | failed | error | skipped | xfailed | xpassed | missing
    duration_s: float
    error: str | None = None  # the run itself failed (timeout, crash, no report): no test counts as passed
    output_tail: str = ""
    messages: dict[str, str] = field(default_factory=dict)  # node id -> its failure's one-line message
    seconds: dict[str, float] = field(default_factory=dict)  # node id -> its call phase's duration

    def passed(self, node: str) -> bool:
        return self.outcomes.get(node, "missing") in PASSING


@dataclass
class Evaluation:
    instance_id: str
    resolved: bool
    fail_to_pass: dict[str, str] = field(default_factory=dict)  # node id -> outcome
    pass_to_pass: dict[str, str] = field(default_factory=dict)
    error: str | None = None  # why nothing ran: the patch did not apply, the run failed
    duration_s: float = 0.0

    def row(self) -> dict:
        f2p = sum(v in PASSING for v in self.fail_to_pass.values())
        p2p = sum(v in PASSING for v in self.pass_to_pass.values())
        return {"instance_id": self.instance_id, "resolved": self.resolved, "error": self.error,
                "fail_to_pass": f"{f2p}/{len(self.fail_to_pass)}", "pass_to_pass": f"{p2p}/{len(self.pass_to_pass)}",
                "failed_tests": sorted(k for k, v in {**self.fail_to_pass, **self.pass_to_pass}.items()
                                       if v not in PASSING)[:20],
                "duration_s": round(self.duration_s, 3)}


_SANDBOXES: dict[bool | None, Sandbox] = {}


def sandbox(unsafe: bool | None = None) -> Sandbox:
    if unsafe not in _SANDBOXES:
        _SANDBOXES[unsafe] = Sandbox(TEST_LIMITS, unsafe=unsafe)
    return _SANDBOXES[unsafe]


def pytest_argv(env: PreparedEnv, nodes: Iterable[str]) -> list[str]:
    """pytest on `nodes` with the reporting plugin, no cache folder, short tracebacks."""
    return [str(env.python), "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q", "--no-header",
            "--tb=short", "-rN", *nodes]


def test_env(env: PreparedEnv) -> dict[str, str]:
    return {"PATH": f"{env.bin}:/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0"}


def run_pytest(workdir: Path, env: PreparedEnv, nodes: list[str], box: Sandbox | None = None,
               limits: Limits | None = None) -> TestRun:
    """`nodes` (node ids, or folders / files to collect) run by pytest in the sandbox on
    `workdir`: every test's outcome, a requested node id that did not run as "missing" (or the
    run's error)."""
    box = box or sandbox()
    res = box.run(pytest_argv(env, nodes), workspace=workdir, env=test_env(env), limits=limits or TEST_LIMITS,
                  read_only=(str(env.root),))
    report = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(RESULTS_MARK)), None)
    tail = (res.stdout + res.stderr)[-2000:]
    if report is None:
        why = ("timed out" if res.timed_out else res.error or
               f"pytest exited {res.returncode} without a report: {res.stderr.strip()[-300:] or res.stdout[-300:]}")
        return TestRun({}, res.duration_s, why, tail)
    raw = json.loads(report[len(RESULTS_MARK):])
    outcomes = {n: o for n, (o, _, _) in raw.items()}
    outcomes.update({n: "missing" for n in nodes if "::" in n and n not in outcomes})
    return TestRun(outcomes, res.duration_s, None, tail, {n: m for n, (_, m, _) in raw.items() if m},
                   {n: s for n, (_, _, s) in raw.items()})


def apply_submission(workdir: Path, base: Path, inst: SWEInstance, model_patch: str, link: bool = True) -> None:
    """The model's patch, its test-path changes undone (test files `link`ed back from the base,
    or copied), then the instance's test_patch. Raises PatchError when either does not apply."""
    changed = apply_patch(workdir, model_patch) if model_patch.strip() else []
    for rel in changed:
        if is_test_path(rel):
            _reset(workdir, base, rel, link)
    if inst.test_patch.strip():
        try:
            apply_patch(workdir, inst.test_patch)
        except PatchError as e:
            raise PatchError(f"the instance's test_patch: {e}") from None


def evaluate(inst: SWEInstance, model_patch: str, unsafe: bool | None = None,
             workspace: Path | None = None) -> Evaluation:
    """Grade `model_patch` (a unified diff against the instance's base) on `inst`.
    `workspace`: grade that folder as it is instead (an agent's, its test paths reset)."""
    t0 = time.perf_counter()
    box = sandbox(unsafe)
    base = instance_base(inst)
    env = prepare_env(inst.environment, inst.env_key)
    ws = new_workspace(base, isolated=box.isolated)
    try:
        if workspace is not None:
            shutil.rmtree(ws)
            link_tree(workspace, ws, copy=True)
            model_patch = ""
            for rel in _test_paths(ws, base):
                _reset(ws, base, rel, box.isolated)
        try:
            if model_patch.strip():
                parse_patch(model_patch)
            apply_submission(ws, base, inst, model_patch, link=box.isolated)
        except PatchError as e:
            return Evaluation(inst.instance_id, False, error=f"patch does not apply: {e}",
                              duration_s=time.perf_counter() - t0)
        run = run_pytest(ws, env, inst.FAIL_TO_PASS + inst.PASS_TO_PASS, box)
    finally:
        shutil.rmtree(ws, ignore_errors=True)
    f2p = {n: run.outcomes.get(n, "missing") for n in inst.FAIL_TO_PASS}
    p2p = {n: run.outcomes.get(n, "missing") for n in inst.PASS_TO_PASS}
    resolved = run.error is None and all(v in PASSING for v in (*f2p.values(), *p2p.values()))
    return Evaluation(inst.instance_id, resolved, f2p, p2p, run.error, time.perf_counter() - t0)


def _test_paths(ws: Path, base: Path) -> list[str]:
    out = set()
    for root in (ws, base):
        for dirpath, _, files in os.walk(root):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")
                if is_test_path(rel):
                    out.add(rel)
    return sorted(out)


def _reset(ws: Path, base: Path, rel: str, link: bool) -> None:
    """`rel` in the workspace as the base has it (absent if the base has none): a hard link
    where nothing writes in place (the sandbox isolates), else a copy."""
    target = ws / rel
    if target.exists() or target.is_symlink():
        target.unlink()
    if (base / rel).is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        (os.link if link else shutil.copy2)(base / rel, target)


@dataclass
class Validation:
    kept: list[SWEInstance]
    dropped: list[tuple[SWEInstance, str]]  # with the reason
    gold: list[Evaluation]
    empty: list[Evaluation]

    def last_line(self, repos: int) -> str:
        n = len(self.gold)
        gold = sum(e.resolved for e in self.gold) / max(1, n)
        empty = sum(e.resolved for e in self.empty) / max(1, n)
        return (f"swe_validate: instances={n} repos={repos} gold_resolved={gold:.2f} empty_resolved={empty:.2f} "
                f"kept={len(self.kept)} dropped={len(self.dropped)}")


def validate(instances: list[SWEInstance], unsafe: bool | None = None, log=print,
             workers: int | None = None) -> Validation:
    """Gold must resolve and the empty patch must not, on every instance; the others are
    dropped. `workers` evaluations run at once (default: one per CPU, at most 4)."""
    kept, dropped, gold_runs, empty_runs = [], [], [], []
    jobs = [(inst, patch) for inst in instances for patch in (inst.patch, "")]
    with ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1)) as ex:
        runs = list(ex.map(lambda job: evaluate(job[0], job[1], unsafe), jobs))
    for k, inst in enumerate(instances):
        gold, empty = runs[2 * k], runs[2 * k + 1]
        gold_runs.append(gold)
        empty_runs.append(empty)
        why = None
        if not gold.resolved:
            why = f"the gold patch does not resolve it ({gold.error or json.dumps(gold.row()['failed_tests'])})"
        elif empty.resolved:
            why = "the empty patch resolves it (FAIL_TO_PASS passes without a fix)"
        if why:
            dropped.append((inst, why))
            log(f"{inst.instance_id}: dropped: {why}")
        else:
            kept.append(inst)
    return Validation(kept, dropped, gold_runs, empty_runs)
