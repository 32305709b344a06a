"""code_repair end to end in the real sandbox: gold patches score 1, no-ops and test edits score 0,
partial-pass metrics, confined paths, contained bash timeouts, bad input reported clearly."""

import asyncio
import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app as cli
from flywheel.envs.base import Policy
from flywheel.envs.code_repair import edits_from_patch, load, RepoTools
from flywheel.envs.grading import grade
from flywheel.envs.patches import apply_patch, make_diff
from flywheel.envs.repo import (CodeRepairError, copy_tree, CORPORA, Instance, PatchError, read_instances,
                                write_instances)
from flywheel.envs.synth_bugs import synthesize
from flywheel.rollout.play import play as play_episodes

sandbox = pytest.importorskip("flywheel.sandbox")
if not sandbox.sandbox_available():
    pytest.skip("bubblewrap sandbox not available", allow_module_level=True)

MINILIB = CORPORA / "minilib"
SUBMIT = {"name": "submit", "arguments": {}}


class Script(Policy):
    """Plays turns of tool calls made from the task (`turns(task) -> [[call, ...], ...]`), then submits."""

    def __init__(self, turns):
        self.turns = turns

    async def act(self, task, history, tools, episode=0):
        i = sum(1 for m in history if m.get("role") == "assistant")
        planned = self.turns(task)
        calls = planned[i] if i < len(planned) else [SUBMIT]
        return "".join(f"<tool_call>{json.dumps(c)}</tool_call>" for c in calls)


def play(env, tasks, policy):
    return asyncio.run(play_episodes(env, tasks, policy, concurrency=4, timeout_s=120))


def edit(path, old, new):
    return {"name": "str_replace", "arguments": {"path": path, "old": old, "new": new}}


def bash(command, timeout=10):
    return {"name": "bash", "arguments": {"command": command, "timeout": timeout}}


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    """A handful of synthesized instances written to a JSONL file."""
    instances, _ = synthesize("minilib", max_n=6, seed=3)
    path = tmp_path_factory.mktemp("cr") / "tasks.jsonl"
    write_instances(path, instances)
    return path


@pytest.fixture(scope="module")
def env(synth):
    return load(instances=str(synth))


def two_bug_instance(tmp_path) -> Path:
    """Bugs in text.count_vowels and numbers.clamp; PASS_TO_PASS watches caesar, gcd and slugify."""
    text, numbers = (MINILIB / "minilib/text.py").read_text(), (MINILIB / "minilib/numbers.py").read_text()
    bug = (make_diff("minilib/text.py", text, text.replace('if c in VOWELS)', 'if c in "aei")'))
           + make_diff("minilib/numbers.py", numbers, numbers.replace("max(lo, min(value, hi))", "min(value, hi)")))
    inst = Instance(instance_id="two-bugs", repo="minilib", base_commit="", problem_statement="two bugs",
                    patch=make_diff("minilib/text.py", text.replace('if c in VOWELS)', 'if c in "aei")'), text),
                    test_patch="", FAIL_TO_PASS=["tests/test_text.py::test_count_vowels",
                                                 "tests/test_numbers.py::test_clamp"],
                    PASS_TO_PASS=["tests/test_text.py::test_caesar", "tests/test_numbers.py::test_gcd",
                                  "tests/test_text.py::test_slugify"], bug_patch=bug)
    path = tmp_path / "two.jsonl"
    write_instances(path, [inst])
    return path


def gold_calls(task):
    return edits_from_patch(task.answer)


def test_gold_patch_scores_one(env):
    tasks = env.tasks("train", n=3) + env.tasks("test", n=1)
    assert json.loads(json.dumps(tasks[0].metadata))["instance"]["patch"] == tasks[0].answer  # plain JSON
    results = play(env, tasks, env.scripted_policy())
    for r in results:
        assert r.error is None, r.error
        assert r.reward == 1.0, (r.task.id, r.metrics, r.transcript[-3:])
        assert r.metrics["reward/fail_to_pass"] == 1.0 and r.metrics["reward/pass_to_pass"] == 1.0
        assert r.metrics["files_changed"] == 1.0 and r.metrics["grading_error"] == 0.0


def test_noop_scores_zero(env):
    results = play(env, env.tasks("train", n=2), Script(lambda task: []))
    for r in results:
        assert r.error is None and r.reward == 0.0
        assert r.metrics["reward/fail_to_pass"] == 0.0 and r.metrics["reward/pass_to_pass"] == 1.0
        assert r.metrics["files_changed"] == 0.0


