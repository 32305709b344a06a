"""`flywheel swe import`: a SWE-bench JSONL file whose repositories are git repositories on
disk, turned into instances flywheel can run.

For each row, `repo` ("owner/name") is looked up under the `--repos` folder as
`owner__name` (SWE-bench's own naming), `name` or `owner/name`; `base_commit` must be a
commit there. The row gains `source: {"kind": "git", "path": ...}` and, when it has none,
the default `environment` (pytest only: add the project's requirements to it). Every error
names the file, the line and the field.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from flywheel.envs.swe.instance import SWEFormatError, SWEInstance, jsonl_rows, parse_instance


def repo_folder(repos: Path, repo: str) -> Path | None:
    """The git repository for `repo` under `repos`, or None."""
    owner, _, name = repo.rpartition("/")
    for cand in ([repos / f"{owner}__{name}", repos / name, repos / owner / name] if owner else [repos / name]):
        if (cand / ".git").exists():
            return cand.resolve()
    return None


def _has_commit(folder: Path, commit: str) -> bool:
    return subprocess.run(["git", "-C", str(folder), "cat-file", "-e", f"{commit}^{{commit}}"],
                          capture_output=True).returncode == 0


def import_instances(path: str | Path, repos: str | Path) -> list[SWEInstance]:
    path, repos = Path(path), Path(repos)
    if not repos.is_dir():
        raise SWEFormatError(f"--repos {repos}: not a folder")
    out, seen = [], {}
    for lineno, where, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise SWEFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
        repo = row.get("repo")
        if not isinstance(repo, str) or not repo.strip():
            raise SWEFormatError(f"{where}: field 'repo' is missing or empty")
        folder = repo_folder(repos, repo.strip())
        if folder is None:
            owner, _, name = repo.rpartition("/")
            raise SWEFormatError(f"{where}: field 'repo': no git repository for {repo!r} under {repos} (looked for "
                                 f"{owner + '__' + name if owner else name}, {name}{', ' + repo if owner else ''})")
        row = {**row, "source": {"kind": "git", "path": str(folder)}}
        inst = parse_instance(row, where)
        if not _has_commit(folder, inst.base_commit):
            raise SWEFormatError(f"{where}: field 'base_commit': {inst.base_commit!r} is not a commit of {folder}")
        if inst.instance_id in seen:
            raise SWEFormatError(f"{where}: field 'instance_id': {inst.instance_id!r} repeats line "
                                 f"{seen[inst.instance_id]}")
        seen[inst.instance_id] = lineno
        out.append(inst)
    if not out:
        raise SWEFormatError(f"{path}: no instances")
    return out
