"""flywheel.sandbox public API: limits plumbing, result classification, output capping, the
unsafe opt-in and the SandboxUnavailable message (bwrap's absence simulated by monkeypatching
the lookup). Tests that execute code in a real sandbox skip where bwrap cannot isolate."""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import threading
import time
import warnings

import pytest

from flywheel.sandbox import (ExecResult, Limits, Sandbox, SandboxError, SandboxPool, SandboxUnavailable,
                              UnsafeSandboxWarning, probe, sandbox_available, unavailable_reason)
from flywheel.sandbox.classify import classify, from_bwrap_exit

needs_sandbox = pytest.mark.skipif(unavailable_reason() is not None, reason=f"sandbox unavailable: {unavailable_reason()}")
MiB = 1 << 20


# -- Limits ------------------------------------------------------------------------------

def test_limits_defaults_and_rlimits_by_hand():
    lim = Limits()
    assert (lim.wall_s, lim.cpu_s, lim.memory_mb, lim.file_size_mb, lim.open_files, lim.processes,
            lim.output_bytes) == (10.0, 10, 1024, 64, 256, 64, 1 << 20)
    r = Limits(cpu_s=3, memory_mb=100, file_size_mb=2, open_files=32, processes=7).rlimits(nproc=True)
    assert r == {"AS": (104857600, 104857600), "CPU": (3, 4), "FSIZE": (2097152, 2097152),
                 "NOFILE": (32, 32), "CORE": (0, 0), "NPROC": (7, 7)}
    assert "NPROC" not in Limits().rlimits()


def test_prlimit_args_match_rlimits():
    args = Limits(cpu_s=3, memory_mb=100).prlimit_args(nproc=True)
    assert args == ["--as=104857600:104857600", "--cpu=3:4", "--fsize=67108864:67108864", "--nofile=256:256",
                    "--core=0:0", "--nproc=64:64"]


@pytest.mark.parametrize("bad", [dict(wall_s=0), dict(cpu_s=0), dict(memory_mb=8), dict(open_files=3),
                                 dict(processes=0), dict(output_bytes=-1), dict(file_size_mb=-1)])
def test_limits_reject_nonsense(bad):
    with pytest.raises(ValueError):
        Limits(**bad)


def test_limits_are_frozen_and_copyable():
    lim = Limits()
    with pytest.raises(Exception):
        lim.cpu_s = 5  # type: ignore[misc]
    assert lim.with_(cpu_s=5).cpu_s == 5 and lim.cpu_s == 10


# -- ExecResult and classification --------------------------------------------------------

def test_ok_needs_zero_exit_and_no_error():
    assert ExecResult(0, "", "", 0.1).ok
    assert not ExecResult(1, "", "", 0.1).ok
    assert not ExecResult(0, "", "", 0.1, error="too many processes").ok
    assert not ExecResult(None, "", "", 0.1, timed_out=True, error="timeout").ok


@pytest.mark.parametrize("kw, want", [
    (dict(returncode=None, overflow=True, timed_out=True), "output limit"),
    (dict(returncode=-9, oom_kills=1), "memory limit"),
    (dict(returncode=None, timed_out=True, pids_hits=3), "too many processes"),
    (dict(returncode=None, timed_out=True), "timeout"),
    (dict(returncode=-signal.SIGXCPU), "cpu limit"),
    (dict(returncode=-signal.SIGXFSZ), "file size limit"),
    (dict(returncode=1, stderr="Traceback...\nMemoryError\n"), "memory limit"),
    (dict(returncode=1, stderr="OSError: [Errno 27] File too large\n"), "file size limit"),
    (dict(returncode=1, stderr="BlockingIOError: [Errno 11] Resource temporarily unavailable\n"), "too many processes"),
    (dict(returncode=-9, duration_s=0.2, cpu_limit=1), "killed"),
    (dict(returncode=-9, duration_s=2.1, cpu_limit=1), "cpu limit"),
    (dict(returncode=None, died=True), "killed"),
    (dict(returncode=1, stderr="ValueError: MemoryError is mentioned in passing\n"), None),
    (dict(returncode=0, stderr="MemoryError\n"), None),
    (dict(returncode=-11), None),  # a segfault is the code's own failure, not a sandbox reason
])
def test_classify(kw, want):
    assert classify(**kw) == want


