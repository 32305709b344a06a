"""SWE-bench instances: the JSONL format, read with every field checked and written back.

A row carries SWE-bench's fields:
  instance_id, repo, base_commit, problem_statement, patch (the gold fix), test_patch,
  FAIL_TO_PASS, PASS_TO_PASS (pytest node ids, lists or JSON strings of lists, as on the hub),
  version, and optionally hints_text, created_at, environment_setup_commit;
and flywheel's, each optional:
  source       where the repository at `base_commit` comes from (Source below; default: a git
               repository found by `flywheel swe import --repos DIR`);
  bug_patch    a diff applied on top of the source to make the instance's base (synthesized
               bugs: the source is the released project, the bug is this patch, `patch` undoes it);
  environment  what the test environment installs (EnvironmentSpec below);
  split        "train" / "test" (otherwise a hash of the problem decides, splits.py).
Anything else is kept as is and written back. A bad row is an error naming the file, the line
and the field (`read_instances`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterator


class SWEFormatError(ValueError):
    """A row that is not a valid instance; the message names the file, line and field."""


SOURCE_KINDS = ("pypi_sdist", "git", "folder")
NODE_ID = re.compile(r"^[^\s:][^:]*\.py::\S.*$")  # "tests/test_x.py::test_a" or "...::Class::test_b[p]"
DEFAULT_PYTEST = "pytest==9.2.0"


@dataclass(frozen=True)
class Source:
    """Where an instance's repository comes from.

    pypi_sdist: `name`, `version` and the sdist's `sha256`, fetched with pip (sources.py);
    git:        `path` (a repository on disk), `base_commit` the commit;
    folder:     `path`, a plain folder taken as it is.
    `root`: the folder inside the source that is the repository root ("" = the top)."""

    kind: str
    name: str = ""
    version: str = ""
    sha256: str = ""
    path: str = ""
    root: str = ""

    def row(self) -> dict[str, str]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) or f.name == "kind"}


@dataclass(frozen=True)
class EnvironmentSpec:
    """The test environment of a repository version: a virtualenv with `pip` requirements
    (pytest among them) on this interpreter; the repository itself is imported from the
    workspace (tests run from its root)."""

    pip: tuple[str, ...] = (DEFAULT_PYTEST,)

    def row(self) -> dict[str, Any]:
        return {"pip": list(self.pip)}


def env_key(repo: str, version: str, environment: EnvironmentSpec) -> str:
    """A test environment's cache key: one per repository, version and requirements."""
    return f"{repo}@{version}:{','.join(environment.pip)}"


@dataclass
class SWEInstance:
    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    FAIL_TO_PASS: list[str]
    PASS_TO_PASS: list[str]
    version: str
    source: Source
    environment: EnvironmentSpec = field(default_factory=EnvironmentSpec)
    bug_patch: str = ""
    hints_text: str = ""
    created_at: str = ""
    environment_setup_commit: str = ""
    split: str | None = None
    extra: dict = field(default_factory=dict)  # any other field, kept as is

    @property
    def env_key(self) -> str:
        return env_key(self.repo, self.version, self.environment)

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in (
            "instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch",
            "FAIL_TO_PASS", "PASS_TO_PASS", "version")}
        for k in ("hints_text", "created_at", "environment_setup_commit", "bug_patch"):
            if getattr(self, k):
                out[k] = getattr(self, k)
        out["source"] = self.source.row()
        out["environment"] = self.environment.row()
        if self.split:
            out["split"] = self.split
        return {**out, **self.extra}


_REQUIRED_STR = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch", "version")
_OPTIONAL_STR = ("hints_text", "created_at", "environment_setup_commit", "bug_patch")
_KNOWN = {*_REQUIRED_STR, *_OPTIONAL_STR, "FAIL_TO_PASS", "PASS_TO_PASS", "source", "environment", "split"}


