"""Repositories and SWE-bench-style instances for code_repair: reading and checking
instances, copying a repository at a commit, test-file rules, fingerprints."""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import py_compile
import shutil
import subprocess
import tarfile
import threading
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath



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
    compiling (a sizeable share of a minilib verification) yet stay correct for any edited file: the pyc is
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
