"""Per-sandbox cgroups: a process-count limit that binds root, a memory cap on the whole tree,
and a kill that reaches every process in it.

Why a cgroup: RLIMIT_NPROC does not bind uid 0, and `bwrap --unshare-user --uid 65534` does not
change that when the caller is root, because the sandbox uid maps back onto host uid 0 (as root,
a 200-process fork loop under `prlimit --nproc=20` succeeds). A `pids` cgroup counts every
task in it whoever owns it.

Both cgroup v1 (one hierarchy per controller, e.g. /sys/fs/cgroup/pids) and v2 (one unified
hierarchy) are handled. Child cgroups are made under the cgroup this process is in, named
`flywheel-<host pid>-<n>`; ones left behind by a dead host process are removed on first use.
On v2 the `pids` controller must already be enabled for our cgroup's children (a delegated
subtree), or our cgroup must be the root; we never move the host process itself.

A sandboxed process joins its cgroup before bwrap starts: the command line is prefixed with
`/bin/sh -c 'echo 0 > cgroup.procs; exec "$@"'`, which needs no `preexec_fn` (unsafe in a
process with threads) and costs one exec of a small shell.
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from flywheel.process import pid_alive

_counter = itertools.count()
_JOIN = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo 0 > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
JOIN_FAILED = 125  # exit status of the join prefix when it cannot enter the cgroup


class CgroupError(OSError):
    """A cgroup could not be created or configured."""


@dataclass(frozen=True)
class Hierarchy:
    version: int  # 1 or 2
    controllers: tuple[str, ...]  # of ("pids", "memory") that this hierarchy serves for us
    base: Path  # our own cgroup: children are created here


def _mounts() -> list[tuple[str, str, str, set[str]]]:
    """(mount root, mount point, fstype, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if rfields and rfields[0] in ("cgroup", "cgroup2"):
                opts = set(rfields[2].split(",")) if len(rfields) > 2 else set()
                out.append((fields[3], fields[4].replace("\\040", " "), rfields[0], opts))
    return out


def _own_paths() -> dict[str, str]:
    """controller -> our cgroup path; the v2 path is under the key ''."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def _base(mount_root: str, mount_point: str, path: str) -> Path | None:
    rel = os.path.relpath(path, mount_root)
    if rel.startswith(".."):
        return None  # our cgroup is outside what this mount shows (a foreign cgroup namespace)
    return Path(mount_point) / ("" if rel == "." else rel)


def _usable(base: Path, files: dict[str, str]) -> bool:
    """Can we make a child cgroup here and write its limit files?"""
    probe = base / f"flywheel-{os.getpid()}-probe{next(_counter)}"
    try:
        probe.mkdir()
    except OSError:
        return False
    try:
        for name, value in files.items():
            (probe / name).write_text(value)
        return True
    except OSError:
        return False
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass


def _discover() -> tuple[Hierarchy, ...]:
    paths = _own_paths()
    found: dict[str, Hierarchy] = {}
    for root, point, fstype, opts in _mounts():
        if fstype == "cgroup":  # v1: one controller (or a few) per mount
            for ctrl, probe in (("pids", {"pids.max": "max"}), ("memory", {"memory.limit_in_bytes": "-1"})):
                if ctrl in opts and ctrl in paths and ctrl not in found:
                    base = _base(root, point, paths[ctrl])
                    if base is not None and _usable(base, probe):
                        found[ctrl] = Hierarchy(1, (ctrl,), base)
    v2 = [(r, p) for r, p, t, _ in _mounts() if t == "cgroup2"]
    if "" in paths and v2 and ("pids" not in found or "memory" not in found):
        base = _base(v2[0][0], v2[0][1], paths[""])
        if base is not None:
            want = [c for c in ("pids", "memory") if c not in found]
            try:
                enabled = (base / "cgroup.subtree_control").read_text().split()
                offered = (base / "cgroup.controllers").read_text().split()
            except OSError:
                enabled, offered = [], []
            for c in want:
                if c not in enabled and c in offered:
                    try:  # allowed only where no process sits in `base` itself (or at the root)
                        (base / "cgroup.subtree_control").write_text(f"+{c}")
                        enabled.append(c)
                    except OSError:
                        pass
            ctrls = tuple(c for c in want if c in enabled)
            probe = {"pids.max": "max"} if "pids" in ctrls else {}
            if ctrls and _usable(base, probe):
                for c in ctrls:
                    found[c] = Hierarchy(2, ctrls, base)
    hier = tuple({h.base: h for h in found.values()}.values())
    for h in hier:
        _remove_stale(h.base)
    return hier


@functools.lru_cache(maxsize=1)
def hierarchies() -> tuple[Hierarchy, ...]:
    """The writable hierarchies for our controllers (cached; empty when none is usable)."""
    try:
        return _discover()
    except OSError:
        return ()


def pids_available() -> bool:
    return any("pids" in h.controllers for h in hierarchies())


def _remove_stale(base: Path) -> None:
    try:
        entries = list(base.iterdir())
    except OSError:
        return
    for d in entries:
        parts = d.name.split("-")
        if len(parts) == 3 and parts[0] == "flywheel" and parts[1].isdigit() and d.is_dir():
            if int(parts[1]) != os.getpid() and not pid_alive(int(parts[1])):
                _kill_and_remove(d, version=2 if (d / "cgroup.kill").exists() else 1)


def _procs(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_and_remove(d: Path, version: int, timeout_s: float = 2.0) -> bool:
    """SIGKILL everything in `d`, then rmdir it. False when it is still busy after timeout_s."""
    deadline = time.monotonic() + timeout_s
    if version == 2 and (d / "cgroup.kill").exists():
        try:
            (d / "cgroup.kill").write_text("1")
        except OSError:
            pass
    while True:
        for pid in _procs(d):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            d.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
        time.sleep(0.002)


def _read_counter(path: str, key: str) -> int:
    """The value of `key` in a flat-keyed cgroup file ("key value" lines); 0 when unreadable."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            data = os.read(fd, 4096)
        finally:
            os.close(fd)
    except OSError:
        return 0
    for line in data.split(b"\n"):
        k, _, v = line.partition(b" ")
        if k == key.encode():
            try:
                return int(v)
            except ValueError:
                return 0
    return 0


class Cgroup:
    """One sandbox's cgroup(s): `pids.max` = processes + `overhead` (bwrap's own processes),
    memory capped at `memory_bytes` when a memory hierarchy is writable."""

    def __init__(self, processes: int, overhead: int, memory_bytes: int | None):
        self.dirs: list[tuple[Hierarchy, Path]] = []
        self._counter_files: list | None = None
        name = f"flywheel-{os.getpid()}-{next(_counter)}"
        try:
            for h in hierarchies():
                d = h.base / name
                d.mkdir()
                self.dirs.append((h, d))
                if "pids" in h.controllers:
                    (d / "pids.max").write_text(str(processes + overhead))
            if memory_bytes is not None:
                self.set_memory(memory_bytes)
        except OSError as e:
            self.close()
            raise CgroupError(f"could not create the sandbox cgroup: {e}") from e

    def _dir(self, ctrl: str) -> tuple[Hierarchy, Path] | None:
        return next(((h, d) for h, d in self.dirs if ctrl in h.controllers), None)

    def set_memory(self, nbytes: int) -> None:
        hd = self._dir("memory")
        if hd is None:
            return
        h, d = hd
        if h.version == 2:
            (d / "memory.max").write_text(str(nbytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
        else:
            (d / "memory.limit_in_bytes").write_text(str(nbytes))
            sw = d / "memory.memsw.limit_in_bytes"
            if sw.exists():
                try:
                    sw.write_text(str(nbytes))  # memory+swap = memory: no swapping out of the cap
                except OSError:
                    pass

    def memory_usage(self) -> int | None:
        hd = self._dir("memory")
        if hd is None:
            return None
        h, d = hd
        try:
            return int((d / ("memory.current" if h.version == 2 else "memory.usage_in_bytes")).read_text())
        except (OSError, ValueError):
            return None

    def join_prefix(self) -> list[str]:
        """argv prefix that moves the process into these cgroups, then execs the rest."""
        files = sorted({str(d / "cgroup.procs") for _, d in self.dirs})
        return ["/bin/sh", "-c", _JOIN, "sh", str(len(files)), *files]

    def counters(self) -> tuple[int, int]:
        """(forks the pids limit refused, processes the memory cap OOM-killed) so far; both only
        grow. Read with raw syscalls (microseconds): the pool reads them after every request."""
        if self._counter_files is None:
            files = []
            for ctrl, names, key in (("pids", ("pids.events", "pids.events"), "max"),
                                     ("memory", ("memory.oom_control", "memory.events"), "oom_kill")):
                hd = self._dir(ctrl)
                files.append((str(hd[1] / names[hd[0].version - 1]), key) if hd else None)
            self._counter_files = files
        pids, ooms = (_read_counter(*f) if f else 0 for f in self._counter_files)
        return pids, ooms

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (the pid namespace usually did it already)."""
        for h, d in self.dirs:
            if h.version == 2 and (d / "cgroup.kill").exists():
                try:
                    (d / "cgroup.kill").write_text("1")
                    continue
                except OSError:
                    pass
            for pid in _procs(d):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def close(self) -> None:
        """Kill what is left and remove the cgroup(s); busy ones are retried on the next close."""
        with _leftovers_lock:
            pending = self.dirs + _leftovers[:]
            _leftovers.clear()
        self.dirs = []
        busy = [(h, d) for h, d in pending if not _kill_and_remove(d, h.version, timeout_s=0.5)]
        with _leftovers_lock:
            _leftovers.extend(busy)


_leftovers: list[tuple[Hierarchy, Path]] = []
_leftovers_lock = threading.Lock()