def _tests(row: dict, key: str, where: str) -> list[str]:
    v = row[key]
    if isinstance(v, str):  # the hub's datasets store these as JSON strings
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise SWEFormatError(f"{where}: field {key!r}: a string that is not a JSON list") from None
    if not isinstance(v, list):
        raise SWEFormatError(f"{where}: field {key!r}: expected a list of pytest node ids, got {type(v).__name__}")
    for i, t in enumerate(v):
        if not isinstance(t, str) or not NODE_ID.match(t):
            raise SWEFormatError(f"{where}: field {key!r}[{i}]: {json.dumps(t)[:80]} is not a pytest node id "
                                 "like 'tests/test_x.py::test_name'")
    if len(set(v)) != len(v):
        dup = next(t for t in v if v.count(t) > 1)
        raise SWEFormatError(f"{where}: field {key!r}: {dup!r} is listed twice")
    return v


def _source(row: dict, where: str) -> Source:
    raw = row.get("source", {"kind": "git"})
    if not isinstance(raw, dict):
        raise SWEFormatError(f"{where}: field 'source': expected an object, got {type(raw).__name__}")
    unknown = set(raw) - {f.name for f in fields(Source)}
    if unknown:
        raise SWEFormatError(f"{where}: field 'source': unknown key {sorted(unknown)[0]!r}")
    for k, v in raw.items():
        if not isinstance(v, str):
            raise SWEFormatError(f"{where}: field 'source.{k}': expected a string, got {type(v).__name__}")
    src = Source(**raw)
    if src.kind not in SOURCE_KINDS:
        raise SWEFormatError(f"{where}: field 'source.kind': {src.kind!r} is not one of {', '.join(SOURCE_KINDS)}")
    need = {"pypi_sdist": ("name", "version", "sha256"), "git": (), "folder": ("path",)}[src.kind]
    for k in need:
        if not getattr(src, k):
            raise SWEFormatError(f"{where}: field 'source.{k}': required for a {src.kind} source")
    if src.kind == "pypi_sdist" and not re.fullmatch(r"[0-9a-f]{64}", src.sha256):
        raise SWEFormatError(f"{where}: field 'source.sha256': expected 64 hex digits, got {src.sha256[:80]!r}")
    if src.root and (src.root.startswith("/") or ".." in Path(src.root).parts):
        raise SWEFormatError(f"{where}: field 'source.root': {src.root!r} must be a relative path inside the source")
    return src


def _environment(row: dict, where: str) -> EnvironmentSpec:
    raw = row.get("environment", {})
    if not isinstance(raw, dict):
        raise SWEFormatError(f"{where}: field 'environment': expected an object, got {type(raw).__name__}")
    unknown = set(raw) - {"pip"}
    if unknown:
        raise SWEFormatError(f"{where}: field 'environment': unknown key {sorted(unknown)[0]!r} (known: 'pip')")
    pip = raw.get("pip", [DEFAULT_PYTEST])
    if not isinstance(pip, list) or not all(isinstance(r, str) and r.strip() for r in pip):
        raise SWEFormatError(f"{where}: field 'environment.pip': expected a list of requirement strings")
    bad = next((r for r in pip if r.strip().startswith("-")), None)
    if bad:
        raise SWEFormatError(f"{where}: field 'environment.pip': {bad!r}: options are not requirements")
    if not any(re.match(r"pytest\b", r.strip()) for r in pip):
        raise SWEFormatError(f"{where}: field 'environment.pip': no pytest among {pip} (the harness runs it)")
    return EnvironmentSpec(tuple(r.strip() for r in pip))


def parse_instance(row: Any, where: str = "instance") -> SWEInstance:
    """One row, every field checked; `where` (e.g. "tasks.jsonl:3") starts every error."""
    if not isinstance(row, dict):
        raise SWEFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
    for k in (*_REQUIRED_STR, "FAIL_TO_PASS", "PASS_TO_PASS"):
        if k not in row:
            raise SWEFormatError(f"{where}: field {k!r} is missing")
    for k in (*_REQUIRED_STR, *(k for k in _OPTIONAL_STR if k in row)):
        if not isinstance(row[k], str):
            raise SWEFormatError(f"{where}: field {k!r}: expected a string, got {type(row[k]).__name__}")
    for k in ("instance_id", "repo", "base_commit", "patch", "version", "problem_statement"):
        if not row[k].strip():
            raise SWEFormatError(f"{where}: field {k!r} is empty")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*", row["instance_id"]):
        raise SWEFormatError(f"{where}: field 'instance_id': {row['instance_id'][:80]!r} may hold only letters, "
                             "digits and . _ + - (it names folders)")
    f2p, p2p = _tests(row, "FAIL_TO_PASS", where), _tests(row, "PASS_TO_PASS", where)
    if not f2p:
        raise SWEFormatError(f"{where}: field 'FAIL_TO_PASS' is empty (nothing to fix)")
    both = sorted(set(f2p) & set(p2p))
    if both:
        raise SWEFormatError(f"{where}: field 'PASS_TO_PASS': {both[0]!r} is in FAIL_TO_PASS too")
    split = row.get("split")
    if split is not None and split not in ("train", "test"):
        raise SWEFormatError(f"{where}: field 'split': {split!r} is not 'train' or 'test'")
    return SWEInstance(**{k: row[k] for k in _REQUIRED_STR}, FAIL_TO_PASS=f2p, PASS_TO_PASS=p2p,
                       source=_source(row, where), environment=_environment(row, where),
                       **{k: row.get(k, "") for k in _OPTIONAL_STR}, split=split,
                       extra={k: v for k, v in row.items() if k not in _KNOWN})


