"""Test environments, prepared once per repository version and cached: a virtualenv on this
interpreter with the instance's `environment.pip` requirements (pytest among them) and the
harness's reporting plugin. The sandbox sees it read-only; the repository under test is
imported from the workspace, where the tests run.

Built under $FLYWHEEL_CACHE_DIR/swe/envs/<key>/ behind a lock, marked ready last, so two
processes never build one twice and a half-built one is never used.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from flywheel.envs.swe.instance import EnvironmentSpec
from flywheel.envs.swe.sources import SourceError, locked, swe_cache

RESULTS_MARK = "@@flywheel-swe-results@@"
PLUGIN = "flywheel_swe_report"
# pytest plugin (-p flywheel_swe_report): per node id [outcome, message, seconds], printed after
# the session as RESULTS_MARK + JSON. An outcome: passed | failed | error (setup/teardown) |
# skipped | xfailed | xpassed; the message: the failure's one-line crash message ("" when it
# passed); seconds: the call phase's duration.
PLUGIN_SOURCE = f'''
import json, sys

_outcomes = {{}}


def _message(report):
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def pytest_runtest_logreport(report):
    node, before = report.nodeid, _outcomes.get(report.nodeid, [None])[0]
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
        if before != "error":
            _outcomes[node] = [outcome, _message(report) if report.failed else "", round(report.duration, 4)]
    elif report.failed:
        _outcomes[node] = ["error", _message(report), 0.0]
    elif report.skipped and before is None:
        _outcomes[node] = ["xfailed" if hasattr(report, "wasxfail") else "skipped", "", 0.0]


def pytest_sessionfinish(session, exitstatus):
    sys.stdout.write("\\n{RESULTS_MARK}" + json.dumps(_outcomes) + "\\n")
    sys.stdout.flush()
'''


@dataclass(frozen=True)
class PreparedEnv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def bin(self) -> Path:
        return self.root / "bin"


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", key.split(":")[0])[:60] + "-" + \
        hashlib.sha256(f"{key}|{sys.version}|{PLUGIN_SOURCE}".encode()).hexdigest()[:12]


def prepare_env(spec: EnvironmentSpec, key: str) -> PreparedEnv:
    """The environment for `key` (SWEInstance.env_key), built on first use."""
    envs = swe_cache() / "envs"
    env = PreparedEnv(envs / _slug(key))
    if (env.root / ".ready").is_file():
        return env
    with locked(envs / ".lock"):
        if (env.root / ".ready").is_file():
            return env
        shutil.rmtree(env.root, ignore_errors=True)
        _run([sys.executable, "-m", "venv", "--without-pip", str(env.root)], f"creating the venv for {key}")
        _run([sys.executable, "-m", "pip", "--python", str(env.python), "install", "--quiet",
              "--disable-pip-version-check", *spec.pip], f"installing {' '.join(spec.pip)} for {key}")
        site = subprocess.run([str(env.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / f"{PLUGIN}.py").write_text(PLUGIN_SOURCE)
        (env.root / ".ready").write_text(json.dumps({"key": key, "pip": list(spec.pip)}) + "\n")
    return env


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SourceError(f"{what} failed: {(proc.stderr or proc.stdout).strip()[-800:]}")
