"""The fork server that runs inside one bwrap sandbox of a SandboxPool. Standard library only:
the host places this file and protocol.py in the sandbox as read-only files and runs
`python <this file> <config JSON>`, so nothing else of flywheel has to be visible inside.

Per request: compile the snippet, fork a fresh child of the pristine server, wait for it with a
wall-clock deadline while capturing stdout/stderr up to a cap, then kill every process the
request left behind, clear /tmp and /dev/shm and answer. What one request leaves cannot reach
the next: the server is pid 1 of the sandbox's pid namespace (unkillable from inside, reaps
every orphan) and non-dumpable; files it cannot remove are reported as `dirty`; SysV IPC
objects left behind make it ask to be recycled. Without a pid namespace (the unsafe mode) it
kills the child's session and, as a child subreaper, every orphan. docs/security.md ("The warm
pool") gives the threat each measure answers.
"""

import atexit
import ctypes
import errno
import gc
import json
import os
import resource
import runpy
import select
import shutil
import signal
import sys
import time
import traceback
import types

try:  # inside the sandbox this file runs as a script next to protocol.py
    from .protocol import read_frame, write_all, write_frame
except ImportError:
    from protocol import read_frame, write_all, write_frame


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _exit_status(e):
    code = e.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    try:
        sys.stderr.write(f"{code}\n")
    except Exception:
        pass
    return 1


def _child(req, code, stdin_fd, out_w, err_w, status_w, cfg):
    """Runs in the forked child; never returns. On a normal end it reports its exit status on
    fd 3 (after closing stdout/stderr), so the server can answer without waiting for the exit
    itself (tearing down a forked address space is a sizeable part of a short request)."""
    status, ident = 1, None
    try:
        os.dup2(stdin_fd, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(status_w, 3)
        os.closerange(4, 1 << 16)  # the host pipe, pidfds, everything of the server
        st = os.fstat(3)
        ident = (st.st_dev, st.st_ino)
        os.setsid()
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in `python -c`
        cpu = cfg["limits"]["cpu_s"]
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        if cfg["nproc"]:  # no pids cgroup: RLIMIT_NPROC, offset by what it counts besides the request
            n = cfg["limits"]["processes"] + cfg["nproc_base"]
            resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
        os.chdir(req["cwd"])
        # sys.stdin/stdout/stderr are the interpreter's own objects on fds 0/1/2, now the request's
        # pipes (the server flushed them before the fork, so they hold nothing of its own)
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        try:
            if req["kind"] == "python":
                sys.argv = ["-c"]
                exec(code, main.__dict__)
            else:
                sys.argv = [req["module"], *req["args"]]
                sys.path[0] = os.getcwd()
                runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            status = 0
        except SystemExit as e:
            status = _exit_status(e)
        except BaseException as e:
            tb = e.__traceback__.tb_next if e.__traceback__ is not None else None  # hide this frame
            traceback.print_exception(type(e), e, tb)
            status = 1
        threading = sys.modules.get("threading")
        if threading is not None:
            try:
                threading._shutdown()  # like interpreter exit: wait for non-daemon threads
            except BaseException:
                pass
        atexit._run_exitfuncs()
    except SystemExit as e:
        status = _exit_status(e)
    except BaseException:
        status = 1
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except BaseException:
                pass
        try:  # fd 3 is still our status pipe only if the code did not close and reuse it
            st = os.fstat(3)
            if (st.st_dev, st.st_ino) == ident:
                os.close(1)
                os.close(2)
                os.write(3, bytes([status & 0xFF]))
        except BaseException:
            pass
        os._exit(status)


def _others(exclude):
    """Other processes in our pid namespace, zombies included (the server is its pid 1)."""
    skip = {1, os.getpid(), *exclude}
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in skip]


