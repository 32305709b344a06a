"""`flywheel env show NAME` prints the verifier task shape of NAME: the fields a client sends as
feedback `verifier: {"env": NAME, "task": {...}}`, which are required, what `answer` is for
NAME, and one real task as an example that the feedback check accepts and NAME replays."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.envs import load_env
from flywheel.envs.patches import make_diff
from flywheel.envs.replay import ReplayEnvironment, task_from_dict
from flywheel.envs.repo import CORPORA, Instance, write_instances
from flywheel.loop.curation import curate
from flywheel.loop.curation_rules import CurationConfig
from flywheel.loop.feedback_check import FeedbackRefused, check_feedback
from flywheel.rollout.play import play
from flywheel.traces.results import StoredFeedback, StoredTrace, StoredVerifier


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def instances(tmp_path_factory):
    """One code_repair instance on the bundled minilib corpus (count_vowels misses o and u)."""
    text = (CORPORA / "minilib/minilib/text.py").read_text()
    buggy = text.replace("if c in VOWELS)", 'if c in "aei")')
    assert buggy != text
    inst = Instance(instance_id="vowels", repo="minilib", base_commit="", problem_statement="count_vowels misses o, u",
                    patch=make_diff("minilib/text.py", buggy, text), test_patch="",
                    FAIL_TO_PASS=["tests/test_text.py::test_count_vowels"], PASS_TO_PASS=[],
                    bug_patch=make_diff("minilib/text.py", text, buggy))
    path = tmp_path_factory.mktemp("cr") / "instances.jsonl"
    write_instances(path, [inst])
    return path


def shown(runner, *args) -> tuple[dict[str, tuple[bool, str]], list[str], dict]:
    """(field -> (required, text), notes, example verifier) from `flywheel env show ARGS`."""
    result = runner.invoke(app, ["env", "show", *args])
    assert result.exit_code == 0, result.output
    _, shape = result.stdout.split("verifier task:", 1)
    lines, example = shape.split("example verifier:\n")
    fields, notes = {}, []
    for line in lines.splitlines()[1:]:
        if line.startswith("note: "):
            notes.append(line)
            continue
        name, need, text = line.split(maxsplit=2)
        fields[name] = (need == "required", text)
    return fields, notes, json.loads(example)


@pytest.mark.parametrize("name", ["calculator", "arithmetic"])
def test_the_example_verifier_is_accepted_and_replayed_by_its_environment(runner, name):
    fields, notes, verifier = shown(runner, name)
    assert [k for k, (required, _) in fields.items() if required] == ["answer"]
    assert set(fields) == {"prompt", "answer", "id", "tools", "metadata", "split"} and not notes
    assert "JSON string" in fields["answer"][1]  # this env's own answer, not the generic text
    assert "as it was served" in fields["prompt"][1] and "prompt" not in verifier["task"]
    assert verifier["env"] == name and isinstance(verifier["task"]["answer"], str)
    check_feedback({"label": "wrong", "verifier": verifier}, CurationConfig())
    # a failed trace of the env's question with this verifier: curated, its RL task is the trace
    # as served, and the env's scripted policy scores 1 on its replay
    question = load_env(name).tasks("test", n=1)[0]
    sent = {"prompt": question.prompt} if isinstance(question.prompt, str) else {"messages": question.prompt}
    trace = StoredTrace(id="trace-1", seq=1, idempotency_key="k", created_at=datetime.now(timezone.utc),
                        source="serve", **{"messages": [], **sent}, tools=question.tools,
                        response={"role": "assistant", "content": "0"},
                        feedback=[StoredFeedback(id="f", trace_id="trace-1", created_at=datetime.now(timezone.utc),
                                                 score=0.0, verifier=StoredVerifier(name, verifier["task"]))])
    (item,) = curate([trace], cfg=CurationConfig(heldout_fraction=0.0, min_heldout=0)).rl.train
    assert item.row["task"]["prompt"] == question.prompt
    replay = ReplayEnvironment([item.row])
    results = asyncio.run(play(replay, replay.tasks("train"), replay.scripted_policy()))
    assert [r.reward for r in results] == [1.0]


def test_a_verifier_without_a_required_field_is_refused(runner):
    fields, _, verifier = shown(runner, "calculator")
    for name, (required, _) in fields.items():
        if required:
            task = {k: v for k, v in verifier["task"].items() if k != name}
            with pytest.raises(FeedbackRefused):
                check_feedback({"verifier": {"env": "calculator", "task": task}}, CurationConfig())


def test_code_repair_requires_the_instance_in_metadata(runner, instances):
    fields, notes, verifier = shown(runner, "code_repair", "--set", f"instances={instances}")
    assert fields["metadata"][0] and "instance" in fields["metadata"][1] and "unified diff" in fields["answer"][1]
    assert notes == ["note: a verifier names no settings: it is replayed with this environment's defaults"]
    task = verifier["task"]
    assert task["metadata"]["instance"]["instance_id"] == "vowels" and task["answer"].startswith("diff --git a/minilib/text.py")
    task_from_dict(task, default_id="trace-1", default_prompt="(the trace's prompt)")
    check_feedback({"score": 0.0, "verifier": verifier}, CurationConfig())


def test_an_environment_by_import_path_is_shown_with_the_config_it_needs(runner):
    fields, notes, verifier = shown(runner, "examples.custom_env:load")
    assert fields["answer"][0] and verifier["env"] == "examples.custom_env:load"
    assert notes == ["note: not a built-in: a loop replays it only if its config lists 'examples.custom_env:load' "
                     "in curation.environments"]
    check_feedback({"label": "bad", "verifier": verifier}, CurationConfig(environments=["examples.custom_env:load"]))
