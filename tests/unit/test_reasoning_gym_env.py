"""The reasoning_gym environment: reasoning-gym datasets by name, exact vs native scoring."""

from __future__ import annotations

import asyncio

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.envs import load_env
from flywheel.envs.reasoning_gym import SYSTEM, exact_match, extract_answer, load
from flywheel.rollout.play import play

DATASETS = ["leg_counting", "basic_arithmetic", "letter_counting"]


def step(env, task, reply: str):
    return asyncio.run(env.make_env(task).step(reply))


@pytest.fixture(scope="module")
def legs():
    return load("leg_counting", size=100, test_size=20)


# ---------------------------------------------------------------- answer extraction and exact match


@pytest.mark.parametrize("text, expected", [
    ("<answer>42</answer>", "42"),
    ("think...\n<answer> 7 </answer>\nbye", "7"),
    ("<answer>1</answer> no wait <answer>2</answer>", "2"),  # the last tags win
    ("<answer>\nmulti\nline\n</answer>", "multi\nline"),
    ("some reasoning\n\n  12  \n\n", "12"),  # no tags: the last non-empty line
    ("<answer>3", "<answer>3"),  # an unclosed tag is not a tag pair
    ("", None),
    ("  \n \n", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("answer, gold, ok", [
    ("3", "3", True), ("3.0", "3", True), ("3", "3.00", True), ("+3", "3", True), ("-0", "0", True),
    ("1e2", "100", True), ("3.1", "3", False), ("-3", "3", False),
    ("106475279601", "106475279601", True), ("106475279602", "106475279601", False),  # exact big ints
    ("123456789012345678901", "123456789012345678900", False),  # equal as floats, not as numbers
    ("  Hello   World ", "hello world", True), ("noremopyh", "Noremopyh", True),
    ("3 apples", "3", False), ("500 or 502", "500", False), ("", "3", False), (None, "3", False),
    ("None", None, False),
])
def test_exact_match(answer, gold, ok):
    assert exact_match(answer, gold) is ok


# ---------------------------------------------------------------- datasets


@pytest.mark.parametrize("name", DATASETS)
def test_dataset_builds_chat_tasks_and_the_scripted_policy_scores_one(name):
    env = load_env("reasoning_gym", dataset=name, size=30, test_size=10)
    tasks = env.tasks("test")
    assert len(tasks) == 10
    t = tasks[0]
    assert t.prompt[0] == {"role": "system", "content": SYSTEM}
    assert t.prompt[1]["role"] == "user" and t.prompt[1]["content"] == t.metadata["entry"]["question"]
    assert isinstance(t.answer, str) and t.answer == str(t.metadata["entry"]["answer"])
    results = asyncio.run(play(env, tasks, env.scripted_policy(), concurrency=4))
    assert [r.error for r in results] == [None] * 10
    assert [r.reward for r in results] == [1.0] * 10
    assert all(r.metrics["reward/answer_format"] == 1.0 for r in results)
    assert results[0].transcript[-1] == {"role": "assistant", "content": f"<answer>{t.answer}</answer>"}


def test_wrong_answer_scores_zero_and_untagged_answer_still_counts_without_format(legs):
    t = legs.tasks("test")[0]
    wrong = step(legs, t, f"<answer>{int(t.answer) + 1}</answer>")
    assert wrong.done and wrong.reward == 0.0
    assert wrong.metrics == {"reward/correct": 0.0, "reward/answer_format": 1.0}
    untagged = step(legs, t, f"Let me count.\nThe total is\n{t.answer}.0")
    assert untagged.reward == 1.0 and untagged.metrics["reward/answer_format"] == 0.0


def test_settings_pass_through_to_reasoning_gym():
    env = load("basic_arithmetic", size=20, test_size=5, min_terms=2, max_terms=2, min_digits=1, max_digits=1,
               operators=["+"], allow_negation=False, allow_parentheses=False)
    for t in env.tasks("train"):
        q = t.prompt[1]["content"]
        assert q.startswith("Calculate ") and q.count("+") == 1, q
        a, b = q.removeprefix("Calculate ").rstrip(".").split(" + ")
        assert int(t.answer) == int(a) + int(b) and 0 <= int(a) <= 10 and 0 <= int(b) <= 10


def test_same_seed_reproduces_and_other_seed_differs():
    q = lambda env, split: [t.prompt[1]["content"] for t in env.tasks(split)]  # noqa: E731
    a, b, c = (load("leg_counting", size=20, test_size=5, seed=s) for s in (0, 0, 1))
    assert q(a, "train") == q(b, "train") and q(a, "test") == q(b, "test")
    assert q(a, "train") != q(c, "train")
    # `n` is a seeded choice from the split
    assert [t.id for t in a.tasks("train", n=5, seed=3)] == [t.id for t in b.tasks("train", n=5, seed=3)]
    assert len(a.tasks("train", n=5)) == 5 and len(a.tasks("train", n=500)) == 20


@pytest.mark.parametrize("name", DATASETS)
def test_train_and_test_are_disjoint(name):
    env = load(name, size=200, test_size=50)
    train, test = env.tasks("train"), env.tasks("test")
    assert len(train) == 200 and len(test) == 50
    train_q = {t.prompt[1]["content"] for t in train}
    assert not train_q & {t.prompt[1]["content"] for t in test}
    assert {t.split for t in train} == {"train"} and {t.split for t in test} == {"test"}


def test_test_items_repeating_train_are_dropped_in_a_small_task_space():
    # one-digit a + b: ~100 distinct questions, of which about a fifth are on the test side (envs/splits.py)
    env = load("basic_arithmetic", size=300, test_size=50, min_terms=2, max_terms=2, min_digits=1,
               max_digits=1, operators=["+"], allow_negation=False, allow_parentheses=False)
    train, test = env.splits()
    train_q = {t.prompt[1]["content"] for t in train}
    test_q = [t.prompt[1]["content"] for t in test]
    assert 0 < len(test) < 50  # generation found only a few distinct test questions
    assert not train_q & set(test_q) and len(set(test_q)) == len(test_q)
    assert env.info()["test_tasks"] == len(test)


def test_info_names_dataset_settings_split_sizes_and_scorer():
    info = load_env("reasoning_gym", dataset="letter_counting", size=30, test_size=10, min_words=2).info()
    assert info["name"] == "reasoning_gym"
    assert info["dataset"] == "letter_counting" and info["settings"] == {"min_words": 2}
    assert info["train_tasks"] == 30 and info["test_tasks"] == 10 and info["scorer"] == "exact"


# ---------------------------------------------------------------- exact vs native


def test_reasoning_gyms_default_scorer_pays_for_a_substring_hedge():
    """The reason exact is the default: reasoning-gym's base scorer gives len(gold)/len(reply)
    when the gold answer is anywhere inside the reply."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("leg_counting", seed=0, size=1)
    assert ds.score_answer("500 or 502", {"answer": "500"}) == pytest.approx(3 / 10)
    assert ds.score_answer("502 or 500", {"answer": "500"}) == pytest.approx(3 / 10)
    assert ds.score_answer("500", {"answer": "500"}) == 1.0


def test_substring_exploit_pays_under_native_and_not_under_exact():
    exact = load("leg_counting", size=20, test_size=20)
    native = load("leg_counting", size=20, test_size=20, scorer="native")
    tasks = native.tasks("test")
    assert [t.answer for t in tasks] == [t.answer for t in exact.tasks("test")]
    gold = tasks[0].answer
    hedge = f"<answer>{gold} or {int(gold) + 2}</answer>"
    expected = len(gold) / len(f"{gold} or {int(gold) + 2}")
    assert step(native, tasks[0], hedge).reward == pytest.approx(expected) and expected > 0.2
    assert step(exact, tasks[0], hedge).reward == 0.0
    # one fixed reply listing every count up to the largest gold answer earns on every task
    spray = "<answer>" + " ".join(str(i) for i in range(max(int(t.answer) for t in tasks) + 1)) + "</answer>"
    native_rewards = [step(native, t, spray).reward for t in tasks]
    assert all(r > 0 for r in native_rewards)
    assert all(step(exact, t, spray).reward == 0.0 for t in tasks)
    # committing to the right answer is still 1 under both
    assert step(native, tasks[0], f"<answer>{gold}</answer>").reward == 1.0


def test_native_uses_the_datasets_own_scorer():
    # chain_sum overrides score_answer: numeric comparison, so "3.0" style answers also pass
    env = load("chain_sum", size=10, test_size=5, scorer="native")
    t = env.tasks("test")[0]
    assert step(env, t, f"<answer>{t.answer}</answer>").reward == 1.0
    assert step(env, t, f"<answer>{int(t.answer) + 1}</answer>").reward == 0.0
    assert step(env, t, "no answer here").reward == 0.0


def test_native_scorer_failure_is_a_zero_not_a_crash(monkeypatch, legs):
    env = load("leg_counting", size=10, test_size=5, scorer="native")

    def broken(answer, entry):
        raise RuntimeError("scorer bug")

    monkeypatch.setattr(env._train_ds, "score_answer", broken)
    assert step(env, env.tasks("test")[0], "<answer>1</answer>").reward == 0.0


def test_datasets_without_a_single_gold_answer_need_native():
    with pytest.raises(ValueError, match="graph_color.*scorer=native"):
        load("graph_color", size=5, test_size=5)
    assert load("graph_color", size=5, test_size=5, scorer="native").info()["scorer"] == "native"


# ---------------------------------------------------------------- errors


def test_unknown_dataset_names_it_and_lists_valid_names():
    with pytest.raises(ValueError) as e:
        load_env("reasoning_gym", dataset="leg_countin")
    msg = str(e.value)
    assert "'leg_countin'" in msg and "leg_counting" in msg and "basic_arithmetic" in msg
    with pytest.raises(ValueError, match=r"'xyzzy'; valid names include leg_counting, basic_arithmetic"):
        load("xyzzy")


@pytest.mark.parametrize("kwargs, match", [
    ({"bogus": 1}, r"'leg_counting': unknown setting\(s\) bogus; its settings are min_animals"),
    ({"min_animals": 0}, r"'leg_counting': bad settings .*min_animals must be positive"),
    ({"min_animals": 5, "max_animals": 2}, r"'leg_counting': bad settings"),
    ({"scorer": "fuzzy"}, r"scorer must be one of exact, native"),
    ({"size": 0}, r"size and test_size must be >= 1"),
])
def test_bad_settings_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        load("leg_counting", **kwargs)


def test_cli_try_and_show_reasoning_gym():
    runner = CliRunner()
    result = runner.invoke(app, ["env", "try", "reasoning_gym", "-k", "2", "--set", "dataset=letter_counting",
                                 "--set", "size=20", "--set", "test_size=5"])
    assert result.exit_code == 0, result.output
    assert "mean reward 1.000 over 2 episodes" in result.stdout
    bad = runner.invoke(app, ["env", "show", "reasoning_gym", "--set", "dataset=nope"])
    assert bad.exit_code == 2 and "unknown reasoning-gym dataset 'nope'" in bad.stderr