def test_deleting_or_editing_the_failing_tests_scores_zero(env):
    task = env.tasks("train", n=1)[0]
    test_file, _ = task.metadata["instance"]["FAIL_TO_PASS"][0].split("::")

    def delete(task):
        return [[bash(f"rm {test_file} && echo gone")]]

    def neuter(task):  # replace the failing test's body: every assert becomes a no-op
        return [[bash(f"sed -i 's/^    assert /    assert True or /' {test_file}")]]

    def gold_plus_test_edit(task):
        return [[bash(f"rm {test_file}")], gold_calls(task)]

    def swap_in_own_tests(task):  # passing copies of the tests, and `tests` made a link to them
        return [[bash("cp -r tests own && sed -i 's/^    assert /    assert True or /' own/*.py && "
                      "mv own/test_roman.py own/roman_checks.py && rm -rf tests && ln -s own tests && ls -l")]]

    results = play(env, [task] * 2, Script(delete))
    results += play(env, [task], Script(neuter))
    (swap,) = play(env, [task], Script(swap_in_own_tests))
    assert swap.reward == 0.0 and swap.metrics["reward/fail_to_pass"] == 0.0, swap.metrics
    for r in results:
        assert r.error is None and r.reward == 0.0, r.metrics
        assert r.metrics["test_files_touched"] == 1.0 and r.metrics["reward/fail_to_pass"] == 0.0
    (good,) = play(env, [task], Script(gold_plus_test_edit))
    assert good.reward == 1.0 and good.metrics["test_files_touched"] == 1.0  # test edits are ignored, not punished


def test_partial_pass_metrics(tmp_path):
    env = load(instances=str(two_bug_instance(tmp_path)))
    task = env.tasks("test")[0]
    fix_vowels = edit("minilib/text.py", 'if c in "aei")', "if c in VOWELS)")
    break_caesar = edit("minilib/text.py", '(ord(char) - ord("a") + shift) % 26', '(ord(char) - ord("a") + shift) % 25')
    (noop,) = play(env, [task], Script(lambda t: []))
    (half,) = play(env, [task], Script(lambda t: [[fix_vowels]]))
    (worse,) = play(env, [task], Script(lambda t: [[fix_vowels, break_caesar]]))
    assert (noop.reward, noop.metrics["reward/fail_to_pass"], noop.metrics["reward/pass_to_pass"]) == (0.0, 0.0, 1.0)
    assert (half.reward, half.metrics["reward/fail_to_pass"], half.metrics["reward/pass_to_pass"]) == (0.0, 0.5, 1.0)
    assert (worse.reward, worse.metrics["reward/fail_to_pass"]) == (0.0, 0.5)
    assert worse.metrics["reward/pass_to_pass"] == pytest.approx(2 / 3)


def test_grading_sees_edits_that_keep_size_and_mtime(tmp_path):
    """The base snapshot carries compiled .pyc files; an edit of the same size with the old mtime
    must still be what the tests import (checked-hash pycs), not the stale bytecode."""
    text = (MINILIB / "minilib/text.py").read_text()
    lower = '(ord(char) - ord("a") + shift) % 26'
    inst = Instance(instance_id="caesar", repo="minilib", base_commit="", problem_statement="caesar",
                    patch=make_diff("minilib/text.py", text.replace(lower, lower[:-2] + "27"), text), test_patch="",
                    FAIL_TO_PASS=["tests/test_text.py::test_caesar"], PASS_TO_PASS=[],
                    bug_patch=make_diff("minilib/text.py", text, text.replace(lower, lower[:-2] + "27")))
    write_instances(tmp_path / "one.jsonl", [inst])
    env = load(instances=str(tmp_path / "one.jsonl"))
    inst = env.instances[0]
    base = env.base_snapshot(inst)
    assert list((base / "minilib/__pycache__").glob("text.*.pyc"))
    ws = tmp_path / "ws"
    copy_tree(base, ws, keep_pycache=True)
    f = ws / "minilib/text.py"
    st = f.stat()
    f.write_text(f.read_text().replace(lower[:-2] + "27", lower))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert grade(inst, base, ws).resolved
    assert not grade(inst, base, base).resolved


