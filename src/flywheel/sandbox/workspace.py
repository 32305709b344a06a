"""Host-side workspace handling: a warm sandbox cannot bind a new host directory per request, so
each pool server owns one capped tmpfs mounted at /workspace (quota.py); a request's workspace is
copied in before it runs and copied back after it (copyback.py), then the tmpfs is emptied.

Everything here walks with `follow_symlinks=False`: symlinks the sandboxed code left behind (which
may point at host paths) are copied as links and never followed on the host. FIFOs, sockets and
device nodes are skipped.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat

from . import copyback
from .removal import clear, is_empty, remove_tree  # noqa: F401  (re-exported: the pool's helpers)


class WorkspaceTooLarge(OSError):
    """The workspace did not fit the sandbox's workspace quota while being copied in."""


def _special(src: str, names: list[str]) -> set[str]:
    out = set()
    for n in names:
        mode = os.lstat(os.path.join(src, n)).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            out.add(n)
    return out


class _Full(Exception):
    """Raised through copytree (which collects OSErrors and goes on) at the first ENOSPC."""


def _copy2(src, dst, *, follow_symlinks=True):
    try:
        return shutil.copy2(src, dst, follow_symlinks=follow_symlinks)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _Full(str(e)) from e
        raise


def copy_in(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Copy the tree `src` into the (empty) directory `dst`, symlinks as symlinks. Raises
    WorkspaceTooLarge at the first write refused for lack of space or inodes (`dst` is capped)."""
    try:
        shutil.copytree(src, dst, symlinks=True, ignore=_special, copy_function=_copy2, dirs_exist_ok=True)
    except (_Full, shutil.Error, OSError) as e:
        full = isinstance(e, _Full) or (isinstance(e, shutil.Error) and os.strerror(errno.ENOSPC) in str(e)) or \
            getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT)
        if full:
            raise WorkspaceTooLarge(errno.ENOSPC, f"the workspace {os.fspath(src)!r} does not fit its quota") from None
        raise


def sync_back(src: str | os.PathLike, dst: str | os.PathLike, deadline: float | None = None) -> None:
    """Make the tree `dst` equal to `src` (the sandbox's copy), touching only what differs; past
    `deadline` (monotonic) raises copyback.CopyBackTimeout with `dst` left as it was."""
    copyback.copy_back(os.fspath(src), os.fspath(dst), deadline)
