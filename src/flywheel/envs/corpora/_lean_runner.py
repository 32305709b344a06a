"""A lean test runner for pytest-style tests, executed INSIDE the sandbox (not imported by flywheel).

flywheel sends this file's text plus a `main({...})` call to a warm sandbox interpreter that
forks per run (`SandboxPool.run_python`), so a verification costs one fork and the imports of
the test files instead of a cold `python -m pytest` (~3 ms vs ~250 ms for two tests).

What it runs: module-level `test*` functions and `test*` methods of `Test*` classes (no
`__init__`) in files named `test_*.py` / `*_test.py`, without fixtures or parametrize (a test
that needs one is reported as an error); `@pytest.mark.skip` and `pytest.skip()` skip. Files
are imported as pytest's default `prepend` import mode does (the first folder up without an
`__init__.py` goes on sys.path), and the repository root is importable too.
Each test gets a wall-clock alarm; stdout/stderr of tests are captured and dropped.
The report is one line on stdout: MARK + JSON {test_id: [outcome, message(, seconds)]}, outcome
one of passed / failed / error / skipped / timeout / not_run.
"""

import ast
import contextlib
import importlib
import inspect
import io
import json
import linecache
import os
import signal
import sys
import time
import traceback

MARK = "@@flywheel-test-results@@"
SKIP_DIRS = {"build", "dist", "node_modules", "venv", "CVS", "_darcs", "__pycache__", "site-packages"}


class _Timeout(BaseException):
    pass


def _discover(root):
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS
                             and not d.endswith(".egg"))
        for name in sorted(filenames):
            if name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py")):
                found.append(os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/"))
    return found


def _import(root, relpath):
    path = os.path.join(root, relpath)
    base, parts = os.path.dirname(path), [os.path.basename(path)[:-3]]
    while os.path.exists(os.path.join(base, "__init__.py")):
        base, pkg = os.path.split(base)
        parts.insert(0, pkg)
    if base not in sys.path:
        sys.path.insert(0, base)
    return importlib.import_module(".".join(parts))


def _collect(module):
    items = {}
    for name, obj in list(vars(module).items()):
        if name.startswith("test") and inspect.isfunction(obj):
            items[name] = obj
        elif name.startswith("Test") and inspect.isclass(obj) and "__init__" not in vars(obj):
            for meth in dir(obj):
                if meth.startswith("test") and callable(getattr(obj, meth, None)):
                    items[f"{name}::{meth}"] = (obj, meth)
    return items


def _explain(exc):
    """One line: the exception, and for a bare `assert a == b` the assert and the left value."""
    text = f"{type(exc).__name__}: {exc}".strip()
    if not isinstance(exc, AssertionError) or str(exc):
        return text.rstrip(":")
    tb = exc.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame, lineno = tb.tb_frame, tb.tb_lineno
    try:
        source = "".join(linecache.getlines(frame.f_code.co_filename))
        node = next(n for n in ast.walk(ast.parse(source))
                    if isinstance(n, ast.Assert) and n.lineno <= lineno <= n.end_lineno)
        text = "AssertionError: " + " ".join(ast.get_source_segment(source, node).split())
        test = node.test
        if isinstance(test, ast.Compare) and len(test.ops) == 1:
            left = eval(compile(ast.Expression(test.left), "<assert>", "eval"), frame.f_globals, frame.f_locals)
            text += f"  (left side: {left!r:.200})"
    except Exception:
        pass
    return text


def _run_one(target, per_test_s):
    if isinstance(target, tuple):
        cls, meth = target
        func = getattr(cls(), meth)
    else:
        func = target
    marks = getattr(func, "pytestmark", [])
    if any(getattr(m, "name", "") == "skip" for m in marks):
        return "skipped", "marked skip"
    params = [p for p in inspect.signature(func).parameters.values() if p.default is inspect.Parameter.empty]
    if params or any(getattr(m, "name", "") == "parametrize" for m in marks):
        return "error", "needs fixtures/parametrize, which the lean runner does not support: " + \
            ", ".join(p.name for p in params)
    out = io.StringIO()
    signal.setitimer(signal.ITIMER_REAL, per_test_s)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            func()
        return "passed", ""
    except _Timeout:
        return "timeout", f"timed out after {per_test_s:g} s"
    except BaseException as e:  # noqa: B036 - a test may raise anything, SystemExit included
        if type(e).__name__ in ("Skipped", "SkipTest"):
            return "skipped", str(e)
        return ("failed" if isinstance(e, AssertionError) else "error"), _explain(e)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def main(spec):
    """spec: {"ids": [test ids] or null (discover all), "per_test_s": float, "stop_on_timeout": bool}"""
    sys.dont_write_bytecode = True  # never leave mtime-checked pycs behind: a mutant can keep size and mtime
    root = os.getcwd()
    if root not in sys.path:
        sys.path.insert(0, root)

    per_test_alarm = [True]

    def on_alarm(signum, frame):
        raise _Timeout()

    try:
        signal.signal(signal.SIGALRM, on_alarm)
    except ValueError:  # not the main thread: only the sandbox's wall clock bounds the run
        per_test_alarm[0] = False
    per_test_s = float(spec.get("per_test_s", 5.0)) if per_test_alarm[0] else 0.0
    ids = spec.get("ids")
    files = {}
    if ids is None:
        for f in _discover(root):
            files[f] = None
    else:
        for tid in ids:
            f, _, name = tid.partition("::")
            files.setdefault(f, []).append(name)
    results, stop = {}, False
    for relpath, names in files.items():
        if stop:
            for n in names or []:
                results[f"{relpath}::{n}"] = ["not_run", "an earlier test timed out"]
            continue
        if not os.path.isfile(os.path.join(root, relpath)):
            for n in names or []:
                results[f"{relpath}::{n}"] = ["error", f"test file {relpath} not found"]
            continue
        signal.setitimer(signal.ITIMER_REAL, per_test_s)  # an import may loop forever too
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                items = _collect(_import(root, relpath))
        except BaseException as e:  # noqa: B036
            timed_out = isinstance(e, _Timeout)
            line = (f"timed out after {per_test_s:g} s" if timed_out else
                    traceback.format_exception_only(type(e), e)[-1].strip()[:500])
            for n in names or ["<collection>"]:
                results[f"{relpath}::{n}"] = ["timeout" if timed_out else "error", f"importing {relpath}: {line}"]
            stop = timed_out and bool(spec.get("stop_on_timeout"))
            continue
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for n in (names if names is not None else list(items)):
            tid = f"{relpath}::{n}"
            if stop:
                results[tid] = ["not_run", "an earlier test timed out"]
            elif n not in items:
                results[tid] = ["error", f"no test named {n!r} in {relpath}"]
            else:
                t0 = time.perf_counter()
                try:
                    results[tid] = list(_run_one(items[n], per_test_s))
                except BaseException as e:  # noqa: B036 - e.g. a Test class whose constructor fails
                    results[tid] = ["error", _explain(e)]
                results[tid][1] = results[tid][1][:500]  # bounded report, whatever a test raised
                results[tid].append(round(time.perf_counter() - t0, 6))
                stop = results[tid][0] == "timeout" and bool(spec.get("stop_on_timeout"))
    sys.stdout.write("\n" + MARK + json.dumps(results) + "\n")
    sys.stdout.flush()