def test_bwrap_exit_codes_map_to_signals():
    assert from_bwrap_exit(0) == 0 and from_bwrap_exit(3) == 3 and from_bwrap_exit(128) == 128
    assert from_bwrap_exit(137) == -9 and from_bwrap_exit(152) == -24 and from_bwrap_exit(255) == 255


# -- availability and the unsafe opt-in -------------------------------------------------

@pytest.fixture
def no_bwrap(monkeypatch):
    monkeypatch.setattr(probe, "find_bwrap", lambda: None)
    monkeypatch.delenv(probe.UNSAFE_ENV, raising=False)


def test_missing_bwrap_refuses_with_install_hint(no_bwrap):
    assert not sandbox_available()
    for make in (lambda: Sandbox(), lambda: SandboxPool(1), lambda: Sandbox(unsafe=False)):
        with pytest.raises(SandboxUnavailable) as e:
            make()
        msg = str(e.value)
        assert "apt-get install bubblewrap" in msg and "make setup" in msg
        assert "FLYWHEEL_UNSAFE_NO_SANDBOX=1" in msg and "unsafe=True" in msg
        assert isinstance(e.value, SandboxError)


def test_unsafe_opt_in_warns_at_every_construction(no_bwrap, monkeypatch):
    with pytest.warns(UnsafeSandboxWarning) as rec:
        Sandbox(unsafe=True)
        Sandbox(unsafe=True)
    assert len(rec) == 2 and "WITHOUT isolation" in str(rec[0].message)
    monkeypatch.setenv(probe.UNSAFE_ENV, "1")
    with pytest.warns(UnsafeSandboxWarning):
        sb = Sandbox()
    assert not sb.isolated
    with pytest.raises(SandboxUnavailable):  # an explicit False beats the environment variable
        Sandbox(unsafe=False)


def test_unsafe_mode_still_applies_limits(no_bwrap, tmp_path):
    with pytest.warns(UnsafeSandboxWarning):
        sb = Sandbox(Limits(wall_s=1.0, output_bytes=100), unsafe=True)
    r = sb.run_python("print(1+1)", workspace=tmp_path)
    assert r.ok and r.stdout == "2\n", r
    assert sb.run_python("while True: pass").error == "timeout"
    r = sb.run_python("print('x' * 1000)")
    assert r.error == "output limit" and r.truncated and len(r.stdout) == 100
    with pytest.warns(UnsafeSandboxWarning):
        pool = SandboxPool(1, Limits(wall_s=2.0), unsafe=True)
    with pool:
        assert pool.run_python("print(3)").stdout == "3\n"
        r = pool.run_python("import time; time.sleep(10)", timeout_s=0.5)
        assert r.error == "timeout"
        assert pool.run_python("print(4)").stdout == "4\n"


@needs_sandbox
def test_unsafe_flag_is_ignored_when_isolation_works():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsafeSandboxWarning)
        assert Sandbox(unsafe=True).isolated


# -- limits reach the code (real sandbox) --------------------------------------------------

@needs_sandbox
def test_limits_plumbing_cold():
    sb = Sandbox(Limits(open_files=32, memory_mb=200, file_size_mb=1, cpu_s=7))
    code = ("import resource as r\nprint([r.getrlimit(x) for x in "
            "(r.RLIMIT_NOFILE, r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_CPU, r.RLIMIT_CORE)])")
    r = sb.run_python(code)
    assert r.ok, r
    assert r.stdout.strip() == str([(32, 32), (200 * MiB,) * 2, (MiB, MiB), (7, 8), (0, 0)])
    # a per-call override wins over the constructor's limits
    r = sb.run_python(code, limits=Limits(open_files=64))
    assert r.stdout.startswith("[(64, 64), (1073741824, 1073741824)")
    r = sb.run_python("fs = [open('/dev/null') for _ in range(40)]")
    assert r.returncode == 1 and "Too many open files" in r.stderr


