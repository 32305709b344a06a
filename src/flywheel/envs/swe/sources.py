"""Repositories for SWE-style instances: real projects pinned on the package index, git
repositories and folders on disk, each unpacked once into the cache as a read-only base tree.

The built-in projects (`PROJECTS`) are permissively licensed Python projects whose source
distributions ship their test suites. Each is pinned to a version and the sdist's sha256,
fetched with `pip download --no-binary :all: --no-deps` (never from a model or dataset hub),
checked against the hash, and unpacked under $FLYWHEEL_CACHE_DIR/swe/trees/. Licences, read
from each sdist's LICENSE file: boltons BSD-3-Clause, toolz BSD-3-Clause, more-itertools MIT;
what each sdist's metadata declares is checked by tests/integration/test_swe_sources.py.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from flywheel.envs.swe.instance import Source
from flywheel.locations import cache_dir


class SourceError(RuntimeError):
    """A repository that cannot be had: a failed download, a hash mismatch, a missing commit."""


@dataclass(frozen=True)
class Project:
    """A pinned release of a project on the package index."""

    name: str  # the distribution's name on the index
    version: str
    sha256: str  # of the sdist file
    licence: str  # SPDX expression, read from the sdist's LICENSE file by hand
    declared: str  # what the sdist's PKG-INFO declares (sdist_licence), checked by a test
    repo: str  # "owner/name" of its upstream repository (SWE-bench's `repo` field)
    package: str  # the import package under the sdist's top folder
    tests: str  # folder of its test suite, relative to the top folder

    @property
    def source(self) -> Source:
        return Source(kind="pypi_sdist", name=self.name, version=self.version, sha256=self.sha256)


PROJECTS: dict[str, Project] = {p.name: p for p in (
    Project("boltons", "26.2.0", "d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c",
            "BSD-3-Clause", "BSD License", "mahmoud/boltons", "boltons", "tests"),
    Project("toolz", "1.2.0", "9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            "BSD-3-Clause", "BSD-3-Clause", "pytoolz/toolz", "toolz", "toolz/tests"),
    Project("more-itertools", "11.2.1", "cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63",
            "MIT", "MIT", "more-itertools/more-itertools", "more_itertools", "tests"),
)}


def swe_cache() -> Path:
    return cache_dir() / "swe"


@contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (made if missing), across processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(name: str, version: str, sha256: str) -> Path:
    """The sdist of `name==version` in the cache, downloaded by pip on first use and checked
    against `sha256` (a mismatch is an error, and the file is not kept)."""
    folder = swe_cache() / "sdists"
    with locked(folder / ".lock"):
        for p in folder.glob("*"):
            if p.is_file() and p.suffix in (".gz", ".zip") and p.name.endswith((".tar.gz", ".zip")) \
                    and p.stem.replace("_", "-").lower().startswith(f"{name}-{version}".replace("_", "-").lower()) \
                    and _sha256(p) == sha256:
                return p
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                   "--disable-pip-version-check", "-d", tmp, f"{name}=={version}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            got = sorted(Path(tmp).iterdir())
            if proc.returncode or len(got) != 1:
                raise SourceError(f"pip could not download the sdist of {name}=={version}: "
                                  f"{(proc.stderr or proc.stdout).strip()[-600:]}")
            digest = _sha256(got[0])
            if digest != sha256:
                raise SourceError(f"the sdist of {name}=={version} has sha256 {digest}, not the pinned {sha256}")
            dest = folder / got[0].name
            os.replace(got[0], dest)
            return dest


def _extract_sdist(archive: Path, dest: Path) -> None:
    """The sdist's single top folder's content into `dest`."""
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        tops = {m.name.split("/")[0] for m in members}
        if len(tops) != 1:
            raise SourceError(f"{archive.name}: expected one top folder, found {sorted(tops)[:5]}")
        with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
            tar.extractall(tmp, filter="data")
            os.replace(Path(tmp) / tops.pop(), dest)


def _git_tree(repo: Path, commit: str, dest: Path) -> None:
    proc = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], capture_output=True)
    if proc.returncode:
        raise SourceError(f"{repo}: git archive {commit} failed: {proc.stderr.decode(errors='replace').strip()}")
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(tmp, dest)
        os.mkdir(tmp)  # TemporaryDirectory removes what it made


def source_tree(source: Source, base_commit: str = "") -> Path:
    """The repository's files at its pinned version: a read-only base tree in the cache
    (pypi_sdist, git) or the folder itself (folder). Nothing may write into the result:
    workspaces link to its files (workspace.py)."""
    if source.kind == "folder":
        root = Path(source.path).expanduser().resolve() / source.root
        if not root.is_dir():
            raise SourceError(f"source folder {root} does not exist")
        return root
    trees = swe_cache() / "trees"
    if source.kind == "pypi_sdist":
        dest = trees / f"{source.name}-{source.version}-{source.sha256[:12]}"
    else:
        repo = Path(source.path).expanduser().resolve()
        if not (repo / ".git").exists():
            raise SourceError(f"git source {repo} is not a git repository")
        if not base_commit:
            raise SourceError(f"git source {repo}: no base_commit to check out")
        dest = trees / f"git-{hashlib.sha256(str(repo).encode()).hexdigest()[:12]}-{base_commit[:40]}"
    if not dest.is_dir():
        trees.mkdir(parents=True, exist_ok=True)
        with locked(trees / ".lock"):
            if not dest.is_dir():
                if source.kind == "pypi_sdist":
                    _extract_sdist(fetch_sdist(source.name, source.version, source.sha256), dest)
                else:
                    _git_tree(Path(source.path).expanduser().resolve(), base_commit, dest)
    root = dest / source.root
    if not root.is_dir():
        raise SourceError(f"{dest}: no folder {source.root!r} inside the source")
    return root


def sdist_licence(tree: Path) -> str:
    """The licence the unpacked sdist declares in PKG-INFO: its License-Expression, else the
    OSI classifier's name."""
    meta = (tree / "PKG-INFO").read_text(encoding="utf-8", errors="replace")
    for line in meta.splitlines():
        if line.startswith("License-Expression:"):
            return line.split(":", 1)[1].strip()
    classifiers = [ln.split("::")[-1].strip() for ln in meta.splitlines() if ln.startswith("Classifier: License ::")]
    return classifiers[0] if classifiers else ""


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
