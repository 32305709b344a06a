"""The arithmetic env: its defaults are the shared `ab+cd=` task of
../shared/peers/trl_grpo_cpu/scripts/common.py, reproduced here independently."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys

import pytest

from flywheel.envs import load_env
from flywheel.envs.arithmetic import is_correct, load, reward, split_pairs
from flywheel.rollout.play import play


def peer_split():
    """The peer protocol written out: seed-1234 shuffle of all (a, b) pairs, first 200 held out."""
    pairs = [(a, b) for a in range(100) for b in range(100)]
    random.Random(1234).shuffle(pairs)
    return pairs[200:], pairs[:200]


def step(env, task, completion):
    return asyncio.run(env.make_env(task).step(completion))


@pytest.fixture(scope="module")
def env():
    return load_env("arithmetic")


def test_defaults_are_the_shared_task(env):
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (9800, 200)
    assert (test[0].prompt, test[0].answer) == ("13+54=", "67")
    peer_train, peer_test = peer_split()
    assert split_pairs() == (peer_train, peer_test)
    assert [t.prompt for t in test] == [f"{a:02d}+{b:02d}=" for a, b in peer_test]
    assert [t.prompt for t in train] == [f"{a:02d}+{b:02d}=" for a, b in peer_train]
    assert all(t.answer == str(a + b) for t, (a, b) in zip(train, peer_train))
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    assert isinstance(test[0].prompt, str)  # raw completion, no chat template
    assert env.info()["train_tasks"] == 9800 and env.info()["test_tasks"] == 200 and env.shared


def test_n_is_a_seeded_choice_from_the_split(env):
    a, b = env.tasks("test", n=5, seed=7), env.tasks("test", n=5, seed=7)
    assert [t.id for t in a] == [t.id for t in b] and len(a) == 5
    assert [t.id for t in a] != [t.id for t in env.tasks("test", n=5, seed=8)]
    assert {t.prompt for t in a} <= {t.prompt for t in env.tasks("test")}
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        env.tasks("dev")


@pytest.mark.parametrize("completion, ok", [
    ("67", True), (" 67", True), ("\n67", True), ("67\n", True), ("67abc", True), ("67 + 1", True),
    ("670", False), ("6 7", False), ("x67", False), ("", False), ("sixty-seven", False), ("-67", False),
    ("066", False), ("68", False),
])
def test_reward_is_the_peers_leading_number(env, completion, ok):
    task = env.tasks("test")[0]
    assert is_correct(completion, "67") is ok and reward(completion, "67") == float(ok)
    result = step(env, task, completion)
    assert result.done and result.reward == float(ok) and result.metrics == {"reward/correct": float(ok)}


def test_scripted_policy_scores_one(env):
    tasks = env.tasks("test", n=20)
    results = asyncio.run(play(env, tasks, env.scripted_policy()))
    assert [r.reward for r in results] == [1.0] * 20
    assert results[0].transcript == tasks[0].prompt + tasks[0].answer


@pytest.mark.parametrize("operators, digits", [("-", 2), ("*", 1), ("+-*", 3)])
def test_other_operators_and_digits(operators, digits):
    env = load(operators=operators, digits=digits)
    assert not env.shared
    train, test = env.tasks("train"), env.tasks("test")
    assert train and test and not {t.prompt for t in train} & {t.prompt for t in test}
    for t in test[:50] + train[:50]:
        a, op, b = t.prompt[:digits], t.prompt[digits], t.prompt[digits + 1:-1]
        assert op in operators and len(a) == len(b) == digits and t.prompt.endswith("=")
        assert int(t.answer) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert [t.prompt for t in load(operators=operators, digits=digits).tasks("test")] == [t.prompt for t in test]


def test_subtraction_rewards_negative_answers():
    env = load(operators="-", digits=1)
    task = next(t for t in env.tasks("train") if t.answer.startswith("-"))
    assert step(env, task, task.answer).reward == 1.0
    assert step(env, task, task.answer.lstrip("-")).reward == 0.0


def test_small_spaces_hold_out_about_a_fifth():
    """By hash (envs/splits.py): 13 of the 100 one-digit sums, every problem on one side."""
    env = load(operators="+", digits=1)  # 100 problems
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (87, 13)
    assert len({t.prompt for t in train + test}) == 100


@pytest.mark.parametrize("kwargs, match", [
    ({"operators": "/"}, "operators must be a non-empty string of"),
    ({"operators": ""}, "operators must be a non-empty string of"),
    ({"operators": "+x"}, "got '\\+x'"),
    ({"digits": 0}, "digits must be between 1 and 6, got 0"),
    ({"digits": 7}, "digits must be between 1 and 6, got 7"),
    ({"digits": "two"}, "invalid literal for int"),
])
def test_bad_settings_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load_env("arithmetic", **kwargs)


def test_repeated_operators_do_not_hang():
    code = ("from flywheel.envs.arithmetic import load\n"
            "try:\n    env = load(operators='++', digits=1); print(len(env.tasks('train')) + len(env.tasks('test')))\n"
            "except ValueError as e:\n    print('ValueError')\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=2).stdout
    except subprocess.TimeoutExpired:
        pytest.fail("load(operators='++', digits=1) hangs")
    assert out.strip() in ("100", "ValueError")