@needs_sandbox
def test_limits_plumbing_pool():
    with SandboxPool(1, Limits(open_files=32, memory_mb=300, file_size_mb=1, cpu_s=7)) as pool:
        r = pool.run_python("import resource as r\nprint([r.getrlimit(x) for x in "
                            "(r.RLIMIT_NOFILE, r.RLIMIT_AS, r.RLIMIT_FSIZE, r.RLIMIT_CPU)])")
        assert r.stdout.strip() == str([(32, 32), (300 * MiB,) * 2, (MiB, MiB), (7, 8)]), r


@needs_sandbox
@pytest.mark.parametrize("runner", ["cold", "pool"])
def test_output_capping_flag(runner):
    lim = Limits(output_bytes=100)
    if runner == "cold":
        run = Sandbox(lim).run_python
    else:
        pool = SandboxPool(1, lim)
        run = pool.run_python
    try:
        r = run("print('a' * 99)")  # 100 bytes with the newline: at the cap, not over it
        assert r.ok and not r.truncated and r.stdout == "a" * 99 + "\n"
        r = run("import sys\nprint('a' * 99)\nsys.stderr.write('b' * 500)")
        assert r.truncated and r.error == "output limit" and r.stderr == "b" * 100 and r.returncode is None
    finally:
        if runner == "pool":
            pool.close()


@needs_sandbox
def test_stdin_env_cwd_and_exit_codes(tmp_path):
    (tmp_path / "sub").mkdir()
    sb = Sandbox()
    r = sb.run(["/bin/sh", "-c", 'read x; echo "$x $FOO $(pwd)"; exit 3'], workspace=tmp_path, stdin="hi\n",
               env={"FOO": "bar"}, cwd="sub")
    assert r.returncode == 3 and r.stdout == "hi bar /workspace/sub\n" and r.error is None
    assert Sandbox().run(["/bin/sh", "-c", "kill -9 $$"]).returncode == -9
    with pytest.raises(ValueError):
        sb.run(["true"], cwd="../escape")
    with pytest.raises(SandboxError):
        sb.run(["true"], workspace=tmp_path / "missing")


@needs_sandbox
def test_pool_run_module_and_closed_pool(tmp_path):
    (tmp_path / "test_small.py").write_text("def test_one():\n    assert 1 + 1 == 2\n\ndef test_two():\n    assert False\n")
    pool = SandboxPool(1, preload=["pytest"])
    try:
        assert pool.preload_errors() == {}
        r = pool.run_module("pytest", ["-q", "-p", "no:cacheprovider", "test_small.py"], workspace=tmp_path)
        assert r.returncode == 1 and "1 failed, 1 passed" in r.stdout, r
        r = pool.run_module("json.tool", [], stdin='{"a": 1}')
        assert r.ok and r.stdout == '{\n    "a": 1\n}\n', r
    finally:
        pool.close()
    with pytest.raises(SandboxError):
        pool.run_python("print(1)")


@needs_sandbox
def test_pool_from_threads_and_asyncio():
    with SandboxPool(2) as pool:
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            outs = list(ex.map(lambda i: pool.run_python(f"print({i} * 2)").stdout, range(40)))
        assert outs == [f"{i * 2}\n" for i in range(40)]

        async def main():
            loop = asyncio.get_running_loop()
            return await asyncio.gather(*(loop.run_in_executor(None, pool.run_python, f"print({i})") for i in range(10)))

        assert [r.stdout for r in asyncio.run(main())] == [f"{i}\n" for i in range(10)]
    # cold sandboxes from several threads at once
    sb = Sandbox()
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda i: sb.run_python(f"print({i})").stdout, range(8)))
    assert outs == [f"{i}\n" for i in range(8)]


@needs_sandbox
def test_close_during_a_request_returns_killed():
    pool = SandboxPool(1)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", pool.run_python("import time; time.sleep(30)")))
    t.start()
    time.sleep(0.3)
    pool.close()
    t.join(10)
    assert not t.is_alive() and box["r"].error == "killed", box


@needs_sandbox
def test_pool_env_reaches_requests():
    with SandboxPool(1, env={"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}) as pool:
        r = pool.run_python("import os; print(os.environ.get('PYTEST_DISABLE_PLUGIN_AUTOLOAD'), os.environ['HOME'])")
        assert r.stdout == "1 /tmp\n", r
