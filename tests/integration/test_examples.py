"""The examples as docs/envs.md shows them: examples/custom_env.py (hand-worked episodes), how
the registry finds it (by import path from the current directory, which the `flywheel` console
script's own sys.path does not hold; by file path; errors that name what failed), `flywheel env
try` and `flywheel rl` on it by import path from the repository root, and
examples/minimal_grpo.py with its smallest settings."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.envs import load_env
from flywheel.envs.registry import EnvLoadError
from flywheel.models import TinySpec, build_tiny_model
from flywheel.rollout.play import play as play_episodes
from flywheel.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
FLYWHEEL = Path(sys.executable).with_name("flywheel")


@pytest.fixture
def repo_cwd_only(monkeypatch):
    """Run from the repository root with the root NOT on sys.path (as under the `flywheel`
    console script) and no example module imported yet."""
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != str(REPO)])
    for name in [m for m in sys.modules if m == "examples" or m.startswith("examples.")]:
        monkeypatch.delitem(sys.modules, name)


def test_import_path_resolves_from_the_current_directory(repo_cwd_only):
    env = load_env("examples.custom_env:load", max_turns=3)
    assert env.name == "inventory" and env.limits.max_turns == 3
    assert str(REPO) in [os.path.abspath(p or os.curdir) for p in sys.path]


def test_file_path_loads_the_same_environment(repo_cwd_only):
    env = load_env("examples/custom_env.py:load")
    again = load_env(str(REPO / "examples" / "custom_env.py") + ":load")
    assert env.name == "inventory" and type(env) is type(again)  # one module per file
    assert type(env).__module__ in sys.modules


@pytest.mark.parametrize("name, message", [
    ("examples.nope:load", r"cannot import 'examples.nope': No module named 'examples.nope' \(looked on sys.path "
                           r"and in the current directory .*'path/to/file.py:load'\)"),
    ("examples.custom_env:nope", r"'examples.custom_env' has no 'nope' \(its functions and classes: "
                                 r"InventoryEnvironment, .*load"),
    ("examples/nope.py:load", r"no file 'examples/nope.py' \(from "),
    ("examples/custom_env.py:nope", r"'examples/custom_env.py' has no 'nope'"),
    ("examples.custom_env", r"unknown environment 'examples.custom_env': .*'package.module:load' or by file "
                            r"'path/to/file.py:load'"),
])
def test_bad_names_are_errors_that_name_them(repo_cwd_only, name, message):
    with pytest.raises(EnvLoadError, match=message):
        load_env(name)


def test_a_missing_dependency_of_the_module_is_named_without_the_search_hint(repo_cwd_only, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "needs_dep.py").write_text("import flywheel_no_such_dependency\n")
    with pytest.raises(EnvLoadError, match=r"cannot import 'needs_dep': No module named "
                                           r"'flywheel_no_such_dependency'$"):
        load_env("needs_dep:load")


def test_cli_bad_import_path_exits_2_naming_it(repo_cwd_only):
    result = CliRunner().invoke(app, ["env", "try", "examples.custom_env:nope"])
    assert result.exit_code == 2
    assert result.stderr.startswith(
        "error: environment 'examples.custom_env:nope': 'examples.custom_env' has no 'nope'")


# ---------------------------------------------------------------- the example environment


def play(env, task, *turns: str):
    """Play scripted assistant turns; returns (StepResults, the env)."""
    episode = env.make_env(task)

    async def run():
        await episode.initial_observation()
        return [await episode.step(t) for t in turns]

    return asyncio.run(run()), episode


def call(name: str, **arguments) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


@pytest.fixture
def inventory(repo_cwd_only):
    return load_env("examples.custom_env:load")


def test_tasks_ask_about_items_whose_counts_only_the_tools_know(inventory):
    from examples.custom_env import INVENTORY

    train, test = inventory.tasks("train"), inventory.tasks("test")
    assert (len(train), len(test)) == (64, 16)
    assert not {t.metadata["sku"] for t in train} & {t.metadata["sku"] for t in test}
    task = test[0]
    units = INVENTORY[task.metadata["sku"]]["units"]
    assert task.answer == str(units["north"] + units["south"])
    assert task.prompt[-1]["content"] == f"How many units of {task.metadata['name']} are in stock?"
    assert [t["function"]["name"] for t in task.tools] == ["search", "stock"]
    assert task.tools[1]["function"]["parameters"]["properties"]["sku"]["description"].startswith("the item's SKU")
    bare = load_env("examples.custom_env:load", bare_prompt=True).tasks("test", n=1)[0]
    assert bare.tools == [] and [m["role"] for m in bare.prompt] == ["user"]


def test_a_solved_episode_scores_1_and_a_wrong_total_0(inventory):
    from examples.custom_env import INVENTORY

    task = inventory.tasks("test", n=1)[0]
    sku, total = task.metadata["sku"], int(task.answer)
    results, episode = play(inventory, task, call("search", query=task.metadata["name"]), call("stock", sku=sku),
                            f"{total} units.")
    assert [r.done for r in results] == [False, False, True]
    assert json.loads(results[0].observation[0]["content"]) == [{"sku": sku, "name": task.metadata["name"]}]
    assert json.loads(results[1].observation[0]["content"]) == INVENTORY[sku]["units"]
    assert results[-1].reward == 1.0 and results[-1].metrics["reward/used_tools"] == 1.0
    results, _ = play(inventory, task, call("stock", sku=sku), f"{total + 1} units.")
    assert results[-1].reward == 0.0 and results[-1].metrics["reward/used_tools"] == 0.0


def test_tool_errors_reach_the_model_and_are_counted(inventory):
    task = inventory.tasks("test", n=1)[0]
    results, _ = play(inventory, task, call("stock", sku="SKU-9"), call("stock", code=1), "no idea")
    assert results[0].observation[0]["content"] == (
        "error: stock: KeyError: \"no item with SKU 'SKU-9'; use search to find it\"")
    assert results[1].observation[0]["content"].startswith("error: stock: missing required argument 'sku'")
    m = results[-1].metrics
    assert (results[-1].reward, m["tool_exceptions"], m["bad_arguments"], m["tool_errors"]) == (0.0, 1.0, 1.0, 2.0)


def test_the_turn_limit_ends_the_episode(repo_cwd_only):
    env = load_env("examples.custom_env:load", max_turns=2)
    task = env.tasks("test", n=1)[0]
    results, _ = play(env, task, call("search", query="x"), call("search", query="y"))
    assert results[-1].done and results[-1].reward == 0.0 and results[-1].metrics["turns"] == 2.0


def test_the_scripted_policy_solves_every_test_task(inventory):
    policy = inventory.scripted_policy()

    async def all_tasks():
        return await play_episodes(inventory, inventory.tasks("test"), policy)

    results = asyncio.run(all_tasks())
    assert [r.reward for r in results] == [1.0] * 16 and all(r.steps == 3 for r in results)


# ---------------------------------------------------------------- the commands


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(argv, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", TinySpec(hidden=64, layers=2, heads=4, ffn=128))


def test_env_try_plays_the_custom_env_by_import_path():
    result = run([str(FLYWHEEL), "env", "try", "examples.custom_env:load", "-k", "2", "--set", "max_turns=3"])
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert len(re.findall(r"episode \d: task inventory-test-SKU-\d+  reward 1 ", out)) == 2
    assert out.count('{"name": "search", "arguments": {"query":') == 2  # the tool calls ...
    assert len(re.findall(r'tool: \{"north": \d+, "south": \d+\}', out)) == 2  # ... and the tool's answers
    assert "'reward/correct': 1.0, 'reward/used_tools': 1.0, 'tool_calls': 2.0" in out.replace("\n", "")
    assert out.rstrip().endswith("mean reward 1.000 over 2 episodes")


def test_env_try_with_a_bad_import_path_names_it():
    result = run([str(FLYWHEEL), "env", "try", "examples.custom_envs:load"])
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith("error: environment 'examples.custom_envs:load': cannot import "
                                    "'examples.custom_envs': No module named 'examples.custom_envs' (looked on ")


def test_rl_trains_on_the_custom_env_by_import_path(repo_cwd_only, tiny, tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, [
        "rl", "examples/custom_env_grpo.yaml", f"model={tiny}", f"output_dir={out}", "train.steps=2",
        "train.groups_per_step=1", "train.group_size=2", "sampling.max_tokens=8", "eval.tasks=2", "eval.pass_k=1",
        "env.settings.max_turns=2", "log.progress=false", "threads=1",
        "algo.dynamic_sampling=false"])  # every group trains: the untrained model's are all flat
    assert result.exit_code == 0, result.output
    assert result.stdout.rstrip().endswith(f"final model: {out / 'final'}")
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records if "reward_mean" in r] == [1, 2]
    evals = [r for r in records if "eval/greedy_accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert {"eval/reward/correct", "eval/reward/used_tools", "eval/tool_calls"} <= set(evals[0])  # the env's metrics
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert [len(r["rewards"][0]) for r in rollouts] == [2, 2]


PARITY_ENV = '''
from flywheel.envs.arithmetic import ArithmeticEnvironment
from flywheel.envs.rubric import RewardFn, Rubric


class Parity(ArithmeticEnvironment):
    """Reward 1 when the answer's first character has an odd code: about half of a random
    model's samples, so every group has something to learn from."""

    def __init__(self):
        super().__init__(digits=1)
        self.rubric = Rubric([RewardFn(lambda st: float(bool(st.final_text) and ord(st.final_text[0]) % 2 == 1),
                                       name="odd", inline=True)])


def load():
    return Parity()
'''

STEP_LINE = re.compile(r"step (\d): reward (\d\.\d{3})  grad_norm (\d+\.\d{4})  clip \d\.\d\d  \d+\.\d\d s")


def test_minimal_grpo_runs_and_updates_the_policy(tmp_path):
    (tmp_path / "parity_env.py").write_text(PARITY_ENV)
    result = run([sys.executable, "examples/minimal_grpo.py", "--env", f"{tmp_path / 'parity_env.py'}:load",
                  "--steps", "2", "--groups", "2", "--group-size", "4", "--max-tokens", "2", "--eval-tasks", "2",
                  "--threads", "1"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert re.fullmatch(r"held-out greedy success before: \d\.\d{3}", lines[0])
    steps = [STEP_LINE.fullmatch(line) for line in lines[1:3]]
    assert all(steps), lines
    assert [int(m.group(1)) for m in steps] == [1, 2]
    assert all(0 < float(m.group(2)) < 1 for m in steps)  # mixed rewards ...
    assert all(float(m.group(3)) > 0 for m in steps)  # ... give a gradient
    assert re.fullmatch(r"held-out greedy success after: \d\.\d{3}", lines[3]) and len(lines) == 4
