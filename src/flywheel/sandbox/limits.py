"""Resource limits of one execution and how each one is enforced.

| field | enforced by |
|---|---|
| wall_s | the host (cold runs) or the in-sandbox server (pool) kills the whole tree; the pool's host side adds a grace period and kills the whole sandbox if the server does not answer |
| cpu_s | RLIMIT_CPU, soft = cpu_s (SIGXCPU), hard = cpu_s + 1 (SIGKILL) |
| memory_mb | RLIMIT_AS per process, and where a memory cgroup is writable the resident memory of the whole tree (tmpfs pages included); the private /tmp and /dev/shm tmpfs are also sized to it |
| file_size_mb | RLIMIT_FSIZE (Python ignores SIGXFSZ, so a write fails with EFBIG) |
| open_files | RLIMIT_NOFILE |
| processes | a pids cgroup (holds for root too); without one, RLIMIT_NPROC set inside the user namespace, which binds only when the host user is not root (the kernel exempts uid 0, and bwrap maps the sandbox uid onto the caller's uid) |
| output_bytes | stdout and stderr are each kept up to this many bytes; one more byte kills the tree (error "output limit", truncated=True) |
| workspace_files, workspace_mb | the workspace is a tmpfs of its own (nr_inodes, size) made in a user namespace by quota.py; /tmp and /dev/shm are capped at workspace_files inodes too. A run that ends with the workspace full is reported (error "workspace quota exceeded") and nothing of it is copied back |
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    """wall-clock kill of the whole process tree, seconds"""
    cpu_s: int = 10
    """RLIMIT_CPU, seconds of CPU per process"""
    memory_mb: int = 1024
    """RLIMIT_AS per process, MiB (and the tree's resident memory where a memory cgroup is writable)"""
    file_size_mb: int = 64
    """RLIMIT_FSIZE, MiB per file"""
    open_files: int = 256
    """RLIMIT_NOFILE"""
    processes: int = 64
    """process count of the tree (pids cgroup; RLIMIT_NPROC as a non-root fallback)"""
    output_bytes: int = 1 << 20
    """stdout and stderr are each captured up to this many bytes"""
    workspace_files: int = 20_000
    """inodes (files, directories, links) the workspace's filesystem may hold, its own root included;
    also the inode cap of the private /tmp and /dev/shm. The pool counts the copied-in tree, the
    cold Sandbox only what the run writes (an overlay on the host directory)"""
    workspace_mb: int = 256
    """MiB of data the workspace's filesystem may hold (tmpfs pages: RAM, charged to the memory cgroup)"""

    def __post_init__(self) -> None:
        checks = {
            "wall_s": self.wall_s > 0, "cpu_s": self.cpu_s >= 1, "memory_mb": self.memory_mb >= 16,
            "file_size_mb": self.file_size_mb >= 0, "open_files": self.open_files >= 16,
            "processes": self.processes >= 1, "output_bytes": self.output_bytes >= 0,
            "workspace_files": self.workspace_files >= 16, "workspace_mb": self.workspace_mb >= 1,
        }
        bad = [k for k, good in checks.items() if not good]
        if bad:
            raise ValueError(f"invalid sandbox limits {bad}: {self}")

    def with_(self, **changes) -> "Limits":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    def rlimits(self, nproc: bool = False, nproc_overhead: int = 0) -> dict[str, tuple[int, int]]:
        """(soft, hard) per `resource.RLIMIT_<name>`; the same numbers `prlimit_args` gives.
        RLIMIT_NPROC counts every process of the sandbox's user namespace, so bwrap's reaper (and
        the pool's server) are added as `nproc_overhead`."""
        out = {
            "AS": (self.memory_mb * MiB,) * 2,
            "CPU": (self.cpu_s, self.cpu_s + 1),
            "FSIZE": (self.file_size_mb * MiB,) * 2,
            "NOFILE": (self.open_files,) * 2,
            "CORE": (0, 0),
        }
        if nproc:
            out["NPROC"] = (self.processes + nproc_overhead,) * 2
        return out

    def prlimit_args(self, nproc: bool = False, nproc_overhead: int = 0) -> list[str]:
        """Arguments for util-linux `prlimit` (run inside the sandbox, in front of the command)."""
        names = {"AS": "as", "CPU": "cpu", "FSIZE": "fsize", "NOFILE": "nofile", "CORE": "core", "NPROC": "nproc"}
        return [f"--{names[k]}={s}:{h}" for k, (s, h) in self.rlimits(nproc, nproc_overhead).items()]

    @property
    def workspace_bytes(self) -> int:
        return self.workspace_mb * MiB

    @property
    def tmpfs_bytes(self) -> int:
        """Size of each private tmpfs (/tmp, /dev/shm; a throwaway /workspace only where no
        quota.QuotaFs provides it, which sizes it to `workspace_bytes`): its pages are RAM."""
        return self.memory_mb * MiB
