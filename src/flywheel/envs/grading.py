"""Running a repository's tests in the warm sandbox pool, and grading an agent's change
against an instance (fresh base + the agent's non-test changes + test_patch)."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from flywheel.envs.patches import _read_text, _same, apply_patch, make_diff, parse_patch
from flywheel.envs.repo import Instance, PatchError, RESULTS_MARK, RUNNER_SOURCE, _through_link, copy_tree, is_test_path, list_files
from flywheel.sandbox import Limits, SandboxPool

@dataclass
class TestRun:
    results: dict[str, tuple[str, str]]  # test id -> (outcome, message); outcome "passed" | "failed" | ...
    error: str | None = None  # the whole run failed (timeout, crash): every test counts as not passed
    duration_s: float = 0.0
    test_seconds: dict[str, float] = field(default_factory=dict)  # per test that ran

    def passed(self, tid: str) -> bool:
        return self.results.get(tid, ("missing", ""))[0] == "passed"


_POOLS: dict = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(unsafe: bool | None = None, size: int | None = None):
    """One warm SandboxPool per process and setting (thread-safe; closed at exit)."""
    key = (unsafe, size)
    with _POOLS_LOCK:
        if key not in _POOLS:
            _POOLS[key] = SandboxPool(size=size or min(4, os.cpu_count() or 2), unsafe=unsafe,
                                      limits=Limits(wall_s=120.0, cpu_s=120, memory_mb=2048, processes=64),
                                      preload=["ast", "contextlib", "importlib", "inspect", "io", "json",
                                               "linecache", "signal", "traceback"])
            if len(_POOLS) == 1:
                atexit.register(close_pools)
        return _POOLS[key]


def close_pools() -> None:
    with _POOLS_LOCK:
        for pool in _POOLS.values():
            pool.close()
        _POOLS.clear()


def run_tests(workdir: Path, ids: list[str] | None, pool=None, per_test_s: float = 5.0, timeout_s: float = 120.0,
              stop_on_timeout: bool = False, unsafe: bool | None = None) -> TestRun:
    """Run test ids (None: discover all) in the sandbox on `workdir` with the lean runner."""
    pool = pool or shared_pool(unsafe)
    spec = json.dumps({"ids": ids, "per_test_s": per_test_s, "stop_on_timeout": stop_on_timeout})
    code = RUNNER_SOURCE + f"\nmain(__import__('json').loads({spec!r}))\n"
    res = pool.run_python(code, workspace=str(workdir), timeout_s=timeout_s)
    report = next((ln for ln in reversed(res.stdout.splitlines()) if ln.startswith(RESULTS_MARK)), None)
    if report is not None:
        raw = json.loads(report[len(RESULTS_MARK):])
        return TestRun({k: (v[0], v[1]) for k, v in raw.items()}, None, res.duration_s,
                       {k: v[2] for k, v in raw.items() if len(v) > 2})
    why = (f"timed out after {timeout_s:g} s" if res.timed_out else
           res.error or f"runner exited {res.returncode}: {res.stderr.strip()[-300:]}")
    return TestRun({t: ("error", why) for t in ids or []}, why, res.duration_s)


# ---------------------------------------------------------------- grading


@dataclass
class Grade:
    resolved: bool = False
    fail_to_pass: float = 0.0
    pass_to_pass: float = 0.0
    results: dict = field(default_factory=dict)
    diff: str = ""  # the agent's change to non-test files
    files_changed: int = 0
    test_files_touched: list[str] = field(default_factory=list)  # ignored by the grader
    ignored: list[str] = field(default_factory=list)  # other changes the grader could not carry over
    tests_error: str | None = None  # the test run as a whole failed (e.g. an endless loop): reward 0
    error: str | None = None  # the grader could not run (test_patch does not apply, sandbox failure)


def grade(inst: Instance, base: Path, workspace: Path, pool=None, per_test_s: float = 5.0,
          unsafe: bool | None = None) -> Grade:
    """Carry the agent's non-test changes onto a fresh copy of `base`, apply test_patch, run the tests."""
    g = Grade()
    protected = {fp.path for fp in parse_patch(inst.test_patch)} if inst.test_patch.strip() else set()
    base_files, ws_files = list_files(base), list_files(workspace)
    with tempfile.TemporaryDirectory(prefix="flywheel-grade-") as tmp:
        gdir = Path(tmp)
        copy_tree(base, gdir, keep_pycache=True)
        diffs = []
        for rel in sorted(set(base_files) | set(ws_files)):
            a, b = base_files.get(rel), ws_files.get(rel)
            if _same(a, b):
                continue
            if is_test_path(rel) or rel in protected:
                g.test_files_touched.append(rel)
                continue
            dst = gdir / rel
            if _through_link(gdir, str(PurePosixPath(rel).parent)) or (dst.is_dir() and not dst.is_symlink()):
                g.ignored.append(rel)  # e.g. a folder the agent turned into a file or a link
                continue
            g.files_changed += 1
            diffs.append(make_diff(rel, _read_text(a), _read_text(b)))
            if dst.is_symlink() or dst.exists():
                dst.unlink()
            if b is not None:
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(b, dst, follow_symlinks=False)  # a symlink stays a link, resolved inside the sandbox
        g.diff = "".join(diffs)
        if inst.test_patch.strip():
            try:
                apply_patch(gdir, inst.test_patch)
            except PatchError as e:
                g.error = f"test_patch does not apply: {e}"
                return g
        f2p, p2p = inst.FAIL_TO_PASS, inst.PASS_TO_PASS
        # after a first timeout the rest is not run (and counts as not passing): grading stays bounded
        run = run_tests(gdir, f2p + p2p, pool, per_test_s=per_test_s, stop_on_timeout=True, unsafe=unsafe)
    g.results = {t: list(r) for t, r in run.results.items()}
    g.fail_to_pass = sum(map(run.passed, f2p)) / len(f2p)
    g.pass_to_pass = sum(map(run.passed, p2p)) / len(p2p) if p2p else 1.0
    g.resolved = run.error is None and g.fail_to_pass == 1.0 and g.pass_to_pass == 1.0
    g.tests_error = run.error
    return g


# ---------------------------------------------------------------- tools
