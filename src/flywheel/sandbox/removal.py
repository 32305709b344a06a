"""Removing what sandboxed code left in a directory: it may have chmod-ed directories to 000 and
built trees deeper than Python's recursion limit. Nothing here follows a symlink."""

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


def remove(path: str) -> None:
    """Remove one entry: a file, a symlink (not its target) or a whole directory tree."""
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
            remove(p)
        except FileNotFoundError:
            pass


def is_empty(path: str | os.PathLike) -> bool:
    with os.scandir(path) as it:
        return next(it, None) is None