def test_paths_are_confined_to_the_workspace(tmp_path):
    ws, outside = tmp_path / "ws", tmp_path / "secret.txt"
    (ws / "pkg").mkdir(parents=True)
    (ws / "pkg/a.py").write_text("x = 1\ny = 2\nx = 1\n")
    outside.write_text("secret\n")
    (ws / "link.txt").symlink_to(outside)
    tools = RepoTools(ws, sandbox=None)
    from flywheel.envs.tools import ToolError

    for bad in ["/etc/passwd", str(outside), "../secret.txt", "pkg/../../secret.txt", "link.txt",
                "/workspace/pkg/a.py"]:
        with pytest.raises(ToolError) as e:
            tools.read_file(bad)
        assert e.value.kind == "bad_arguments" and ("outside" in str(e.value) or "absolute" in str(e.value))
        with pytest.raises(ToolError):
            tools.str_replace(bad, "secret", "pwned")
    assert outside.read_text() == "secret\n"
    assert "'pkg/a.py'" in str(pytest.raises(ToolError, tools.read_file, "/workspace/pkg/a.py").value)  # a hint
    assert tools.read_file("pkg/../pkg/a.py", 2, 2) == "pkg/../pkg/a.py (lines 2-2 of 3)\n    2\ty = 2"
    with pytest.raises(ToolError, match="occurs 2 times"):
        tools.str_replace("pkg/a.py", "x = 1", "x = 3")
    with pytest.raises(ToolError, match="occurs 0 times"):
        tools.str_replace("pkg/a.py", "z = 1", "x = 3")
    assert tools.str_replace("pkg/a.py", "x = 1\ny", "x = 5\ny").startswith("edited pkg/a.py: replaced lines 1-2")
    assert (ws / "pkg/a.py").read_text() == "x = 5\ny = 2\nx = 1\n"
    with pytest.raises(ToolError, match="is a directory; entries: a.py"):
        tools.read_file("pkg")


def test_tool_errors_and_bash_timeout_do_not_end_the_episode(env):
    task = env.tasks("train", n=1)[0]
    e = env.make_env(task)

    async def go():
        await e.initial_observation()
        t0 = time.perf_counter()
        slow = bash("echo start; sleep 30; echo never", timeout=1)
        escape = {"name": "read_file", "arguments": {"path": "../../etc/passwd"}}
        r1 = await e.step(f"<tool_call>{json.dumps(slow)}</tool_call><tool_call>{json.dumps(escape)}</tool_call>")
        elapsed = time.perf_counter() - t0
        r2 = await e.step(f"<tool_call>{json.dumps(bash('ls minilib && pwd && echo $((6*7))'))}</tool_call>")
        r3 = await e.step(f"<tool_call>{json.dumps(SUBMIT)}</tool_call>")
        return r1, r2, r3, elapsed

    r1, r2, r3, elapsed = asyncio.run(go())
    assert not r1.done and elapsed < 10
    assert "start" in r1.observation[0]["content"] and "timed out after 1 s" in r1.observation[0]["content"]
    assert "never" not in r1.observation[0]["content"]
    assert r1.observation[1]["content"].startswith("error: read_file:") and "outside" in r1.observation[1]["content"]
    assert not r2.done and "roman.py" in r2.observation[0]["content"] and "42" in r2.observation[0]["content"]
    assert "[exit code 0]" in r2.observation[0]["content"]
    assert r3.done and r3.reward == 0.0 and r3.metrics["bad_arguments"] == 1.0
    assert not e.root.exists()  # the workspace is removed when the episode ends


def test_bash_is_sandboxed(env, tmp_path):
    e = env.make_env(env.tasks("train", n=1)[0])
    asyncio.run(e.initial_observation())
    probe = Path(f"/usr/flywheel-probe-{tmp_path.name}")
    try:
        connect = "python -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 2)' 2>&1 | tail -1"
        out = e.repo_tools.bash(f"touch {tmp_path}/escaped; mkdir {probe}; ls /root; {connect}")
        assert not (tmp_path / "escaped").exists() and not probe.exists()
    finally:
        if probe.exists():
            probe.rmdir()
    assert "No such file or directory" in out and "Read-only file system" in out
    assert "Network is unreachable" in out


def test_env_try_scores_one_via_cli(tmp_path):
    # the default instance set: synthesized from the bundled corpus on first use, then cached
    res = CliRunner().invoke(cli, ["env", "try", "code_repair", "-k", "2", "--set", f"cache_dir={tmp_path}"])
    assert res.exit_code == 0, res.output
    assert "mean reward 1.000 over 2 episodes" in res.output
    assert len(list((tmp_path / "code_repair").glob("minilib-*.jsonl"))) == 1  # the cache