def _orphans(exclude):
    me, out = os.getpid(), []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                with open(f"/proc/{p}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if ppid == me and int(p) not in exclude:
                out.append(int(p))
    return out


def _kill_all(pidns, child_pid, reaped, timeout_s=2.0):
    """Kill everything the request started. True when nothing is left. Until `reaped`, the
    request's main process stays visible in /proc as our zombie: it does not count."""
    deadline = time.monotonic() + timeout_s
    exclude = () if reaped else (child_pid,)
    if pidns:  # we are pid 1: every other process in the namespace is ours to kill, orphans ours to reap
        while True:
            try:
                os.kill(-1, signal.SIGKILL)  # everyone in the namespace but us, the main child included
            except ProcessLookupError:
                return True
            left = _others(exclude)
            for p in left:
                try:
                    os.waitpid(p, os.WNOHANG)
                except ChildProcessError:
                    pass  # not (yet) our child: its parent dies too, then it is reparented to us
            if not left or not _others(exclude):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
    while True:
        try:
            os.killpg(child_pid, signal.SIGKILL)
        except OSError:
            pass
        left = _orphans(exclude)  # the main child is reaped by handle()
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
                os.waitpid(p, 0)
            except OSError:
                pass
        if not left or time.monotonic() > deadline:
            return not left


_MODES = {}  # private dir -> its mode before any request (a request may chmod it to hide files)


def _rm_fix(func, p, exc):  # rmtree onerror: the request may have chmod-ed a directory to 000
    os.chmod(os.path.dirname(p), 0o700)
    if os.path.isdir(p) and not os.path.islink(p):
        os.chmod(p, 0o700)
        if func in (os.open, os.scandir, os.listdir):  # rmtree could not enter it: clear it now
            shutil.rmtree(p, onerror=_rm_fix)
            return
    func(p)


def _clear_dir(path):
    """Empty a private dir (/tmp, /dev/shm) but for its (read-only, see bwrap.root_binds) mount
    points; restore its mode, drop its user xattrs. Returns what is left, with why ([]: clean)."""
    try:
        st = os.stat(path)
        os.chmod(path, _MODES.setdefault(path, st.st_mode & 0o7777))
        try:
            names = os.listxattr(path)
        except OSError as e:
            if e.errno != errno.EOPNOTSUPP:  # EOPNOTSUPP: a tmpfs without xattrs holds none
                raise
            names = []
        for name in names:
            if name.startswith("user."):
                os.removexattr(path, name)
        entries = list(os.scandir(path))
    except OSError as e:
        return [f"{path}: {e}"]
    errors = {}
    for e in entries:
        try:
            if e.stat(follow_symlinks=False).st_dev != st.st_dev:
                continue  # a mount point: not ours to clear
            if e.is_dir(follow_symlinks=False):
                os.chmod(e.path, 0o700)
                shutil.rmtree(e.path, onerror=_rm_fix)
            else:
                os.unlink(e.path)
        except Exception as err:  # OSError, or RecursionError on a very deep tree: reported, never fatal
            errors[e.path] = f"{e.path}: {err!r}"
    try:
        left = [x.path for x in os.scandir(path) if x.stat(follow_symlinks=False).st_dev == st.st_dev]
        os.utime(path, (0, 0))  # its times were a channel to the next request
    except OSError as e:
        return [f"{path}: {e}"]
    return [errors.get(p, f"{p}: still there") for p in left]


def _dirty():
    """What clearing /tmp and /dev/shm could not remove (at most 8 lines; [] when clean)."""
    return (_clear_dir("/tmp") + _clear_dir("/dev/shm"))[:8]


def _ipc_clean():
    for kind in ("shm", "sem", "msg"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                if len(f.read().splitlines()) > 1:
                    return False
        except OSError:
            pass
    return True


_unreaped = []  # children answered for on their status report, reaped before the next fork


def handle(req, blobs, cfg):
    """Run one request. Returns (response header, stdout bytes, stderr bytes)."""
    t0 = time.monotonic()
    for p in _unreaped:  # they were SIGKILLed on their report: this returns at once
        try:
            os.waitpid(p, 0)
        except ChildProcessError:
            pass
    _unreaped.clear()
    cap = cfg["limits"]["output_bytes"]
    code = None
    if req["kind"] == "python":
        try:
            code = compile(req["code"], "<string>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError, OverflowError, MemoryError, RecursionError) as e:
            err = "".join(traceback.format_exception_only(type(e), e)).encode()
            return {"returncode": 1, "duration_s": time.monotonic() - t0}, b"", err
    if blobs and blobs[0]:
        stdin_fd = os.memfd_create("stdin", 0)
        write_all(stdin_fd, blobs[0])
        os.lseek(stdin_fd, 0, os.SEEK_SET)
    else:
        stdin_fd = os.open("/dev/null", os.O_RDONLY)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    st_r, st_w = os.pipe()
    for f in (sys.stdout, sys.stderr):
        f.flush()
    pid = os.fork()
    if pid == 0:
        _child(req, code, stdin_fd, out_w, err_w, st_w, cfg)
    for fd in (stdin_fd, out_w, err_w, st_w):
        os.close(fd)
    deadline = t0 + req["timeout_s"]
    pidfd = os.pidfd_open(pid)
    bufs = {out_r: bytearray(), err_r: bytearray()}
    outputs = [out_r, err_r]
    timed_out = overflow = False
    wstatus = usage = reported = None
    clean = True
    drain_until = None
    pidns = cfg["pidns"]

    def done():  # the main process is gone (reaped) or has reported and been SIGKILLed
        return wstatus is not None or reported is not None

    while outputs or not done():
        now = time.monotonic()
        if not done() and now >= deadline and not timed_out:
            timed_out = True
            clean = _kill_all(pidns, pid, reaped=False)
        if drain_until is not None and now > drain_until:
            break  # a writer we could not kill keeps a pipe open
        watch = outputs + ([] if done() else [pidfd] + ([st_r] if st_r >= 0 else []))
        left = max(0.0, deadline - now) if not done() and not timed_out else 0.1
        for fd in select.select(watch, [], [], left)[0]:
            if fd == pidfd:
                _, wstatus, usage = os.wait4(pid, 0)
                clean = _kill_all(pidns, pid, reaped=True) and clean  # leftovers would hold the pipes
                drain_until = time.monotonic() + 1.0
            elif fd == st_r:
                data = os.read(st_r, 16)
                os.close(st_r)
                st_r = -1
                if len(data) == 1 and not done():
                    reported = data[0]
                    os.kill(pid, signal.SIGKILL)  # it was about to exit: now no more of its code can run
                    _unreaped.append(pid)
                    if _others((pid,)) if pidns else _orphans((pid,)):
                        clean = _kill_all(pidns, pid, reaped=False) and clean
                    drain_until = time.monotonic() + 1.0
            else:
                data = os.read(fd, 1 << 16)
                if not data:
                    outputs.remove(fd)
                    os.close(fd)
                    continue
                buf = bufs[fd]
                room = cap - len(buf)
                buf += data[:max(room, 0)]
                if len(data) > room and not overflow:
                    overflow = True
                    clean = _kill_all(pidns, pid, reaped=wstatus is not None) and clean
    for fd in outputs + ([st_r] if st_r >= 0 else []):
        os.close(fd)
    os.close(pidfd)
    if timed_out or overflow:
        rc = None
    elif wstatus is not None:
        rc = os.waitstatus_to_exitcode(wstatus)
    else:
        rc = reported
    resp = {"returncode": rc, "duration_s": time.monotonic() - t0, "timed_out": timed_out, "overflow": overflow,
            "cpu_s": (usage.ru_utime + usage.ru_stime) if usage else None, "clean": clean}
    return resp, bytes(bufs[out_r]), bytes(bufs[err_r])


def main(argv):
    cfg = json.loads(argv[1])
    sys.path[0] = ""  # requests see the sys.path of `python -c` (cwd first), not this file's folder
    rfd, wfd = os.dup(0), os.dup(1)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as pid 1 a handled signal would be delivered
    libc = _libc()
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0: requests cannot read or write our memory or fds
        raise SystemExit("sandbox server: cannot make itself non-dumpable")  # no ready frame: the host gives up
    if not cfg["pidns"]:
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans of a request come to us
    errors = {}
    for name in cfg.get("preload", []):
        try:
            __import__(name)
        except BaseException as e:
            errors[name] = repr(e)
    for name, (soft, hard) in cfg["rlimits"].items():
        try:
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
        except (ValueError, OSError) as e:
            errors["rlimit " + name] = repr(e)
    dirty = _dirty() if cfg["pidns"] else []  # before any request: what no request can be blamed for
    gc.collect()
    gc.freeze()  # a forked child's GC then leaves the server's pages alone: nothing is copied
    write_frame(wfd, {"ready": True, "pid": os.getpid(), "errors": errors, "dirty": dirty})
    while True:
        try:
            req, blobs = read_frame(rfd)
        except EOFError:
            os._exit(0)
        resp, out, err = handle(req, blobs, cfg)
        if cfg["pidns"]:  # private /tmp and /dev/shm only exist inside the sandbox
            resp["dirty"] = _dirty()
            resp["clean"] = not resp["dirty"] and _ipc_clean() and resp.get("clean", True)
        write_frame(wfd, resp, [out, err])


if __name__ == "__main__":
    main(sys.argv)
