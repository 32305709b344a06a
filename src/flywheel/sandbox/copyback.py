"""Copying a sandbox's workspace back onto the host directory it came from, within a deadline,
all or nothing.

Two kinds of source. `mirror_plan(src, dst)` makes dst equal to src (the pool's copied-in
workspace). `upper_plan(upper, dst)` applies an overlayfs upper layer onto dst, the overlay's
lower layer (the cold Sandbox): the upper layer holds only what the run changed, a 0/0 character
device (a whiteout) marks a deletion, and an opaque directory (xattr user.overlay.opaque=y)
replaces the lower one whole.

A plan is built without touching dst; `apply` then runs it in two steps. Stage: every new or
changed file is copied into a hidden directory made inside dst (so the next step only renames).
Commit: removals, new directories, the staged files renamed into place, symlinks, directory
modes and times. Planning and staging check `deadline`: past it the staged copies are removed and
CopyBackTimeout is raised, with dst as it was. Commit is not interrupted: it renames, makes and
removes entries, at most as many as the plan holds (bounded by the workspace quota) plus the host
entries the run deleted.

Walks never follow symlinks: only entries that are real directories on both sides are descended,
symlinks are recreated as links (never followed on the host), FIFOs, sockets and device nodes are
skipped. Files are compared by (size, mtime_ns, mode); copies keep mode and times, not owners or
extended attributes. Run it only once nothing in the sandbox can still write to `src`.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
import time
from typing import Callable

from .removal import remove, remove_tree

OPAQUE = "user.overlay.opaque"
CHUNK = 8 << 20

# (kind, path relative to dst, argument): ("rm", rel, None) removes; ("mkdir", rel, None);
# ("file", rel, source path); ("link", rel, target); ("dirstat", rel, source path) copies mode/times
Op = tuple[str, str, str | None]


class CopyBackTimeout(TimeoutError):
    """The copy-back did not finish before its deadline; the host directory was left as it was."""


def _clock(deadline: float | None) -> Callable[[], None]:
    def check() -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise CopyBackTimeout("the workspace copy-back passed its deadline")
    return check


def _entries(path: str | None) -> dict[str, os.DirEntry]:
    if path is None:
        return {}
    with os.scandir(path) as it:
        return {e.name: e for e in it}


def _plain(e: os.DirEntry) -> bool:
    """A file, directory or symlink (what a copy-back makes or removes; special files are never touched)."""
    return e.is_symlink() or e.is_dir(follow_symlinks=False) or e.is_file(follow_symlinks=False)


def _same_file(s: os.DirEntry, d: os.DirEntry | None) -> bool:
    if d is None or not d.is_file(follow_symlinks=False):
        return False
    a, b = s.stat(follow_symlinks=False), d.stat(follow_symlinks=False)
    return (a.st_size, a.st_mtime_ns, a.st_mode) == (b.st_size, b.st_mtime_ns, b.st_mode)


def _entry_ops(s: os.DirEntry, d: os.DirEntry | None, rel: str, ops: list[Op], recurse) -> None:
    """Ops making dst's entry `rel` (currently `d`) like the source entry `s` (not a whiteout)."""
    if s.is_symlink():
        target = os.readlink(s.path)
        if d is not None and d.is_symlink() and os.readlink(d.path) == target:
            return
        if d is not None:
            ops.append(("rm", rel, None))
        ops.append(("link", rel, target))
    elif s.is_dir(follow_symlinks=False):
        if d is not None and not d.is_dir(follow_symlinks=False):
            ops.append(("rm", rel, None))
            d = None
        if d is None:
            ops.append(("mkdir", rel, None))
        recurse(s, d)
        ops.append(("dirstat", rel, s.path))
    elif s.is_file(follow_symlinks=False) and not _same_file(s, d):
        if d is not None and not d.is_file(follow_symlinks=False):
            ops.append(("rm", rel, None))
        ops.append(("file", rel, s.path))


