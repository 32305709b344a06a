"""The SWE harness and the `swe` environment on a small project made here (a folder source with
two modules and a pytest suite): gold resolves, the empty patch and test edits do not, a patch
that does not apply is named, workspaces are hard links that never touch the base, the bash
agent's episodes are graded from the workspace's diff, and `flywheel swe import` finds git
repositories on disk. The shipped real-project instances are validated in the slow tier
(test_swe_projects.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app as cli
from flywheel.envs.base import Policy
from flywheel.envs.patches import make_diff
from flywheel.envs.swe.env import SUBMIT, SWEEnvironment, bash_applying
from flywheel.envs.swe.harness import evaluate, validate
from flywheel.envs.swe.importer import import_instances
from flywheel.envs.swe.instance import SWEFormatError, Source, SWEInstance, write_instances
from flywheel.envs.swe.prepared import prepare_env
from flywheel.envs.swe.sources import SourceError
from flywheel.envs.swe.workspace import diff_against_base, instance_base, new_workspace
from flywheel.envs.tool_env import ToolLimits
from flywheel.rollout.play import play as play_episodes

sandbox = pytest.importorskip("flywheel.sandbox")
if not sandbox.sandbox_available():
    pytest.skip("bubblewrap sandbox not available", allow_module_level=True)

CALC = '''def add(a, b):
    return a + b


def clamp(x, lo, hi):
    return max(lo, min(x, hi))
'''
WORDS = '''def shout(s):
    return s.upper() + "!"
'''
TESTS = '''from mini.calc import add, clamp
from mini.words import shout


def test_add():
    assert add(2, 3) == 5


def test_add_negative():
    assert add(-2, 1) == -1


def test_clamp():
    assert clamp(5, 0, 3) == 3


def test_shout():
    assert shout("hi") == "HI!"
'''


def make_project(root: Path) -> Path:
    (root / "mini").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "mini" / "__init__.py").write_text("")
    (root / "mini" / "calc.py").write_text(CALC)
    (root / "mini" / "words.py").write_text(WORDS)
    (root / "tests" / "test_mini.py").write_text(TESTS)
    return root


def instance(root: Path, iid: str = "mini__add__binop__1") -> SWEInstance:
    buggy = CALC.replace("return a + b", "return a - b")
    return SWEInstance(
        instance_id=iid, repo="local/mini", base_commit="folder", problem_statement="add() subtracts",
        patch=make_diff("mini/calc.py", buggy, CALC), test_patch="",
        FAIL_TO_PASS=["tests/test_mini.py::test_add", "tests/test_mini.py::test_add_negative"],
        PASS_TO_PASS=["tests/test_mini.py::test_clamp", "tests/test_mini.py::test_shout"], version="0.1",
        source=Source(kind="folder", path=str(root)), bug_patch=make_diff("mini/calc.py", CALC, buggy))


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("swe") / "mini")
    inst = instance(root)
    try:
        prepare_env(inst.environment, inst.env_key)
    except SourceError as e:  # pytest comes from the package index the first time
        pytest.skip(f"the test environment could not be prepared (package index unreachable?): {e}")
    return root, inst


def tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


def test_gold_resolves_and_the_empty_patch_does_not(project):
    _, inst = project
    gold = evaluate(inst, inst.patch)
    assert gold.resolved, gold.row()
    assert set(gold.fail_to_pass.values()) == {"passed"} and set(gold.pass_to_pass.values()) == {"passed"}
    empty = evaluate(inst, "")
    assert not empty.resolved and empty.fail_to_pass == {n: "failed" for n in inst.FAIL_TO_PASS}
    checked = validate([inst], log=lambda m: None)
    assert checked.last_line(1).startswith("swe_validate: instances=1 repos=1 gold_resolved=1.00 empty_resolved=0.00")


def test_editing_the_tests_or_breaking_others_resolves_nothing(project):
    _, inst = project
    cheat = make_diff("tests/test_mini.py", TESTS, TESTS.replace("== 5", "== -1").replace("== -1\n\n\ndef test_c",
                                                                                            "== -3\n\n\ndef test_c"))
    assert not evaluate(inst, cheat).resolved  # test paths are put back before the tests run
    buggy = CALC.replace("return a + b", "return a - b")
    breaks_clamp = make_diff("mini/calc.py", buggy, CALC.replace("max(lo, min(x, hi))", "max(lo, x)"))
    ev = evaluate(inst, breaks_clamp)
    assert not ev.resolved and ev.fail_to_pass == {n: "passed" for n in inst.FAIL_TO_PASS}
    assert ev.pass_to_pass["tests/test_mini.py::test_clamp"] == "failed"


def test_a_patch_that_does_not_apply_is_named(project):
    _, inst = project
    wrong = make_diff("mini/calc.py", CALC.replace("a + b", "a * b"), CALC)
    ev = evaluate(inst, wrong)
    assert not ev.resolved and ev.error.startswith("patch does not apply: mini/calc.py: hunk 1")


def test_workspaces_link_to_the_base_and_never_change_it(project):
    root, inst = project
    base = instance_base(inst)
    before, source_before = tree_digest(base), tree_digest(root)
    ws = new_workspace(base)
    try:
        assert os.stat(ws / "mini" / "words.py").st_ino == os.stat(base / "mini" / "words.py").st_ino
        assert diff_against_base(ws, base) == ""
        box = sandbox.Sandbox()
        res = box.run(["bash", "-c", "sed -i 's/upper()/lower()/' mini/words.py && echo x >> mini/calc.py && "
                                     "rm mini/__init__.py && echo new > notes.txt"], workspace=str(ws))
        assert res.returncode == 0, res
        diff = diff_against_base(ws, base)
        assert "mini/words.py" in diff and "+    return s.lower()" in diff and "notes.txt" in diff
        assert "deleted file mode" in diff and "+x" in diff
    finally:
        import shutil

        shutil.rmtree(ws)
    for patch in (inst.patch, diff):
        evaluate(inst, patch)
    assert tree_digest(base) == before and tree_digest(root) == source_before


class Commands(Policy):
    """Runs the given bash commands, one per turn, then submits."""

    def __init__(self, commands):
        self.commands = commands

    async def act(self, task, history, tools, episode=0):
        i = sum(1 for m in history if m.get("role") == "assistant")
        command = self.commands(task)[i] if i < len(self.commands(task)) else SUBMIT
        return f"<tool_call>{json.dumps({'name': 'bash', 'arguments': {'command': command}})}</tool_call>"


def play(env, tasks, policy):
    return asyncio.run(play_episodes(env, tasks, policy, concurrency=2, timeout_s=120))


@pytest.fixture(scope="module")
def env(project):
    _, inst = project
    other = instance(project[0], "mini__add__binop__2")
    other.problem_statement = "add() is wrong"  # a second problem, so the hash split has both sides
    return SWEEnvironment([inst, other], "test", ToolLimits(max_turns=6, max_tool_calls_per_turn=1,
                                                             max_observation_tokens=2048, episode_timeout_s=120))


def test_the_scripted_agent_resolves_through_bash_and_a_noop_does_not(env):
    tasks = [t for s in ("train", "test") for t in _tasks_or_none(env, s)]
    (gold,) = play(env, tasks[:1], env.scripted_policy())
    assert gold.reward == 1.0 and gold.metrics["reward/resolved"] == 1.0, gold
    (noop,) = play(env, tasks[:1], Commands(lambda t: ["ls -R", "python -m pytest -q -p no:cacheprovider tests"]))
    assert noop.reward == 0.0 and noop.metrics["reward/fail_to_pass"] == 0.0 and noop.metrics["reward/pass_to_pass"] == 1.0
    (fix,) = play(env, tasks[:1], Commands(lambda t: ["sed -i 's/a - b/a + b/' mini/calc.py"]))
    assert fix.reward == 1.0


def _tasks_or_none(env, split):
    try:
        return env.tasks(split)
    except SWEFormatError:
        return []


def test_bash_applying_survives_a_patch_holding_its_marker():
    patch = "diff --git a/x b/x\n+FLYWHEEL_PATCH_END\n"
    command = bash_applying(patch)
    assert command.splitlines()[-1] == "FLYWHEEL_PATCH_END_" and patch.rstrip() in command


def test_import_finds_git_repositories_and_names_bad_fields(tmp_path):
    repos = tmp_path / "repos"
    repo = make_project(repos / "local__mini")
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "base"], check=True)
    commit = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    row = {k: v for k, v in instance(repo).row().items() if k not in ("source", "environment")}
    row["base_commit"] = commit
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps(row) + "\n")
    (got,) = import_instances(rows, repos)
    assert got.source == Source(kind="git", path=str(repo.resolve())) and got.base_commit == commit
    out = tmp_path / "imported.jsonl"
    result = CliRunner().invoke(cli, ["swe", "import", str(rows), "--repos", str(repos), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["source"]["kind"] == "git"
    rows.write_text(json.dumps({**row, "base_commit": "0" * 40}) + "\n")
    with pytest.raises(SWEFormatError, match=r"rows.jsonl:1: field 'base_commit': '0+' is not a commit"):
        import_instances(rows, repos)
    rows.write_text(json.dumps({**row, "repo": "someone/else"}) + "\n")
    result = CliRunner().invoke(cli, ["swe", "import", str(rows), "--repos", str(repos)])
    assert result.exit_code == 2 and "rows.jsonl:1: field 'repo': no git repository for 'someone/else'" in \
        result.output.replace("\n", " ")


def test_evaluate_scores_a_predictions_file(project, tmp_path):
    _, inst = project
    tasks = tmp_path / "tasks.jsonl"
    write_instances(tasks, [inst])
    preds = tmp_path / "preds.jsonl"
    preds.write_text(json.dumps({"instance_id": inst.instance_id, "model_patch": inst.patch,
                                 "model_name_or_path": "gold"}) + "\n")
    report = tmp_path / "report.json"
    result = CliRunner().invoke(cli, ["swe", "evaluate", str(preds), "--tasks", str(tasks), "--report", str(report)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1] == "swe_evaluate: predictions=1 resolved=1 resolved_pct=100.00"
    assert json.loads(report.read_text())["resolved_ids"] == [inst.instance_id]
    preds.write_text(json.dumps({"instance_id": "nope", "model_patch": ""}) + "\n")
    result = CliRunner().invoke(cli, ["swe", "evaluate", str(preds), "--tasks", str(tasks)])
    assert result.exit_code == 2 and "'nope' is not among the 1 instances" in result.output


@pytest.mark.slow  # the whole flow end to end: make test-all
def test_flywheel_rl_trains_on_swe_and_evaluates_pass_at_k(project, tmp_path):
    """One RL step on the swe environment (a tiny random model: it earns no reward, the test
    is the machinery: episodes in the sandbox, graded by the harness, pass@k evaluated)."""
    from flywheel.config import RLConfig, validate as validate_config
    from flywheel.models import TinySpec, build_tiny_model
    from flywheel.train.metrics import read_metrics
    from flywheel.train.rl import run_rl

    root, inst = project
    tasks = tmp_path / "tasks.jsonl"
    other = instance(root, "mini__add__binop__3")
    other.split, inst_train = "test", instance(root, "mini__add__binop__4")
    inst_train.problem_statement, inst_train.split = "add() subtracts its arguments", "train"
    write_instances(tasks, [inst_train, other])
    model = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    cfg = validate_config(dict(model=str(model), output_dir=str(tmp_path / "run"),
                               env={"name": "swe", "settings": {"instances": str(tasks), "max_turns": 2}},
                               train={"steps": 1, "groups_per_step": 1, "group_size": 2},
                               sampling={"max_tokens": 8}, eval={"tasks": 1, "pass_k": 2}, checkpoint={"every": 0},
                               log={"progress": False}, threads=1, algo={"dynamic_sampling": False}), RLConfig)
    result = run_rl(cfg, log=lambda m: None)
    assert result.steps == 1
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in rows if "eval/greedy_accuracy" in r]
    assert len(evals) == 2 and all(r["eval/greedy_accuracy"] == 0.0 for r in evals)
    assert any(k.startswith("eval/pass@") for k in evals[-1]), evals[-1]
    assert [r["reward_mean"] for r in rows if "reward_mean" in r] == [0.0]


def test_a_failed_agent_trace_with_a_swe_verifier_is_curated_and_replayed(project, tmp_path):
    """The loop's path: feedback on a production trace names the `swe` verifier (the task
    `flywheel env show swe` prints); curation makes it an RL task and the replay grades it with
    the harness (the scripted bash agent resolves it)."""
    from datetime import datetime, timezone

    from flywheel.envs.replay import ReplayEnvironment
    from flywheel.loop.curation import curate
    from flywheel.loop.curation_rules import CurationConfig
    from flywheel.loop.feedback_check import check_feedback
    from flywheel.traces.results import StoredFeedback, StoredTrace, StoredVerifier

    inst = dataclasses.replace(project[1], split="test")
    tasks = tmp_path / "tasks.jsonl"
    write_instances(tasks, [inst])
    shown = CliRunner().invoke(cli, ["env", "show", "swe", "--set", f"instances={tasks}"])
    assert shown.exit_code == 0, shown.output
    verifier = json.loads(shown.stdout.split("example verifier:\n", 1)[1])
    assert verifier["env"] == "swe" and verifier["task"]["metadata"]["instance"]["instance_id"] == inst.instance_id
    check_feedback({"score": 0.0, "verifier": verifier}, CurationConfig())
    question = SWEEnvironment([inst]).tasks("test")[0]
    now = datetime.now(timezone.utc)
    trace = StoredTrace(id="trace-1", seq=1, idempotency_key="k", created_at=now, source="serve",
                        messages=question.prompt, tools=question.tools,
                        response={"role": "assistant", "content": "I could not fix it."},
                        feedback=[StoredFeedback(id="f", trace_id="trace-1", created_at=now, score=0.0,
                                                 verifier=StoredVerifier("swe", verifier["task"]))])
    (item,) = curate([trace], cfg=CurationConfig(heldout_fraction=0.0, min_heldout=0)).rl.train
    replay = ReplayEnvironment([item.row])
    results = asyncio.run(play_episodes(replay, replay.tasks("train"), replay.scripted_policy(), timeout_s=120))
    assert [r.reward for r in results] == [1.0]


def test_swe_is_accepted_as_a_fine_tuning_environment_grader(project, tmp_path):
    """A reinforcement job may name `swe` as its grader (flywheel_environment); a bad setting is
    a 400 naming the field."""
    from flywheel.errors import OpenAIError
    from flywheel.finetuning.fine_tuning import ENV_GRADER, check_environment

    tasks = tmp_path / "tasks.jsonl"
    write_instances(tasks, [project[1]])
    check_environment({"type": ENV_GRADER, "env": "swe", "settings": {"instances": str(tasks)}}, "grader")
    with pytest.raises(OpenAIError, match=r"grader.env: 'swe' does not load: SWEFormatError: projects: unknown"):
        check_environment({"type": ENV_GRADER, "env": "swe", "settings": {"projects": "nope"}}, "grader")