def jsonl_rows(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, "path:line", the parsed value) of each non-blank line of a JSONL file; a
    missing file or a line that is not JSON raises SWEFormatError naming it."""
    if not path.is_file():
        raise SWEFormatError(f"{path}: no such file")
    for lineno, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            yield lineno, where, json.loads(line)
        except json.JSONDecodeError as e:
            raise SWEFormatError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None


def read_instances(path: str | Path) -> list[SWEInstance]:
    """Every row of a SWE-bench JSONL file; the first bad one raises SWEFormatError naming
    `path:line` and the field. Blank lines are skipped; an instance_id may appear once."""
    path = Path(path)
    out, seen = [], {}
    for lineno, where, row in jsonl_rows(path):
        inst = parse_instance(row, where)
        if inst.instance_id in seen:
            raise SWEFormatError(f"{where}: field 'instance_id': {inst.instance_id!r} repeats line "
                                 f"{seen[inst.instance_id]}")
        seen[inst.instance_id] = lineno
        out.append(inst)
    if not out:
        raise SWEFormatError(f"{path}: no instances")
    return out


def write_instances(path: str | Path, instances: list[SWEInstance]) -> None:
    """One JSON row per instance, written to a temporary file renamed into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(i.row(), ensure_ascii=False) + "\n" for i in instances), encoding="utf-8")
    tmp.replace(path)


@dataclass(frozen=True)
class Prediction:
    """One row of a SWE-bench predictions file."""

    instance_id: str
    model_patch: str
    model_name_or_path: str = ""


def read_predictions(path: str | Path) -> list[Prediction]:
    """SWE-bench predictions (JSONL rows, or one JSON list): `instance_id`, `model_patch` (a
    unified diff; null or "" is the empty patch), optional `model_name_or_path`. A bad row is
    an error naming `path:line` and the field; an instance predicted twice too."""
    path = Path(path)
    if not path.is_file():
        raise SWEFormatError(f"{path}: no such file")
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        try:
            rows = [(f"{path}[{i}]", r) for i, r in enumerate(json.loads(text))]
        except json.JSONDecodeError as e:
            raise SWEFormatError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    else:
        rows = [(where, row) for _, where, row in jsonl_rows(path)]
    out, seen = [], {}
    for where, row in rows:
        if not isinstance(row, dict):
            raise SWEFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
        iid = row.get("instance_id")
        if not isinstance(iid, str) or not iid.strip():
            raise SWEFormatError(f"{where}: field 'instance_id' is missing or not a string")
        patch = row.get("model_patch", None)
        if "model_patch" not in row:
            raise SWEFormatError(f"{where}: field 'model_patch' is missing")
        if patch is not None and not isinstance(patch, str):
            raise SWEFormatError(f"{where}: field 'model_patch': expected a string (a unified diff) or null, "
                                 f"got {type(patch).__name__}")
        name = row.get("model_name_or_path", "")
        if not isinstance(name, str):
            raise SWEFormatError(f"{where}: field 'model_name_or_path': expected a string")
        if iid in seen:
            raise SWEFormatError(f"{where}: field 'instance_id': {iid!r} was predicted already at {seen[iid]}")
        seen[iid] = where
        out.append(Prediction(iid, patch or "", name))
    if not out:
        raise SWEFormatError(f"{path}: no predictions")
    return out