def mirror_plan(src: str, dst: str, deadline: float | None = None) -> list[Op]:
    """Ops making the tree `dst` equal to `src`, touching only what differs."""
    check, ops = _clock(deadline), []

    def walk(s_dir: str, d_dir: str | None, rel: str) -> None:
        s_entries, d_entries = _entries(s_dir), _entries(d_dir)
        for name, d in d_entries.items():
            if name not in s_entries and _plain(d):  # special files were never copied in: absence means nothing
                ops.append(("rm", os.path.join(rel, name), None))
        for name, s in s_entries.items():
            check()
            r = os.path.join(rel, name)
            _entry_ops(s, d_entries.get(name), r, ops,
                       lambda s, d, r=r: walk(s.path, None if d is None else d.path, r))

    walk(src, dst, "")
    return ops


def _opaque(path: str) -> bool:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False) == b"y"
    except OSError:
        return False


def _whiteout(e: os.DirEntry) -> bool:
    st = e.stat(follow_symlinks=False)
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def upper_plan(upper: str, dst: str, deadline: float | None = None) -> list[Op]:
    """Ops applying the overlayfs upper layer `upper` onto its lower layer `dst`."""
    check, ops = _clock(deadline), []

    def walk(u_dir: str, d_dir: str | None, rel: str, opaque: bool) -> None:
        u_entries, d_entries = _entries(u_dir), _entries(d_dir)
        if opaque:  # the run replaced this directory: what it did not recreate is gone
            ops.extend(("rm", os.path.join(rel, n), None)
                       for n, d in d_entries.items() if n not in u_entries and _plain(d))
        for name, u in u_entries.items():
            check()
            r, d = os.path.join(rel, name), d_entries.get(name)
            if _whiteout(u):
                if d is not None and _plain(d):
                    ops.append(("rm", r, None))
                continue
            _entry_ops(u, d, r, ops, lambda u, d, r=r: walk(u.path, None if d is None else d.path, r, _opaque(u.path)))

    walk(upper, dst, "", False)
    return ops


def _copy_file(src: str, dst: str, check: Callable[[], None]) -> None:
    """Copy a regular file's bytes, mode and times to the new path `dst` (never following a link)."""
    fi = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fi)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"not a regular file: {src}")
        fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            offset = 0
            while offset < st.st_size:
                check()
                n = os.sendfile(fo, fi, offset, min(CHUNK, st.st_size - offset))
                if n == 0:
                    break
                offset += n
            os.fchmod(fo, stat.S_IMODE(st.st_mode))
            os.utime(fo, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(fo)
    finally:
        os.close(fi)


def _commit(ops: list[Op], dst: str, staged: dict[str, str]) -> None:
    for kind, rel, arg in ops:
        p = os.path.join(dst, rel)
        if kind == "rm":
            try:
                remove(p)
            except FileNotFoundError:
                pass
        elif kind == "mkdir":
            os.mkdir(p, 0o700)
        elif kind == "file":
            os.replace(staged[rel], p)
        elif kind == "link":
            os.symlink(arg, p)
        elif kind == "dirstat":
            shutil.copystat(arg, p, follow_symlinks=False)


def apply(ops: list[Op], dst: str, deadline: float | None = None) -> None:
    """Stage the plan's files inside `dst` (checking `deadline`), then commit (module doc)."""
    files = [(rel, src) for kind, rel, src in ops if kind == "file"]
    stage = tempfile.mkdtemp(prefix=".flywheel-copyback-", dir=dst) if files else None
    staged: dict[str, str] = {}
    try:
        check = _clock(deadline)
        for i, (rel, src) in enumerate(files):
            check()
            staged[rel] = os.path.join(stage, str(i))
            _copy_file(src, staged[rel], check)
        _commit(ops, dst, staged)
    finally:
        if stage is not None:
            remove_tree(stage)


def copy_back(src: str, dst: str, deadline: float | None = None, upper: bool = False) -> None:
    """Plan and apply: `src` is a full copy of the workspace (mirror) or an overlay upper layer."""
    plan = (upper_plan if upper else mirror_plan)(src, os.fspath(dst), deadline)
    apply(plan, os.fspath(dst), deadline)
