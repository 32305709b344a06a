"""Can untrusted code be isolated here, and if not, may it run anyway?

`sandbox_available()` is True only when bwrap is installed, new enough, actually starts a
sandbox on this kernel (user namespaces can be disabled by sysctl, AppArmor or a container's
seccomp profile), a process-count limit can be enforced (a writable pids cgroup, or a
non-root host user so RLIMIT_NPROC binds) and the workspace quota can (util-linux `unshare`,
`nsenter` and `mount` mount capped tmpfs in a user namespace, quota.py). `unavailable_reason()`
says what is missing. `quota_mode()` says how the cold Sandbox gives a run its workspace.

The unsafe opt-in (`unsafe=True` or FLYWHEEL_UNSAFE_NO_SANDBOX=1) is honoured only when the
sandbox is unavailable, and every object constructed in that mode warns.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import tempfile
import warnings

from . import cgroup, seccomp
from .bwrap import Spec, prepare
from .limits import Limits
from .quota import QuotaFs
from .result import SandboxError, SandboxUnavailable, UnsafeSandboxWarning

log = logging.getLogger("flywheel.sandbox")
UNSAFE_ENV = "FLYWHEEL_UNSAFE_NO_SANDBOX"
INSTALL_HINT = ("Install bubblewrap (`apt-get install bubblewrap`, or `make setup`, which installs it). "
                f"To run untrusted code WITHOUT isolation anyway (resource limits only), set {UNSAFE_ENV}=1 "
                "or pass unsafe=True.")
REQUIRED = ("--args", "--json-status-fd", "--ro-bind-data", "--seccomp", "--die-with-parent", "--cap-drop", "--as-pid-1")
OPTIONAL = ("--size", "--disable-userns")

# always show the unsafe warning, not once per call site (user -W filters still take precedence)
warnings.filterwarnings("always", category=UnsafeSandboxWarning, append=True)


def find_bwrap() -> str | None:
    """Path of the bwrap binary (tests monkeypatch this to simulate a host without it)."""
    return shutil.which("bwrap") or next((p for p in ("/usr/bin/bwrap", "/bin/bwrap") if os.path.exists(p)), None)


def find_tool(name: str) -> str | None:
    """Path of a util-linux tool (prlimit, unshare, nsenter, mount)."""
    return shutil.which(name) or next((p for p in (f"/usr/bin/{name}", f"/bin/{name}") if os.path.exists(p)), None)


def find_prlimit() -> str | None:
    return find_tool("prlimit")


def quota_fs(limits: Limits, lower=None) -> QuotaFs:
    """The capped tmpfs of one sandbox (quota.py), made with this host's tools."""
    return QuotaFs(limits, lower, unshare=find_tool("unshare") or "unshare", nsenter=find_tool("nsenter") or "nsenter")


