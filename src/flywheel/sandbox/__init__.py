"""Isolated execution of untrusted (model-written) code.

    from flywheel.sandbox import Sandbox, SandboxPool, Limits

    Sandbox().run_python("print(1+1)")            # one cold bwrap sandbox per call (tens of ms)
    with SandboxPool(size=2) as pool:              # warm fork servers, a few ms per snippet
        pool.run_python("print(1+1)")
        pool.run_module("pytest", ["-q"], workspace=repo_dir)

Isolation is bubblewrap (all namespaces, no network, read-only system, private /tmp, only the
workspace writable, seccomp filter, no capabilities) plus rlimits, a pids/memory cgroup where one
is writable, a wall-clock kill of the whole tree, and a workspace quota: the workspace, /tmp and
/dev/shm are tmpfs capped in bytes and inodes (quota.py), and the workspace reaches the host
only after the run, all of it or none of it (copyback.py). Without bwrap, untrusted code is refused
(SandboxUnavailable) unless the caller opts into the unsafe mode, which warns every time.
See docs/security.md for the threat model and what is NOT protected.
"""

from .limits import Limits
from .pool import SandboxPool
from .probe import UNSAFE_ENV, sandbox_available, unavailable_reason
from .result import ExecResult, SandboxDirtyWarning, SandboxError, SandboxUnavailable, UnsafeSandboxWarning
from .sandbox import Sandbox

__all__ = ["SandboxError", "SandboxUnavailable", "UnsafeSandboxWarning", "SandboxDirtyWarning", "ExecResult",
           "Limits", "Sandbox", "SandboxPool", "sandbox_available", "unavailable_reason", "UNSAFE_ENV"]
