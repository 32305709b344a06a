"""Host-side workspace handling for SandboxPool: a warm sandbox cannot bind a new host directory
per request, so each server owns one private host directory mounted at /workspace; a request's
workspace is copied in before it runs and mirrored back after it (then the directory is emptied).

Everything here walks with `follow_symlinks=False` and only descends into entries that are real
directories on both sides, so symlinks the sandboxed code left behind (which may point at host
paths) are copied as links and never followed on the host. FIFOs, sockets and device nodes are
skipped. Changed files are found by (size, mtime_ns); copies keep mtimes.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess


def _onerror(func, path, exc_info):
    """rmtree helper: code in the sandbox may have chmod-ed a directory to 000."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        func(path)
    except OSError:
        pass


def _remove(path: str) -> None:
    st = os.lstat(path)
    if stat.S_ISDIR(st.st_mode):
        remove_tree(path)
    else:
        os.unlink(path)


def remove_tree(path: str | os.PathLike) -> None:
    """rmtree that survives what sandboxed code can build: directories chmod-ed to 000 and trees
    deeper than Python's recursion limit (then `rm -rf`, which walks iteratively, finishes it)."""
    try:
        os.chmod(path, 0o700)
        shutil.rmtree(path, onerror=_onerror)
    except FileNotFoundError:
        return
    except (OSError, RecursionError):
        pass
    if os.path.lexists(path):
        subprocess.run(["rm", "-rf", "--one-file-system", "--", os.fspath(path)], capture_output=True, timeout=300)


def clear(path: str | os.PathLike) -> None:
    """Empty a directory (keep the directory itself)."""
    with os.scandir(path) as it:
        entries = [e.path for e in it]
    for p in entries:
        try:
            _remove(p)
        except FileNotFoundError:
            pass


def is_empty(path: str | os.PathLike) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None


def _special(src: str, names: list[str]) -> set[str]:
    out = set()
    for n in names:
        mode = os.lstat(os.path.join(src, n)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            out.add(n)
    return out


def copy_in(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the tree `src` into the (empty) directory `dst`, symlinks as symlinks."""
    shutil.copytree(src, dst, symlinks=True, ignore=_special, dirs_exist_ok=True)


def sync_back(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Make the tree `dst` equal to `src` (the sandbox's copy), touching only what differs."""
    src, dst = os.fspath(src), os.fspath(dst)
    with os.scandir(src) as it:
        s_entries = {e.name: e for e in it}
    with os.scandir(dst) as it:
        d_entries = {e.name: e for e in it}
    for name, d in d_entries.items():
        if name not in s_entries and (d.is_symlink() or d.is_dir(follow_symlinks=False) or d.is_file(follow_symlinks=False)):
            _remove(d.path)  # special files were never copied in, so their absence means nothing
    for name, s in s_entries.items():
        dp = os.path.join(dst, name)
        d = d_entries.get(name)
        if s.is_symlink():
            target = os.readlink(s.path)
            if d is not None and d.is_symlink() and os.readlink(dp) == target:
                continue
            if d is not None:
                _remove(dp)
            os.symlink(target, dp)
        elif s.is_dir(follow_symlinks=False):
            if d is not None and not d.is_dir(follow_symlinks=False):
                _remove(dp)
                d = None
            if d is None:
                os.mkdir(dp, 0o700)
            sync_back(s.path, dp)
            shutil.copystat(s.path, dp, follow_symlinks=False)
        elif s.is_file(follow_symlinks=False):
            sst = s.stat(follow_symlinks=False)
            if d is not None and d.is_file(follow_symlinks=False):
                dst_st = d.stat(follow_symlinks=False)
                if (dst_st.st_size, dst_st.st_mtime_ns) == (sst.st_size, sst.st_mtime_ns):
                    continue
            if d is not None:
                _remove(dp)
            shutil.copy2(s.path, dp, follow_symlinks=False)
