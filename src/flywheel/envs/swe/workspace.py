"""An instance's base (its source at `base_commit`, plus its `bug_patch`) and the workspaces
made from it, one per episode or evaluation.

A base is built once and cached read-only. A workspace is a tree of hard links to the base's
files (a few ms for a repository of a few hundred files, whatever their size), which is safe
because nothing writes a file in place: the sandbox runs on an overlay and copies back by
renaming new files into place (sandbox/copyback.py), and patches are applied the same way
(patches.py). Where the sandbox is off (FLYWHEEL_UNSAFE_NO_SANDBOX=1) a command would write
straight into the linked files, so workspaces are full copies there.

`diff_against_base` is the submission: a git-style diff of what changed, found by comparing
inodes first (an untouched file is still the base's link) and contents after.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from flywheel.envs.patches import apply_patch, make_diff, _read_text
from flywheel.envs.repo import IGNORED, PatchError
from flywheel.envs.swe.instance import SWEInstance
from flywheel.envs.swe.sources import SourceError, locked, source_tree, swe_cache


def link_tree(src: Path, dst: Path, copy: bool = False) -> None:
    """Recreate the tree `src` at `dst` (which may exist, empty): folders made, files hard-linked
    (copied with `copy`), symlinks recreated; caches and VCS folders left out."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if d not in IGNORED and not d.endswith(".egg-info")]
        rel = os.path.relpath(dirpath, src)
        out = dst if rel == "." else dst / rel
        for d in dirnames:
            s = os.path.join(dirpath, d)
            if os.path.islink(s):
                os.symlink(os.readlink(s), out / d)
            else:
                os.mkdir(out / d)
        dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
        for f in filenames:
            if f.endswith((".pyc", ".pyo")):
                continue
            s = os.path.join(dirpath, f)
            if os.path.islink(s):
                os.symlink(os.readlink(s), out / f)
            elif copy:
                shutil.copy2(s, out / f)
            else:
                os.link(s, out / f)


def instance_base(inst: SWEInstance) -> Path:
    """The instance's starting tree (read-only): the source tree itself, or, with a bug_patch,
    a cached tree of links to it with the patched files replaced."""
    tree = source_tree(inst.source, inst.base_commit)
    if not inst.bug_patch:
        return tree
    key = hashlib.sha256(f"{tree}\0{inst.bug_patch}".encode()).hexdigest()[:12]
    bases = swe_cache() / "bases"
    dest = bases / f"{inst.instance_id}-{key}"
    if dest.is_dir():
        return dest
    bases.mkdir(parents=True, exist_ok=True)
    with locked(bases / ".lock"):
        if not dest.is_dir():
            tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=bases))
            try:
                link_tree(tree, tmp)
                apply_patch(tmp, inst.bug_patch)
            except PatchError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise SourceError(f"{inst.instance_id}: its bug_patch does not apply to its source: {e}") from None
            os.replace(tmp, dest)
    return dest


def new_workspace(base: Path, isolated: bool = True, parent: str | None = None) -> Path:
    """A fresh workspace from `base` in a new temporary folder (the caller removes it):
    hard links where the sandbox isolates, a copy where it does not."""
    ws = Path(tempfile.mkdtemp(prefix="flywheel-swe-", dir=parent))
    link_tree(base, ws, copy=not isolated)
    return ws


def _files(root: Path) -> dict[str, os.stat_result]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        links = [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]
        dirnames[:] = [d for d in dirnames if d not in IGNORED and not d.endswith(".egg-info") and d not in links]
        for f in filenames + links:
            if f.endswith((".pyc", ".pyo")):
                continue
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root).replace(os.sep, "/")] = os.lstat(p)
    return out


def diff_against_base(workspace: Path, base: Path) -> str:
    """What the workspace changed from its base, as one git-style diff (sorted by path)."""
    now, then = _files(workspace), _files(base)
    out = []
    for rel in sorted(set(now) | set(then)):
        a, b = then.get(rel), now.get(rel)
        if a is not None and b is not None and (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev):
            continue  # still the base's own file
        old = _read_text(base / rel) if a is not None else None
        new = _read_text(workspace / rel) if b is not None else None
        if old != new:
            out.append(make_diff(rel, old, new))
    return "".join(out)
