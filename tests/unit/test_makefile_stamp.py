"""`make setup`'s stamp lists the extras installed; a subset of them counts as installed (issue 35,
point 10: `make demo` after `make test-all` must not reinstall). The recipe runs for real against a
temporary venv whose `bin/python` only records its arguments."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(venv: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-C", str(ROOT), "--no-print-directory", f"VENV={venv}", "SYSTEM_PACKAGES=",
                           *args], capture_output=True, text=True, timeout=60)


@pytest.fixture()
def venv(tmp_path) -> Path:
    """A venv whose python appends its arguments to calls.log and succeeds."""
    v = tmp_path / "venv"
    (v / "bin").mkdir(parents=True)
    py = v / "bin" / "python"
    py.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "calls.log"}\n')
    py.chmod(0o755)
    return v


def stamp_of(venv: Path) -> Path:
    out = make(venv, "--eval", "print-stamp: ; @echo $(STAMP)", "print-stamp")
    assert out.returncode == 0, out.stderr
    return Path(out.stdout.strip())


def installed(venv: Path, extras: str) -> Path:
    """Write the stamp as a setup with `extras` leaves it, newer than pyproject.toml."""
    stamp = stamp_of(venv)
    stamp.write_text("".join(e + "\n" for e in extras.split(",")))
    future = time.time() + 3600
    os.utime(stamp, (future, future))
    return stamp


def calls(venv: Path) -> list[str]:
    log = venv.parent / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def test_a_subset_of_the_installed_extras_installs_nothing(venv):
    installed(venv, "dev,postgres,ray")  # what `make test-all` installs
    for extras in ("dev", "ray,dev", "dev,postgres,ray"):
        out = make(venv, "setup", f"EXTRAS={extras}")
        assert out.returncode == 0, out.stderr
        assert "pip" not in out.stdout, (extras, out.stdout)
    assert calls(venv) == []


def test_a_missing_extra_installs_the_union_and_records_it(venv):
    stamp = installed(venv, "dev,postgres")
    out = make(venv, "setup", "EXTRAS=dev,bench")
    assert out.returncode == 0, out.stderr
    assert "extras to install: bench (installed: dev postgres)" in out.stdout
    assert "-m pip install --quiet -e .[bench,dev,postgres]" in calls(venv)  # nothing installed before is lost
    assert stamp.read_text().split() == ["bench", "dev", "postgres"]
    before = len(calls(venv))
    assert make(venv, "setup", "EXTRAS=dev").returncode == 0  # a subset now: a no-op
    assert len(calls(venv)) == before


def test_a_fresh_venv_and_a_changed_pyproject_install(venv):
    out = make(venv, "setup")  # no stamp: EXTRAS=dev
    assert out.returncode == 0, out.stderr
    assert "-m pip install --quiet -e .[dev]" in calls(venv)
    stamp = stamp_of(venv)
    assert stamp.read_text() == "dev\n"
    os.utime(stamp, (0, 0))  # older than pyproject.toml: reinstall what the stamp lists, plus what is asked
    n = len(calls(venv))
    assert make(venv, "setup", "EXTRAS=ray").returncode == 0
    assert calls(venv)[n:][-1] == "-m pip install --quiet -e .[dev,ray]"