def test_malformed_jsonl_errors_name_file_line_and_field(tmp_path, synth):
    good = json.loads(synth.read_text().splitlines()[0])
    cases = {
        "{not json": "invalid JSON",
        json.dumps({k: v for k, v in good.items() if k != "patch"}): "missing field 'patch'",
        json.dumps({**good, "FAIL_TO_PASS": 3}): "field 'FAIL_TO_PASS' must be a list of test ids",
        json.dumps({**good, "FAIL_TO_PASS": []}): "field 'FAIL_TO_PASS' is empty",
        json.dumps({**good, "PASS_TO_PASS": "not json"}): "'PASS_TO_PASS' is a string that is not a JSON list",
        json.dumps({**good, "repo": "no/such/dir"}): "repo 'no/such/dir' is neither a folder nor a bundled corpus",
        json.dumps({**good, "base_commit": 7}): "field 'base_commit' must be a string",
        json.dumps([1, 2]): "expected a JSON object",
    }
    for i, (line, message) in enumerate(cases.items()):
        path = tmp_path / f"bad{i}.jsonl"
        path.write_text(json.dumps(good) + "\n\n" + line + "\n")
        with pytest.raises(CodeRepairError) as e:
            read_instances(path)
        assert str(e.value).startswith(f"{path}:3: ") and message in str(e.value), str(e.value)
    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n")
    with pytest.raises(CodeRepairError, match="dup.jsonl:2: instance_id .* repeats line 1"):
        load(instances=str(dup))
    res = CliRunner().invoke(cli, ["env", "show", "code_repair", "--set", f"instances={tmp_path / 'bad1.jsonl'}"])
    assert res.exit_code == 2 and "bad1.jsonl:3: missing field 'patch'" in res.output


def test_patches_that_do_not_apply_are_clear_errors(tmp_path, synth):
    (tmp_path / "m.py").write_text("a = 1\nb = 2\n")
    with pytest.raises(PatchError, match=r"m.py: hunk 1 \(@@ -1,2\) does not apply"):
        apply_patch(tmp_path, make_diff("m.py", "a = 0\nb = 2\n", "a = 5\nb = 2\n"))
    with pytest.raises(PatchError, match="no file changes"):
        apply_patch(tmp_path, "just text")
    with pytest.raises(PatchError, match="unsafe path"):
        apply_patch(tmp_path, make_diff("../evil.py", None, "x\n"))
    assert (tmp_path / "m.py").read_text() == "a = 1\nb = 2\n"
    (tmp_path / "out").mkdir()
    (tmp_path / "out/t.py").write_text("a = 1\n")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws/link").symlink_to(tmp_path / "out")
    with pytest.raises(PatchError, match="through a symbolic link"):
        apply_patch(tmp_path / "ws", make_diff("link/t.py", "a = 1\n", "a = 2\n"))
    assert (tmp_path / "out/t.py").read_text() == "a = 1\n"
    # several files, a file without a final newline, creation, deletion, rename (git-style)
    (tmp_path / "ws/old.py").write_text("x = 1\ny = 2")
    (tmp_path / "ws/gone.py").write_text("bye\n")
    rename = "diff --git a/old.py b/new.py\nsimilarity index 50%\n" + make_diff("old.py", "x = 1\ny = 2", "x = 1\ny = 3\n")
    rename = rename.replace("--- a/old.py\n+++ b/old.py", "--- a/old.py\n+++ b/new.py")
    assert sorted(apply_patch(tmp_path / "ws", rename + make_diff("made.py", None, "hi\n")
                              + make_diff("gone.py", "bye\n", None))) == ["gone.py", "made.py", "new.py", "old.py"]
    assert sorted(p.name for p in (tmp_path / "ws").iterdir()) == ["link", "made.py", "new.py"]
    assert (tmp_path / "ws/new.py").read_text() == "x = 1\ny = 3\n" and (tmp_path / "ws/made.py").read_text() == "hi\n"
    # a broken test_patch and a broken bug_patch end the episode with reward 0 and a metric, not a crash
    rows = [json.loads(line) for line in synth.read_text().splitlines()[:2]]
    rows[0]["test_patch"] = make_diff("tests/test_roman.py", "nothing like this\n", "x\n")
    rows[1]["bug_patch"] = make_diff("minilib/roman.py", "nothing like this\n", "x\n")
    rows[0]["split"] = rows[1]["split"] = "test"
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = load(instances=str(bad))
    results = play(env, env.tasks("test"), env.scripted_policy())
    by_id = {r.task.id: r for r in results}
    r0, r1 = by_id[rows[0]["instance_id"]], by_id[rows[1]["instance_id"]]
    assert r0.error is None and r0.reward == 0.0 and r0.metrics["grading_error"] == 1.0
    assert r1.error is None and r1.reward == 0.0 and r1.metrics["setup_error"] == 1.0
    assert r1.metrics["tool_exceptions"] == 1.0  # the str_replace on the unprepared workspace
    e = env.make_env(next(t for t in env.tasks("test") if t.id == rows[1]["instance_id"]))
    step = asyncio.run(e.step("<tool_call>" + json.dumps(bash("ls")) + "</tool_call>"))
    assert not step.done and "could not be prepared" in step.observation[0]["content"]
    assert "bug_patch" in step.observation[0]["content"]
