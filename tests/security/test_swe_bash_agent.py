"""The `swe` environment's bash tool against a hostile agent: a fork bomb, network attempts,
writes outside the workspace, a background process left running, a 1 GB output and a symlink
out of the workspace. Each is contained, the host and the instance's base are untouched, and
the next episode starts clean."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path

import pytest
from sandbox_helpers import MOUNT_SKELETON, descendants

from flywheel.envs.base import Policy
from flywheel.envs.patches import make_diff
from flywheel.envs.swe.env import SUBMIT, SWEEnvironment
from flywheel.envs.swe.instance import Source, SWEInstance
from flywheel.envs.swe.prepared import prepare_env
from flywheel.envs.swe.sources import SourceError, swe_cache
from flywheel.envs.swe.workspace import instance_base
from flywheel.envs.tool_env import ToolLimits
from flywheel.rollout.play import play

CODE = "def double(x):\n    return 2 * x\n"
TESTS = "from pkg.mod import double\n\n\ndef test_double():\n    assert double(3) == 6\n\n\ndef test_zero():\n" \
        "    assert double(0) == 0\n"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("swe-sec") / "proj"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text(CODE)
    (root / "tests" / "test_mod.py").write_text(TESTS)
    buggy = CODE.replace("2 * x", "2 + x")
    inst = SWEInstance("sec__double__1", "local/proj", "folder", "double(3) is 5", make_diff("pkg/mod.py", buggy, CODE),
                       "", ["tests/test_mod.py::test_double"], ["tests/test_mod.py::test_zero"], "0.1",
                       Source(kind="folder", path=str(root)), bug_patch=make_diff("pkg/mod.py", CODE, buggy),
                       split="train")
    try:
        prepare_env(inst.environment, inst.env_key)
    except SourceError as e:
        pytest.skip(f"the test environment could not be prepared (package index unreachable?): {e}")
    return SWEEnvironment([inst], "security", ToolLimits(max_turns=4, max_tool_calls_per_turn=1,
                                                          max_observation_tokens=512, episode_timeout_s=120),
                          max_bash_timeout_s=5)


class Commands(Policy):
    def __init__(self, *commands: str):
        self.commands = commands

    async def act(self, task, history, tools, episode=0):
        i = sum(1 for m in history if m.get("role") == "assistant")
        command = self.commands[i] if i < len(self.commands) else SUBMIT
        return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command, 'timeout': 5}})}</tool_call>"


def run(env, *commands):
    """One episode; (its result, the tool outputs in order)."""
    (result,) = asyncio.run(play(env, env.tasks("train"), Commands(*commands), timeout_s=120))
    outputs = [m["content"] for m in result.transcript if m.get("role") == "tool"]
    return result, outputs


def digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode() + (p.read_bytes() if p.is_file() and not p.is_symlink() else b""))
    return h.hexdigest()


# /tmp entries that are mount points of read-only binds (an interpreter, a checkout or the
# prepared venv living under /tmp), not left-overs
SKELETON = set(MOUNT_SKELETON) | ({swe_cache().resolve().relative_to("/tmp").parts[0]}
                                  if swe_cache().resolve().is_relative_to("/tmp") else set())
CLEAN = "ls -A; echo ---; ls -A /tmp; echo ---; cat pkg/mod.py"


def assert_next_episode_clean(env):
    """A fresh episode sees the instance's files only, an empty /tmp and the buggy code; the
    base it was made from is unchanged."""
    base = instance_base(env.instances[0])
    before = digest(base)
    result, (listing,) = run(env, CLEAN)
    status, _, listing = listing.partition("\n")
    assert status == "[exit code 0]", status
    files, tmp, code = listing.split("---\n")
    assert files.split() == ["pkg", "tests"], listing
    assert set(tmp.split()) <= SKELETON, listing
    assert "2 + x" in code, listing
    assert result.reward == 0.0  # nothing fixed
    assert digest(base) == before


def test_a_fork_bomb_is_contained(env):
    before = descendants()
    t0 = time.monotonic()
    result, (out,) = run(env, "b() { b | b & }; b; sleep 1")
    assert time.monotonic() - t0 < 60
    assert out.startswith("[killed: too many processes]"), out[:300]
    assert not (descendants() - before)
    assert_next_episode_clean(env)


def test_network_is_unreachable(env):
    _, (py, dev) = run(env, "python -c \"import socket; s=socket.create_connection(('1.1.1.1', 53), timeout=2)\"",
                       "echo x > /dev/tcp/8.8.8.8/53")
    assert "exit code 0" not in py and ("Network is unreachable" in py or "Errno" in py), py
    assert "exit code 0" not in dev, dev


def test_writes_outside_the_workspace_go_nowhere(env, tmp_path):
    target = tmp_path / "evil.txt"
    base = instance_base(env.instances[0])
    _, outs = run(env, f"echo evil > {target}; echo evil > /evil; echo evil > {base}/pkg/evil.py; "
                       "echo evil > ../evil; echo evil > /tmp/evil; ls /tmp")
    assert not target.exists() and not (base / "pkg" / "evil.py").exists()
    assert not Path("/evil").exists()
    assert_next_episode_clean(env)


def test_a_background_process_does_not_outlive_its_command(env, tmp_path):
    marker = tmp_path / "alive"
    before = descendants()
    _, (out,) = run(env, "(sleep 30; echo late > pkg/late.py) & disown; nohup sleep 40 >/dev/null 2>&1 & echo started")
    assert "started" in out
    time.sleep(0.5)
    assert not (descendants() - before)
    assert not marker.exists()
    assert_next_episode_clean(env)


def test_a_gigabyte_of_output_is_cut(env):
    t0 = time.monotonic()
    _, (out,) = run(env, "head -c 1000000000 /dev/zero | tr '\\0' 'a'")
    assert time.monotonic() - t0 < 30
    assert "more than" in out and "bytes of output" in out and len(out) < 64_000, out[-200:]
    assert_next_episode_clean(env)


def test_a_symlink_out_of_the_workspace_reads_and_writes_nothing_outside(env, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    result, (made, read) = run(env, f"ln -s {tmp_path} out && ln -s / root && echo evil > out/new.txt; ls",
                               "cat out/secret.txt; cat root/etc/shadow; echo done")
    assert "host secret" not in read and "root:" not in read, read
    assert not (tmp_path / "new.txt").exists() and secret.read_text() == "host secret"
    assert result.reward == 0.0
    assert_next_episode_clean(env)
