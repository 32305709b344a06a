"""SWE-style instances from a real project, SWE-smith's method, graded by pytest.

1. The project's pinned source (sources.py) and its prepared environment (prepared.py); its
   whole test suite runs once in the sandbox. Tests that do not pass there are left out, and
   so are those slower than `slow_s` (every instance's PASS_TO_PASS would run them).
2. Mutation sites in the library's functions (synth_bugs.find_mutations: swapped operators,
   changed constants, inverted conditions, removed statements), visited in a seeded order
   that takes turns between functions.
3. Each mutant runs the passing tests (stopped at three times the whole suite's time: a
   mutant may loop forever). Kept when some fail and the run finished: those failing
   are FAIL_TO_PASS, the others PASS_TO_PASS; `bug_patch` makes the mutant from the source,
   `patch` (gold) undoes it.
4. The problem statement is written from the failing behaviour: the failing tests and their
   crash messages, never the diff.
The result depends only on the source, the seed and the tests' outcomes: `flywheel swe build`
regenerates the shipped files (instances/*.jsonl) and `flywheel swe validate` checks them.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from flywheel.envs.patches import make_diff
from flywheel.envs.repo import is_test_path
from flywheel.envs.swe.harness import PASSING, TEST_LIMITS, TestRun, run_pytest, sandbox
from flywheel.envs.swe.instance import EnvironmentSpec, SWEInstance, env_key
from flywheel.envs.swe.prepared import prepare_env
from flywheel.envs.swe.sources import PROJECTS, Project, source_tree
from flywheel.envs.swe.workspace import link_tree, new_workspace
from flywheel.envs.synth_bugs import find_mutations, gold_diff, interleave

SYNTH_VERSION = 1  # bump when the method changes: instance ids and files follow it
INSTANCES_DIR = Path(__file__).resolve().parent / "instances"


@dataclass
class BuildReport:
    project: str
    tests: int = 0  # passing on the source (the ones used)
    failing_before: int = 0  # not passing on the source (left out)
    sites: int = 0
    tried: int = 0
    kept: int = 0
    slow: int = 0  # passing on the source but slower than slow_s (left out: every instance would run them)
    no_failure: int = 0  # mutants every test still passes
    broken_run: int = 0  # the run timed out or crashed
    seconds: float = 0.0
    kinds: dict = field(default_factory=dict)


def stable(message: str) -> str:
    """A failure message without what changes from run to run (object addresses)."""
    return re.sub(r"\b0x[0-9a-fA-F]{6,}\b", "0x...", message)


def problem_statement(project: Project, f2p: list[str], run: TestRun, shown: int = 4) -> str:
    """An issue written from the failing tests' behaviour: which tests fail and how."""
    n = len(f2p)
    lines = [f"After a recent change, {n} test{'s' * (n > 1)} of {project.name} {project.version} "
             f"fail{'s' * (n == 1)}:", ""]
    for node in f2p[:shown]:
        message = run.messages.get(node, "").strip() or run.outcomes.get(node, "failed")
        lines.append(f"- `{node}`: {stable(message)}")
    if n > shown:
        lines.append(f"- ... and {n - shown} more")
    lines += ["", "The tests describe the intended behaviour; the library code is wrong. Fix the library so "
                  "that these tests pass again and every other test keeps passing."]
    return "\n".join(lines)


def _mutant_workspace(base: Path, rel: str, text: str, parent: Path) -> Path:
    ws = Path(tempfile.mkdtemp(prefix="mut-", dir=parent))
    link_tree(base, ws)
    (ws / rel).unlink()  # the link to the base's file: the mutant is a new file
    (ws / rel).write_bytes(text.encode("utf-8", errors="surrogateescape"))
    return ws


def build_instances(project: Project, max_n: int, seed: int = 0, workers: int | None = None,
                    slow_s: float = 1.0, log=None) -> tuple[list[SWEInstance], BuildReport]:
    """Up to `max_n` instances from `project` (see the module's docstring)."""
    t0, report = time.perf_counter(), BuildReport(project.name)
    box = sandbox()
    environment = EnvironmentSpec()
    env = prepare_env(environment, env_key(project.repo, project.version, environment))
    base = source_tree(project.source)
    with tempfile.TemporaryDirectory(prefix="flywheel-swe-build-") as tmp:
        whole = run_pytest(new_workspace(base, parent=tmp), env, [project.tests], box)
        if whole.error:
            raise RuntimeError(f"{project.name}: the test suite did not run: {whole.error}\n{whole.output_tail}")
        # a mutant may loop forever: its run is stopped at a few times the whole suite's time
        limits = TEST_LIMITS.with_(wall_s=max(20.0, 3 * whole.duration_s), cpu_s=int(max(20, 3 * whole.duration_s)))
        passing = sorted(n for n, o in whole.outcomes.items() if o in PASSING and whole.seconds.get(n, 0) <= slow_s)
        report.tests, report.failing_before = len(passing), sum(o not in PASSING for o in whole.outcomes.values())
        report.slow = sum(o in PASSING and whole.seconds.get(n, 0) > slow_s for n, o in whole.outcomes.items())
        sites = [m for m in find_mutations(base) if m.path.startswith(project.package + "/") and not is_test_path(m.path)]
        order = interleave(sites, random.Random(seed))
        report.sites = len(order)
        workers = workers or min(2, os.cpu_count() or 1)

        def attempt(m):
            text = (base / m.path).read_bytes().decode("utf-8", errors="surrogateescape")
            ws = _mutant_workspace(base, m.path, m.apply(text), Path(tmp))
            try:
                return m, text, run_pytest(ws, env, passing, box, limits)
            finally:
                shutil.rmtree(ws, ignore_errors=True)

        out: list[SWEInstance] = []
        kinds: dict[str, int] = {}
        with ThreadPoolExecutor(workers) as ex:
            for i in range(0, len(order), workers):
                if len(out) >= max_n:
                    break
                for m, text, run in ex.map(attempt, order[i:i + workers]):
                    report.tried += 1
                    if run.error:
                        report.broken_run += 1
                        continue
                    f2p = [n for n in passing if not run.passed(n)]
                    if not f2p:
                        report.no_failure += 1
                        continue
                    if len(out) >= max_n:
                        continue
                    mutant = m.apply(text)
                    key = hashlib.sha1(f"{m.path}:{m.start}:{m.end}:{m.replacement}".encode()).hexdigest()[:8]
                    out.append(SWEInstance(
                        instance_id=f"{project.name}__{m.function}__{m.kind}__{key}", repo=project.repo,
                        base_commit=f"pypi:{project.name}=={project.version}",
                        problem_statement=problem_statement(project, f2p, run),
                        patch=gold_diff(m.path, mutant, text), test_patch="", FAIL_TO_PASS=f2p,
                        PASS_TO_PASS=[n for n in passing if run.passed(n)], version=project.version,
                        source=project.source, environment=environment, bug_patch=make_diff(m.path, text, mutant),
                        extra={"synth": {"file": m.path, "line": m.line, "function": m.function, "kind": m.kind,
                                         "seed": seed, "version": SYNTH_VERSION}}))
                    kinds[m.kind] = kinds.get(m.kind, 0) + 1
                if log:
                    log(f"{project.name}: tried {report.tried}/{len(order)} sites, kept {len(out)}")
    report.kept, report.kinds, report.seconds = len(out), kinds, time.perf_counter() - t0
    return out, report


def shipped_files() -> list[Path]:
    return sorted(INSTANCES_DIR.glob("*.jsonl"))


def project_names() -> list[str]:
    return sorted(PROJECTS)