@functools.lru_cache(maxsize=8)
def features(bwrap: str) -> frozenset[str]:
    """Options this bwrap accepts (parsed from --help)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()
    text = out.stdout + out.stderr
    return frozenset(w for w in text.split() if w.startswith("--"))


def process_limit_mode() -> str | None:
    """'cgroup' (binds everyone), 'rlimit' (host user is not root), or None (cannot enforce)."""
    if cgroup.pids_available():
        return "cgroup"
    if os.geteuid() != 0:
        return "rlimit"
    return None


@functools.lru_cache(maxsize=8)
def _probe(bwrap: str | None) -> str | None:
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed, so untrusted code cannot be isolated. " + INSTALL_HINT
    feats = features(bwrap)
    missing = [o for o in REQUIRED if o not in feats]
    if missing:
        return f"{bwrap} is too old (lacks {', '.join(missing)}; bubblewrap >= 0.8 is known to work). " + INSTALL_HINT
    missing = [t for t in ("prlimit", "unshare", "nsenter", "mount") if find_tool(t) is None]
    if missing:
        return (f"util-linux {', '.join(missing)} missing (the sandbox sets rlimits with prlimit and makes its "
                f"capped workspace with unshare, nsenter and mount).")
    if process_limit_mode() is None:
        return ("the host user is root and no pids cgroup is writable, so a process-count limit cannot be "
                "enforced (RLIMIT_NPROC does not bind root, even inside a user namespace). Run as a non-root "
                "user, or give this process a writable cgroup (cgroup v1 pids hierarchy, or a delegated v2 "
                "subtree with the pids controller enabled).")
    try:
        fs = quota_fs(Limits(workspace_files=64, workspace_mb=1, memory_mb=16))
    except SandboxError as e:
        return f"the sandbox's workspace quota cannot be enforced here: {e}"
    try:
        spec = Spec(disable_userns="--disable-userns" in feats, tmpfs_size="--size" in feats, seccomp=seccomp.program(),
                    mounts={"/workspace": fs.inside("ws"), "/tmp": fs.inside("tmp"), "/dev/shm": fs.inside("shm")})
        prep = prepare(bwrap, spec, ["/bin/true"])
        try:
            out = subprocess.run(fs.prefix() + prep.argv, pass_fds=prep.fds, capture_output=True, text=True,
                                 timeout=30, env={"PATH": "/usr/bin:/bin"})
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap failed to start a sandbox here: {e}"
        finally:
            prep.close_fds()
            os.close(prep.status_fd)
    finally:
        fs.close()
    if out.returncode != 0:
        return ("bwrap is installed but cannot create a sandbox here (user namespaces disabled? try "
                "`sysctl kernel.unprivileged_userns_clone=1`, or an AppArmor/container profile blocks them): "
                f"{out.stderr.strip()[:500]}")
    return None


@functools.lru_cache(maxsize=1)
def quota_mode() -> str:
    """'overlay' where an overlayfs can be mounted over a host directory in the quota's user
    namespace (the cold Sandbox then shows the host workspace and caps only what the run writes),
    else 'copy' (the workspace is copied in and out, as the pool does)."""
    lower = tempfile.mkdtemp(prefix="flywheel-probe-")
    try:
        quota_fs(Limits(workspace_files=64, workspace_mb=1, memory_mb=16), lower=lower).close()
        return "overlay"
    except SandboxError as e:
        log.info("flywheel.sandbox: no overlayfs in a user namespace here, the cold sandbox copies workspaces: %s", e)
        return "copy"
    finally:
        os.rmdir(lower)


def unavailable_reason() -> str | None:
    """Why untrusted code cannot be isolated here, or None when it can (cached per bwrap path)."""
    return _probe(find_bwrap())


def sandbox_available() -> bool:
    return unavailable_reason() is None


def unsafe_requested(unsafe: bool | None) -> bool:
    if unsafe is not None:
        return bool(unsafe)
    return os.environ.get(UNSAFE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def choose_backend(unsafe: bool | None, what: str) -> str:
    """'bwrap' when isolation works; 'unsafe' (with a loud warning) when it does not and the
    caller opted in; otherwise raises SandboxUnavailable with the reason and how to fix it."""
    reason = unavailable_reason()
    if reason is None:
        return "bwrap"
    if not unsafe_requested(unsafe):
        raise SandboxUnavailable(reason)
    msg = (f"flywheel.sandbox: {what} runs untrusted code WITHOUT isolation ({UNSAFE_ENV} / unsafe=True): "
           f"the code can read and write your files, reach the network and see your environment; only "
           f"rlimits and a wall-clock kill apply. Reason the sandbox is unavailable: {reason}")
    warnings.warn(msg, UnsafeSandboxWarning, stacklevel=3)
    log.warning(msg)
    return "unsafe"


def bwrap_spec_flags() -> dict:
    """Spec switches for the optional bwrap features this host's bwrap has."""
    b = find_bwrap()
    feats = features(b) if b else frozenset()
    return {"disable_userns": "--disable-userns" in feats, "tmpfs_size": "--size" in feats}
