"""code_repair: SWE-style bug fixing in a sandboxed copy of a repository.

An instance is a JSONL row with SWE-bench's field names: instance_id, repo, base_commit,
problem_statement, patch (gold fix), test_patch, FAIL_TO_PASS, PASS_TO_PASS (test ids
"tests/test_x.py::test_name", lists or JSON strings of lists). `repo` is a bundled corpus name
(src/flywheel/envs/corpora/<name>), a git repository or a plain folder (a relative path is taken
from the JSONL file's folder). `base_commit` is a commit of a git repository, or for a folder
the fingerprint `synth-bugs` recorded ("sha256:...", checked) or "". An optional `bug_patch`
(written by `flywheel env synth-bugs`) is applied on top of that to make the buggy state.

Episode, as in SWE-bench: the agent works in a fresh copy of the buggy repository with `bash`
(run in the sandbox; timeout; capped output), `read_file`, `str_replace` and `submit`. Grading
uses another fresh copy: the agent's changes to non-test files are carried over, test files
stay as in the base and `test_patch` is applied, then FAIL_TO_PASS + PASS_TO_PASS run in the
sandbox through the lean runner (corpora/_lean_runner.py) forked from a warm SandboxPool, in a
worker thread. Reward 1 iff all of them pass, so editing or deleting tests cannot help;
`fail_to_pass` / `pass_to_pass` (weight 0) are the passing fractions.

Sections: instances · repositories and patches · running tests · grading · tools · env.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import difflib
import hashlib
import importlib.util
import io
import json
import os
import py_compile
import random
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import threading
import weakref
import zlib
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from flywheel.envs.base import Env, Environment, Policy
from flywheel.envs.rubric import EpisodeState, RewardFn, Rubric
from flywheel.envs.tool_env import ToolEnv, ToolLimits
from flywheel.envs.tools import EpisodeFinished, Tool, ToolError
from flywheel.types import Task

CORPORA = Path(__file__).resolve().parent / "corpora"
DEFAULT_CORPUS = "minilib"
RUNNER_SOURCE = (CORPORA / "_lean_runner.py").read_text()
RESULTS_MARK = "@@flywheel-test-results@@"
IGNORED = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".venv", "venv", ".tox",
           "node_modules"}


class CodeRepairError(ValueError):
    """Bad instances, repositories or patches; the message says which and why."""


class PatchError(CodeRepairError):
    """A patch that does not parse or does not apply."""


# ---------------------------------------------------------------- instances


@dataclass
class Instance:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    bug_patch: str = ""
    split: str | None = None
    extra: dict = field(default_factory=dict)  # any other field, kept as is
    repo_path: Path | None = None  # resolved location (not serialized)

    def row(self) -> dict:
        out = {k: getattr(self, k) for k in ("instance_id", "repo", "base_commit", "problem_statement", "patch",
                                             "test_patch", "FAIL_TO_PASS", "PASS_TO_PASS")}
        if self.bug_patch:
            out["bug_patch"] = self.bug_patch
        if self.split:
            out["split"] = self.split
        return {**out, **self.extra}


_STR_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch")


def parse_instance(row, where: str = "instance", base_dir: Path | None = None) -> Instance:
    """Validate one row; `where` (e.g. "tasks.jsonl:3") prefixes every error."""
    if not isinstance(row, dict):
        raise CodeRepairError(f"{where}: expected a JSON object, got {type(row).__name__}")
    missing = [k for k in (*_STR_FIELDS, "FAIL_TO_PASS", "PASS_TO_PASS") if k not in row]
    if missing:
        raise CodeRepairError(f"{where}: missing field{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))}")
    for k in _STR_FIELDS + ("bug_patch",):
        if k in row and not isinstance(row[k], str):
            raise CodeRepairError(f"{where}: field {k!r} must be a string, got {type(row[k]).__name__}")
    for k in ("instance_id", "repo", "patch"):
        if not row[k].strip():
            raise CodeRepairError(f"{where}: field {k!r} is empty")
    tests = {}
    for k in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        v = row[k]
        if isinstance(v, str):  # SWE-bench on the hub stores these as JSON strings
            try:
                v = json.loads(v)
            except json.JSONDecodeError:
                raise CodeRepairError(f"{where}: field {k!r} is a string that is not a JSON list") from None
        if not isinstance(v, list) or not all(isinstance(t, str) and "::" in t for t in v):
            raise CodeRepairError(f"{where}: field {k!r} must be a list of test ids like "
                                  f"'tests/test_x.py::test_name', got {json.dumps(v)[:80]}")
        tests[k] = v
    if not tests["FAIL_TO_PASS"]:
        raise CodeRepairError(f"{where}: field 'FAIL_TO_PASS' is empty (nothing to fix)")
    known = {*_STR_FIELDS, "FAIL_TO_PASS", "PASS_TO_PASS", "bug_patch", "split"}
    inst = Instance(**{k: row[k] for k in _STR_FIELDS}, **tests, bug_patch=row.get("bug_patch", ""),
                    split=row.get("split"), extra={k: v for k, v in row.items() if k not in known})
    inst.repo_path = resolve_repo(inst.repo, base_dir, where)
    return inst


def read_instances(path: str | Path) -> list[Instance]:
    path = Path(path)
    if not path.is_file():
        raise CodeRepairError(f"instances file {path} not found")
    out, seen = [], {}
    for lineno, line in enumerate(path.read_text().split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CodeRepairError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
        inst = parse_instance(row, where, path.parent)
        if inst.instance_id in seen:
            raise CodeRepairError(f"{where}: instance_id {inst.instance_id!r} repeats line {seen[inst.instance_id]}")
        seen[inst.instance_id] = lineno
        out.append(inst)
    if not out:
        raise CodeRepairError(f"{path}: no instances")
    return out


def write_instances(path: str | Path, instances: list[Instance]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text("".join(json.dumps(i.row()) + "\n" for i in instances))
    tmp.replace(path)  # a reader never sees half a file


# ---------------------------------------------------------------- repositories and patches


def resolve_repo(repo: str, base_dir: Path | None = None, where: str = "repo") -> Path:
    """A corpus name, or a folder (relative paths: from base_dir first, then the current folder)."""
    if "/" not in repo and (CORPORA / repo).is_dir() and not repo.startswith(("_", ".")):
        return CORPORA / repo
    p = Path(repo).expanduser()
    for cand in ([base_dir / p] if base_dir and not p.is_absolute() else []) + [p]:
        if cand.is_dir():
            return cand.resolve()
    corpora = sorted(d.name for d in CORPORA.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))
    raise CodeRepairError(f"{where}: repo {repo!r} is neither a folder nor a bundled corpus ({', '.join(corpora)})")


TEST_DIRS = ("tests", "test", "testing")


def is_test_path(rel: str) -> bool:
    """Paths the grader takes from the base (+ test_patch), never from the agent: test files and
    test folders themselves (an agent may not swap `tests/` for a link to its own tests)."""
    parts = PurePosixPath(rel).parts
    name = parts[-1] if parts else ""
    return (any(p in TEST_DIRS for p in parts) or name.startswith("test_") or name.endswith("_test.py")
            or name == "conftest.py")


def _through_link(root: Path, rel: str) -> bool:
    """True when root/rel or one of its folders below root is a symlink (writing there would leave root)."""
    p = root
    for part in PurePosixPath(rel).parts:
        p = p / part
        if p.is_symlink():
            return True
    return False


def list_files(root: Path) -> dict[str, Path]:
    """Files under root by relative POSIX path, without caches and VCS folders; symlinks (to folders
    too) are entries of their own and never followed."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in IGNORED and not d.endswith(".egg-info") and d not in links]
        for f in filenames + links:
            if not f.endswith((".pyc", ".pyo")):
                out[os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/")] = Path(dirpath, f)
    return out


def copy_tree(src: Path, dst: Path, keep_pycache: bool = False) -> None:
    skip = IGNORED - {"__pycache__"} if keep_pycache else IGNORED
    shutil.copytree(src, dst, symlinks=True, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(*skip, *(() if keep_pycache else ("*.pyc",)), "*.egg-info"))


def precompile(root: Path) -> None:
    """Write checked-hash .pyc files (PEP 552) for the .py files under root. Imports then skip
    compiling (~25 % of a minilib verification) yet stay correct for any edited file: the pyc is
    used only if the source's hash matches, whatever the mtimes say (copies keep mtimes, mutants
    keep sizes)."""
    for rel, path in list_files(root).items():
        if rel.endswith(".py") and not path.is_symlink():
            try:
                py_compile.compile(str(path), cfile=importlib.util.cache_from_source(str(path)), doraise=True,
                                   invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH)
            except (py_compile.PyCompileError, OSError, ValueError):
                pass


def fingerprint(root: Path) -> str:
    h = hashlib.sha256()
    for rel, p in sorted(list_files(root).items()):
        h.update(rel.encode() + b"\0" + (os.readlink(p).encode() if p.is_symlink() else p.read_bytes()) + b"\0")
    return "sha256:" + h.hexdigest()[:16]


def is_git_repo(path: Path) -> bool:
    return (path / ".git").exists()


def checkout(src: Path, commit: str, dest: Path, label: str = "") -> None:
    """`src` at `commit` into dest: `git archive` for a git repository and a commit, else a copy of the
    folder (without VCS and cache folders), checked against a "sha256:..." fingerprint if given."""
    label = label or str(src)
    commit = commit.strip()
    if is_git_repo(src) and commit and not commit.startswith("sha256:"):
        proc = subprocess.run(["git", "-C", str(src), "archive", "--format=tar", commit], capture_output=True)
        if proc.returncode:
            raise CodeRepairError(f"{label}: git archive {commit} failed: "
                                  f"{proc.stderr.decode(errors='replace').strip()}")
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return
    copy_tree(src, dest)
    if commit.startswith("sha256:") and fingerprint(dest) != commit:
        raise CodeRepairError(f"{label}: {src} changed since the instance was made (fingerprint {fingerprint(dest)}, "
                              f"instance has {commit}); re-run synth-bugs")


def materialize(inst: Instance, dest: Path) -> None:
    """The buggy state of an instance in `dest`: repo at base_commit, then bug_patch."""
    checkout(inst.repo_path or resolve_repo(inst.repo), inst.base_commit, dest, inst.instance_id)
    if inst.bug_patch:
        try:
            apply_patch(dest, inst.bug_patch)
        except PatchError as e:
            raise CodeRepairError(f"{inst.instance_id}: bug_patch: {e}") from None


def split_lines(text: str, python: bool = False) -> list[str]:
    """Lines with their endings, as diff, patch and git count them (split after each \\n only), or with
    python=True as Python's tokenizer does (\\r\\n, \\r, \\n). Never str.splitlines, which also splits
    at \\f, \\x1c, \\u2028 and others."""
    return io.StringIO(text, newline="" if python else "\n").readlines()


@dataclass
class FilePatch:
    old: str | None  # None: the file is created
    new: str | None  # None: the file is deleted
    hunks: list[tuple[int, int, list[tuple[str, str]]]]  # (old_start, old_len, [(" "|"-"|"+", line)])

    @property
    def path(self) -> str:
        return self.new or self.old


def _patch_path(raw: str) -> str | None:
    raw = raw.split("\t")[0].strip()
    if raw == "/dev/null":
        return None
    if raw.startswith(("a/", "b/")):
        raw = raw[2:]
    p = PurePosixPath(raw)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise PatchError(f"unsafe path in patch: {raw!r}")
    return str(p)


def parse_patch(text: str) -> list[FilePatch]:
    """Unified diff (git or diff -u style, a/ b/ prefixes or none) -> file patches."""
    lines, files, i = split_lines(text), [], 0
    while i < len(lines):
        line = lines[i]
        if line.startswith(("Binary files", "GIT binary patch")):
            raise PatchError("binary patches are not supported")
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            files.append(FilePatch(_patch_path(line[4:]), _patch_path(lines[i + 1][4:]), []))
            i += 2
            continue
        if not line.startswith("@@"):
            i += 1
            continue
        if not files:
            raise PatchError(f"line {i + 1}: hunk before any '---'/'+++' file header")
        try:
            head = line.split("@@")[1].split()
            (o_start, o_len), (_, n_len) = [tuple(map(int, (h[1:] + ",1").split(",")[:2])) for h in head[:2]]
        except (IndexError, ValueError):
            raise PatchError(f"line {i + 1}: bad hunk header {line.strip()!r}") from None
        body, n_old, n_new, i = [], 0, 0, i + 1
        while i < len(lines):
            raw = lines[i]
            if raw.startswith("\\"):  # "\ No newline at end of file": the line before has none
                if body:
                    body[-1] = (body[-1][0], body[-1][1].rstrip("\r\n"))
                i += 1
                continue
            if n_old >= o_len and n_new >= n_len:
                break
            tag, rest = (" ", raw) if raw in ("\n", "\r\n") else (raw[:1], raw[1:])  # blank context, space stripped
            if tag not in (" ", "-", "+"):
                break
            body.append((tag, rest))
            n_old += tag in " -"
            n_new += tag in " +"
            i += 1
        if n_old != o_len or n_new != n_len:
            raise PatchError(f"{files[-1].path}: hunk {line.strip()!r} is truncated or malformed "
                             f"(expected {o_len} old / {n_len} new lines, found {n_old} / {n_new})")
        files[-1].hunks.append((o_start, o_len, body))
    if not files:
        raise PatchError("no file changes found in the patch (expected a unified diff)")
    return files


def _apply_hunks(path: str, text: str, hunks) -> str:
    lines, out, pos, offset = split_lines(text), [], 0, 0
    for n, (o_start, o_len, body) in enumerate(hunks, 1):
        old = [t for tag, t in body if tag != "+"]
        new = [t for tag, t in body if tag != "-"]
        want = max((o_start if o_len == 0 else o_start - 1) + offset, pos)
        at = next((c for d in range(len(lines) + 1) for c in (want - d, want + d)
                   if pos <= c <= len(lines) - len(old) and lines[c:c + len(old)] == old), None)
        if at is None:
            first = next((t.rstrip() for tag, t in body if tag != "+"), "")
            raise PatchError(f"{path}: hunk {n} (@@ -{o_start},{o_len}) does not apply: its context/removed lines "
                             f"(starting {first!r}) are not in the file")
        out += lines[pos:at] + new
        pos, offset = at + len(old), at - (o_start - 1)
    return "".join(out + lines[pos:])


def apply_patch(root: Path, patch: str) -> list[str]:
    """Apply a unified diff under root (all files or none); returns the paths changed."""
    root, staged = Path(root), {}
    for fp in parse_patch(patch):
        for rel in {fp.old, fp.new} - {None}:
            if _through_link(root, rel):
                raise PatchError(f"{rel}: refusing to patch through a symbolic link")
        src = fp.old or fp.new
        if fp.old is None:
            if (root / fp.new).exists() or staged.get(fp.new) is not None:
                raise PatchError(f"{fp.new}: the patch creates it but it already exists")
            text = ""
        elif staged.get(fp.old) is not None:
            text = staged[fp.old]
        elif fp.old not in staged and (root / fp.old).is_file():
            text = (root / fp.old).read_bytes().decode("utf-8", errors="surrogateescape")
        else:
            raise PatchError(f"{fp.old}: the patch changes it but it does not exist")
        new_text = _apply_hunks(src, text, fp.hunks)
        if fp.new is None and new_text:
            raise PatchError(f"{fp.old}: the patch deletes it but its content differs")
        if fp.old is not None and fp.new is not None and fp.old != fp.new:  # a rename
            staged[fp.old] = None
        staged[fp.new or fp.old] = None if fp.new is None else new_text
    for rel, text in staged.items():
        target = root / rel
        if text is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(text.encode("utf-8", errors="surrogateescape"))
    return list(staged)


def make_diff(rel: str, old: str | None, new: str | None, context: int = 3) -> str:
    """git-style unified diff of one file (old/new None: created/deleted), `patch -p1`-able."""
    a, b = split_lines(old or ""), split_lines(new or "")
    if a == b and (old is None) == (new is None):
        return ""
    head = f"diff --git a/{rel} b/{rel}\n"
    head += "new file mode 100644\n" if old is None else "deleted file mode 100644\n" if new is None else ""
    head += f"--- {'/dev/null' if old is None else 'a/' + rel}\n+++ {'/dev/null' if new is None else 'b/' + rel}\n"

    def span(start, n):
        return f"{start + 1 if n else start},{n}" if n != 1 else f"{start + 1}"

    def emit(tag, line):
        return tag + line + ("" if line.endswith("\n") else "\n\\ No newline at end of file\n")

    out = [head]
    for group in difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{span(i1, i2 - i1)} +{span(j1, j2 - j1)} @@\n")
        for op, x1, x2, y1, y2 in group:
            out += [emit(" ", s) for s in a[x1:x2]] if op == "equal" else []
            out += [emit("-", s) for s in a[x1:x2]] if op in ("replace", "delete") else []
            out += [emit("+", s) for s in b[y1:y2]] if op in ("replace", "insert") else []
    return "".join(out)


def _read_text(p: Path | None) -> str | None:
    if p is None:
        return None
    if p.is_symlink():
        return f"(symlink to {os.readlink(p)})\n"
    return p.read_bytes().decode("utf-8", errors="surrogateescape")


def _same(a: Path | None, b: Path | None) -> bool:
    if a is None or b is None:
        return a is b
    if a.is_symlink() or b.is_symlink():
        return a.is_symlink() and b.is_symlink() and os.readlink(a) == os.readlink(b)
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


# ---------------------------------------------------------------- running tests


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
    from flywheel.sandbox import Limits, SandboxPool

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


class RepoTools:
    """The agent's tools on one workspace; paths are relative to the repository root."""

    def __init__(self, root: Path, sandbox, max_bash_timeout_s: int = 60, max_read_lines: int = 300):
        self.root, self.real_root = root, root.resolve()
        self.sandbox, self.max_bash_timeout_s, self.max_read_lines = sandbox, max_bash_timeout_s, max_read_lines
        self.setup_error: str | None = None
        self.output_bytes = 64 << 10  # a command printing more is stopped (the sandbox kills it)

    def _path(self, tool: str, path: str) -> Path:
        if self.setup_error:
            raise ToolError("exception", f"{tool}: the workspace could not be prepared: {self.setup_error}")
        p = PurePosixPath(path.strip())
        if not path.strip():
            raise ToolError("bad_arguments", f"{tool}: empty path")
        if p.is_absolute():
            hint = f" such as {str(p)[len('/workspace/'):]!r}" if str(p).startswith("/workspace/") else ""
            raise ToolError("bad_arguments", f"{tool}: absolute path {path!r} refused; use a path relative to the "
                                             f"repository root{hint}")
        full = (self.root / p).resolve()
        if full != self.real_root and not full.is_relative_to(self.real_root):
            raise ToolError("bad_arguments", f"{tool}: {path!r} is outside the repository")
        return full

    def bash(self, command: str, timeout: int = 10) -> str:
        """Run a bash command in the repository root (the working directory; no network).

        Args:
            command: shell command, e.g. "ls -R", "grep -rn parse src" or "python -m pytest -q tests/test_x.py".
            timeout: seconds before the command is killed (capped by the environment).
        """
        from flywheel.sandbox import Limits

        if self.setup_error:
            raise ToolError("exception", f"bash: the workspace could not be prepared: {self.setup_error}")
        t = max(1, min(int(timeout), self.max_bash_timeout_s))
        res = self.sandbox.run(["bash", "-c", "exec 2>&1\n" + command], workspace=str(self.root),
                               limits=Limits(wall_s=float(t), cpu_s=t, memory_mb=1024, output_bytes=self.output_bytes))
        out = (res.stdout or "") + (res.stderr or "")
        status = (f"[killed: timed out after {t} s]" if res.timed_out else
                  f"[killed: more than {self.output_bytes} bytes of output]" if res.truncated else
                  f"[killed: {res.error}]" if res.error else f"[exit code {res.returncode}]")
        return (out.rstrip("\n") + "\n" + status).lstrip("\n")

    def read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        """Show a file's lines with their numbers.

        Args:
            path: file path relative to the repository root, e.g. "pkg/module.py".
            start_line: first line to show (1-based).
            end_line: last line to show (inclusive); default: to the end, at most 300 lines.
        """
        full = self._path("read_file", path)
        if full.is_dir():
            entries = sorted(e.name + ("/" if e.is_dir() else "") for e in full.iterdir() if e.name not in IGNORED)
            raise ToolError("bad_arguments", f"read_file: {path!r} is a directory; entries: {', '.join(entries)}")
        if not full.is_file():
            raise ToolError("bad_arguments", f"read_file: {path!r} does not exist")
        data = full.read_bytes()
        if b"\0" in data[:8192]:
            raise ToolError("bad_arguments", f"read_file: {path!r} is a binary file")
        lines = [ln.rstrip("\r\n") for ln in split_lines(data.decode("utf-8", errors="replace"))]
        if start_line < 1 or (lines and start_line > len(lines)) or (end_line is not None and end_line < start_line):
            raise ToolError("bad_arguments", f"read_file: bad line range {start_line}-{end_line} "
                                             f"({path!r} has {len(lines)} lines)")
        last = len(lines) if end_line is None else min(end_line, len(lines))
        last = min(last, start_line + self.max_read_lines - 1)
        shown = "\n".join(f"{n:>5}\t{lines[n - 1]}" for n in range(start_line, last + 1))
        cut = last < len(lines) and (end_line is None or last < end_line)  # stopped by max_read_lines
        more = f"; call again with start_line={last + 1} for more" if cut else ""
        return f"{path} (lines {start_line}-{last} of {len(lines)}{more})\n{shown}"

    def str_replace(self, path: str, old: str, new: str) -> str:
        """Edit a file: replace `old`, which must occur exactly once, with `new`.

        Args:
            path: file path relative to the repository root.
            old: the exact text to replace (whitespace and indentation included); add neighbouring lines
                to make it unique.
            new: the replacement text.
        """
        full = self._path("str_replace", path)
        if not full.is_file():
            raise ToolError("bad_arguments", f"str_replace: {path!r} does not exist (create files with bash)")
        if not old:
            raise ToolError("bad_arguments", "str_replace: 'old' is empty")
        try:
            text = full.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ToolError("bad_arguments", f"str_replace: {path!r} is not UTF-8 text") from None
        count = text.count(old)
        if count != 1:
            raise ToolError("bad_arguments", f"str_replace: the old text occurs {count} times in {path!r}; it must "
                            "occur exactly once" + (" (whitespace and indentation must match)" if count == 0 else
                                                    " (include more surrounding lines)"))
        at = text.index(old)
        full.write_bytes(text.replace(old, new, 1).encode("utf-8"))
        first = text.count("\n", 0, at) + 1
        return (f"edited {path}: replaced lines {first}-{first + old.count(chr(10))} with "
                f"{new.count(chr(10)) + 1} line(s)")

    def submit(self) -> str:
        """Submit the current state of the repository for grading; this ends the episode."""
        raise EpisodeFinished(True, "submitted; the change will now be graded by the repository's tests")


# ---------------------------------------------------------------- the environment

SYSTEM = ("You are a software engineer fixing a bug in a Python repository, which is your working directory. "
          "Tools: `bash` runs a shell command there (no network), `read_file` shows numbered lines, "
          "`str_replace` replaces text that occurs exactly once in a file, `submit` ends the episode. "
          "Your change is graded by running the repository's tests; test files are restored before grading, "
          "so fix the code, not the tests.")


class CodeRepairEnv(ToolEnv):
    """One episode: a fresh workspace, the tools on it, grading at the end, then cleanup."""

    def __init__(self, spec: "CodeRepairEnvironment", task: Task):
        from flywheel.sandbox import Sandbox

        self.spec, self.inst = spec, spec.instance_of(task)
        self.root = Path(tempfile.mkdtemp(prefix="flywheel-ws-"))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self.repo_tools = RepoTools(self.root, Sandbox(unsafe=spec.unsafe), spec.max_bash_timeout_s)
        t = self.repo_tools
        tools = [Tool.from_function(t.bash, timeout_s=spec.max_bash_timeout_s + 15.0),
                 Tool.from_function(t.read_file, timeout_s=15.0), Tool.from_function(t.str_replace, timeout_s=15.0),
                 Tool.from_function(t.submit, timeout_s=15.0)]
        super().__init__(task, tools, spec.rubric, spec.limits)
        self.state.scratch.update(env=self)
        self._ready = False

    def _setup(self) -> None:
        try:
            copy_tree(self.spec.base_snapshot(self.inst), self.root, keep_pycache=True)
        except (CodeRepairError, OSError) as e:
            self.repo_tools.setup_error = str(e)
            self.state.metrics["setup_error"] = 1.0

    async def initial_observation(self):
        if not self._ready:
            self._ready = True
            await asyncio.to_thread(self._setup)
        return self.task.prompt

    async def step(self, action: str):
        if not self._ready:
            await self.initial_observation()
        result = await super().step(action)
        if result.done:
            await asyncio.to_thread(self._cleanup)
        return result

    async def graded(self) -> Grade:
        """The grade of this episode (computed once, in a worker thread)."""
        st = self.state
        if "grade" not in st.scratch:
            st.scratch["grade"] = asyncio.ensure_future(asyncio.to_thread(self._grade))
        return await st.scratch["grade"]

    def _grade(self) -> Grade:
        if self.repo_tools.setup_error:
            return Grade(error=f"setup failed: {self.repo_tools.setup_error}")
        try:
            g = grade(self.inst, self.spec.base_snapshot(self.inst), self.root, self.spec.pool(),
                      self.spec.per_test_timeout_s, self.spec.unsafe)
        except Exception as e:  # the grader's own failure ends as reward 0 and a metric, never a crash
            g = Grade(error=f"{type(e).__name__}: {e}")
        m = self.state.metrics
        m.update(files_changed=float(g.files_changed), test_files_touched=float(len(g.test_files_touched)),
                 tests_error=float(g.tests_error is not None), grading_error=float(g.error is not None))
        self.state.scratch["diff"] = g.diff
        return g


class CodeRepairEnvironment(Environment):
    name = "code_repair"
    description = "SWE-style repair: fix a bug in a sandboxed repository until its tests pass (bash, read_file, " \
                  "str_replace, submit)"

    def __init__(self, instances: list[Instance], source: str = "", limits: ToolLimits | None = None,
                 max_bash_timeout_s: int = 60, per_test_timeout_s: float = 5.0, unsafe: bool | None = None,
                 test_fraction: float = 0.2):
        if not instances:
            raise CodeRepairError("no instances")
        self.instances, self.source, self.unsafe = instances, source, unsafe
        self.limits = limits or ToolLimits(max_turns=30, max_observation_tokens=4096, episode_timeout_s=900.0)
        self.max_bash_timeout_s, self.per_test_timeout_s = int(max_bash_timeout_s), float(per_test_timeout_s)
        self.test_fraction = test_fraction
        self.rubric = Rubric([RewardFn(self._resolved, 1.0, "resolved"), RewardFn(self._f2p, 0.0, "fail_to_pass"),
                              RewardFn(self._p2p, 0.0, "pass_to_pass")])
        self._snapshots: dict[tuple, Path] = {}
        self._snap_lock = threading.Lock()
        self._snap_root = Path(tempfile.mkdtemp(prefix="flywheel-code-repair-"))
        weakref.finalize(self, shutil.rmtree, str(self._snap_root), True)
        tmp = RepoTools(self._snap_root, None)
        self.tool_schemas = [Tool.from_function(f).schema for f in (tmp.bash, tmp.read_file, tmp.str_replace,
                                                                     tmp.submit)]
        self._by_id = {i.instance_id: i for i in instances}

    def pool(self):
        return shared_pool(self.unsafe)

    def instance_of(self, task: Task) -> Instance:
        """The task's instance (rebuilt from its metadata when the task came from elsewhere)."""
        inst = self._by_id.get(task.id)
        if inst is None or inst.row() != task.metadata.get("instance"):
            inst = parse_instance(task.metadata.get("instance"), f"task {task.id}")
        return inst

    def base_snapshot(self, inst: Instance) -> Path:
        """The buggy repository of an instance, materialized once per environment (read-only use)."""
        key = (str(inst.repo_path), inst.base_commit, zlib.crc32(inst.bug_patch.encode()), inst.bug_patch)
        with self._snap_lock:
            if key not in self._snapshots:
                dest = self._snap_root / f"s{len(self._snapshots)}"
                try:
                    materialize(inst, dest)
                    precompile(dest)
                except BaseException:
                    shutil.rmtree(dest, ignore_errors=True)
                    raise
                self._snapshots[key] = dest
            return self._snapshots[key]

    @staticmethod
    async def _resolved(st: EpisodeState) -> float:
        return float((await st.scratch["env"].graded()).resolved)

    @staticmethod
    async def _f2p(st: EpisodeState) -> float:
        return (await st.scratch["env"].graded()).fail_to_pass

    @staticmethod
    async def _p2p(st: EpisodeState) -> float:
        return (await st.scratch["env"].graded()).pass_to_pass

    def split_of(self, inst: Instance) -> str:
        if inst.split:
            return inst.split
        return "test" if zlib.crc32(inst.instance_id.encode()) % 1000 < self.test_fraction * 1000 else "train"

    def tasks(self, split: str = "train", n: int | None = None, seed: int = 0) -> list[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        chosen = [i for i in self.instances if self.split_of(i) == split]
        if not chosen:  # a handful of instances without `split` fields: every split is all of them
            chosen = list(self.instances)
        if n is not None and n < len(chosen):
            chosen = random.Random(seed).sample(chosen, n)
        return [Task(id=i.instance_id, split=split, answer=i.patch, tools=self.tool_schemas,
                     prompt=[{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"{i.problem_statement.strip()}\n\n(repository: "
                                                         f"{Path(i.repo).name})"}],
                     metadata={"instance": i.row(), "repo_path": str(i.repo_path)}) for i in chosen]

    def make_env(self, task: Task) -> Env:
        return CodeRepairEnv(self, task)

    def scripted_policy(self) -> Policy:
        return GoldPatchPolicy()

    def info(self) -> dict:
        return {**super().info(), "instances": len(self.instances), "source": self.source,
                "splits": {s: sum(self.split_of(i) == s for i in self.instances) for s in ("train", "test")},
                "tools": self.tool_schemas, "limits": dataclasses.asdict(self.limits),
                "reward": "1 iff every FAIL_TO_PASS and PASS_TO_PASS test passes with the instance's tests; "
                          "metrics fail_to_pass, pass_to_pass (fractions)"}


def edits_from_patch(patch: str) -> list[dict]:
    """Tool calls that make `patch`: one str_replace per hunk of a changed file, bash for created/deleted files."""
    calls = []
    for fp in parse_patch(patch):
        if fp.old is None or fp.new is None:
            if fp.new is None:
                cmd = f"rm -- {shlex.quote(fp.old)}"
            else:
                body = "".join(t for tag, t in fp.hunks[0][2] if tag == "+") if fp.hunks else ""
                cmd = (f"mkdir -p -- {shlex.quote(str(PurePosixPath(fp.new).parent))} && "
                       f"printf %s {shlex.quote(body)} > {shlex.quote(fp.new)}")
            calls.append({"name": "bash", "arguments": {"command": cmd}})
            continue
        for _, _, body in fp.hunks:
            calls.append({"name": "str_replace", "arguments": {
                "path": fp.path, "old": "".join(t for tag, t in body if tag != "+"),
                "new": "".join(t for tag, t in body if tag != "-")}})
    return calls


class GoldPatchPolicy(Policy):
    """Makes the gold patch with str_replace calls (a few per turn), then submits."""

    per_turn = 3

    async def act(self, task, history, tools, episode: int = 0) -> str:
        calls = edits_from_patch(task.answer) + [{"name": "submit", "arguments": {}}]
        done = sum(1 for m in history if isinstance(m, dict) and m.get("role") == "assistant")
        batch = calls[done * self.per_turn:(done + 1) * self.per_turn] or calls[-1:]
        return "Applying the fix.\n" + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in batch)


def load(instances: str | None = None, corpus: str = DEFAULT_CORPUS, max_turns: int = 30,
         max_bash_timeout_s: int = 60, per_test_timeout_s: float = 5.0, max_instances: int = 100, seed: int = 0,
         unsafe: bool | None = None, cache_dir: str | None = None, max_observation_tokens: int = 4096,
         episode_timeout_s: float = 900.0) -> CodeRepairEnvironment:
    """instances: a JSONL file; default: up to `max_instances` bugs synthesized (seeded) from the bundled
    `corpus` and cached under cache_dir (default $FLYWHEEL_CACHE_DIR or ~/.cache/flywheel)."""
    if instances is not None:
        rows, source = read_instances(instances), str(instances)
    else:
        from flywheel.envs.synth_bugs import cached_corpus_instances

        path = cached_corpus_instances(corpus, max_n=int(max_instances), seed=int(seed), cache_dir=cache_dir,
                                       unsafe=unsafe)
        rows, source = read_instances(path), f"synthesized from corpus {corpus!r} ({path})"
    limits = ToolLimits(max_turns=int(max_turns), max_observation_tokens=int(max_observation_tokens),
                        episode_timeout_s=float(episode_timeout_s))
    return CodeRepairEnvironment(rows, source, limits, max_bash_timeout_s, per_test_timeout_s, unsafe)
