"""Nothing outside the workspace is readable that the code should not see: the home directory,
the project's own checkout, the host's environment (its own, /proc/1/environ, any /proc/*/environ),
root-only files such as /etc/shadow."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import pytest
from sandbox_helpers import FAST, REPO

from flywheel.sandbox import Sandbox, SandboxPool

LOOK = """
import json, os
def read(p):
    try:
        with open(p, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return None
def ls(p):
    try:
        return sorted(os.listdir(p))
    except OSError:
        return None
environs = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        environs[p] = read(f"/proc/{p}/environ")
print(json.dumps({
    "env": dict(os.environ),
    "environs": environs,
    "secret_file": read(SECRET_FILE),
    "home": ls(HOME),
    "repo": ls(REPO),
    "repo_files": [read(os.path.join(REPO, n)) for n in ("pyproject.toml", "src/flywheel/sandbox/__init__.py")],
    "shadow": read("/etc/shadow"),
    "etc": ls("/etc"),
    "ssh": ls(os.path.join(HOME, ".ssh")),
}))
"""


@pytest.fixture
def secret_env(monkeypatch):
    token = "s3cr3t-" + secrets.token_hex(8)
    monkeypatch.setenv("FLYWHEEL_TEST_SECRET", token)
    return token


@pytest.fixture
def secret_file():
    token = "home-secret-" + secrets.token_hex(8)
    path = Path.home() / f".flywheel-sandbox-test-{secrets.token_hex(4)}"
    path.write_text(token)
    yield path, token
    path.unlink()


def _look(run, path: Path) -> dict:
    code = (LOOK.replace("SECRET_FILE", repr(str(path))).replace("HOME", repr(str(Path.home())))
            .replace("REPO", repr(str(REPO))))
    r = run(code)
    assert r.ok, r
    return json.loads(r.stdout)


def test_host_secrets_are_not_readable(secret_env, secret_file):
    path, file_token = secret_file
    # constructed after the secret is set: they must not pass it on
    with SandboxPool(1, FAST) as pool:
        for seen in (_look(Sandbox(FAST).run_python, path), _look(pool.run_python, path)):
            blob = json.dumps(seen)
            assert secret_env not in blob and file_token not in blob
            assert set(seen["env"]) <= {"PATH", "HOME", "LANG", "TMPDIR", "PWD"}, seen["env"]
            assert seen["secret_file"] is None
            assert seen["repo_files"] == [None, None]
            # the repo's folder exists inside only as the mount point of the read-only venv, if at all
            assert seen["repo"] in (None, [], [".venv"]), seen["repo"]
            assert seen["home"] is None or path.name not in seen["home"]
            assert seen["shadow"] is None and seen["ssh"] is None
            assert "shadow" not in (seen["etc"] or [])
            # bwrap's own pid 1 is readable; it must hold nothing of the host environment
            pid1 = seen["environs"].get("1") or ""
            assert dict(kv.split("=", 1) for kv in pid1.split("\x00") if kv).items() <= {
                "PATH": "/usr/bin:/bin", "PWD": "/"}.items(), pid1
    assert os.environ["FLYWHEEL_TEST_SECRET"] == secret_env  # host untouched


def test_workspace_is_readable_and_nothing_else_of_the_host(sandbox, tmp_path):
    (tmp_path / "task.txt").write_text("hello")
    sibling = tmp_path.parent / f"sibling-{secrets.token_hex(4)}"
    sibling.mkdir()
    try:
        code = f"import os\nprint(open('task.txt').read())\nprint(os.path.exists({str(sibling)!r}))"
        r = sandbox.run_python(code, workspace=tmp_path)
        assert r.ok and r.stdout == "hello\nFalse\n", r
    finally:
        sibling.rmdir()
