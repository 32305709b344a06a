"""The calculator env: the safe evaluator, multi-turn scoring with the calc tool, metrics,
tool latency and seeded task generation."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from flywheel.envs import load_env
from flywheel.envs.calculator import SYSTEM, evaluate, final_number, load
from flywheel.rollout.play import play as play_episodes


def play(env, task, *turns):
    """Step through the given assistant turns; the last result."""
    async def go():
        e = env.make_env(task)
        result = None
        for text in turns:
            result = await e.step(text)
        return result
    return asyncio.run(go())


def calc_call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expression": expression}}) + "</tool_call>"


# ---------------------------------------------------------------- evaluator


@pytest.mark.parametrize("expression, value", [
    ("1234 * 5678", 7006652),
    ("(1234 * 567) + 89", 699767),
    ("2 ** 64", 18446744073709551616),
    ("123456789123456789 * 987654321987654321", 121932631356500531347203169112635269),  # exact big ints
    ("-3 + +4", 1), ("7 // 2", 3), ("-7 // 2", -4), ("7 % 3", 1), ("7 / 2", 3.5), ("1.5 * 2", 3.0),
    ("2 ** -1", 0.5), ("((((1))))", 1),
])
def test_evaluate_is_exact(expression, value):
    result = evaluate(expression)
    assert result == value and type(result) is type(value)


@pytest.mark.parametrize("expression, match", [
    ("x + 1", "unsupported element: Name"),
    ("abs(-1)", "unsupported element: Call"),
    ("__import__('os').system('true')", "unsupported element: Call"),
    ("(1).real", "unsupported element: Attribute"),
    ("[1, 2]", "unsupported element: List"),
    ("'a' * 3", "unsupported element: Constant"),
    ("True + 1", "unsupported element: Constant"),  # bools are not numbers here
    ("1 if 1 else 2", "unsupported element: IfExp"),
    ("1 << 1000", "unsupported element: BinOp"),
    ("9 ** 9 ** 9", "power too large"),
    ("2 ** 65", "power too large"),
    ("10000000 ** 2", "power too large"),
    ("1 / 0", "division by zero"), ("1 // 0", "division by zero"), ("5 % 0", "division by zero"),
    ("1 / (2 - 2)", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("import os", "not an arithmetic expression"),
    ("1" * 501, "longer than 500 characters"),
])
def test_evaluate_rejects_everything_else_with_value_error(expression, match):
    with pytest.raises(ValueError, match=match):
        evaluate(expression)


@pytest.mark.parametrize("expression", ["0 ** -1", "999999.0 ** 64"])
def test_evaluate_arithmetic_errors_are_value_errors(expression):
    with pytest.raises(ValueError):
        evaluate(expression)


@pytest.mark.parametrize("text, number", [
    ("The answer is 699767.", "699767"), ("699,767", "699767"), ("first 3 then -12", "-12"),
    ("3.5 exactly", "3.5"), ("no number", None), ("", None),
])
def test_final_number(text, number):
    assert final_number(text) == number


# ---------------------------------------------------------------- episodes


@pytest.fixture(scope="module")
def env():
    return load_env("calculator")


def test_scripted_policy_scores_one_on_twenty_tasks(env):
    tasks = env.tasks("test", n=20)
    results = asyncio.run(play_episodes(env, tasks, env.scripted_policy(), concurrency=8))
    assert [r.error for r in results] == [None] * 20
    assert [r.reward for r in results] == [1.0] * 20
    r = results[0]
    assert r.steps == 2 and [m["role"] for m in r.transcript] == ["system", "user", "assistant", "tool", "assistant"]
    assert r.transcript[3]["content"] == tasks[0].answer
    assert r.metrics["reward/used_tool"] == 1.0 and r.metrics["reward/answer_format"] == 1.0
    assert r.metrics["tool_calls"] == 1.0 and r.metrics["tool_errors"] == 0.0


def test_wrong_final_answer_scores_zero_and_metrics(env):
    task = env.tasks("test", n=1)[0]
    wrong = str(int(task.answer) + 1)
    result = play(env, task, calc_call(task.metadata["expression"]), f"The answer is {wrong}.")
    assert result.done and result.reward == 0.0
    assert (result.metrics["reward/correct"], result.metrics["reward/used_tool"],
            result.metrics["reward/answer_format"]) == (0.0, 1.0, 1.0)
    # right in its head, without the tool: correct, used_tool 0
    head = play(env, task, f"It is {int(task.answer):,}")
    assert head.reward == 1.0 and head.metrics["reward/used_tool"] == 0.0
    # no number at all: answer_format 0
    vague = play(env, task, "I cannot say.")
    assert vague.reward == 0.0 and vague.metrics["reward/answer_format"] == 0.0


def test_a_bad_expression_is_a_tool_error_the_model_can_recover_from(env):
    task = env.tasks("test", n=1)[0]
    e = env.make_env(task)
    first = asyncio.run(e.step(calc_call("import os")))
    assert not first.done and first.observation[0]["content"].startswith("error: calc: ValueError: not an arithmetic")
    last = asyncio.run(e.step(f"{task.answer}"))
    assert last.reward == 1.0 and last.metrics["tool_exceptions"] == 1.0


def test_max_turns_setting(env):
    short = load(max_turns=1)
    task = short.tasks("test", n=1)[0]
    result = play(short, task, calc_call("1 + 1"))
    assert result.done and result.reward == 0.0 and result.metrics["turns"] == 1.0


def test_tool_latency_makes_a_call_take_that_long():
    fast, slow = load(), load(tool_latency_s=0.05)
    task = slow.tasks("test", n=1)[0]
    timings = {}
    for name, e in (("fast", fast), ("slow", slow)):
        t0 = time.perf_counter()
        assert asyncio.run(e.calc.call({"expression": "6 * 7"})) == "42"
        timings[name] = time.perf_counter() - t0
    assert timings["slow"] >= 0.05 and timings["fast"] < timings["slow"]
    results = asyncio.run(play_episodes(slow, [task], slow.scripted_policy()))
    assert results[0].reward == 1.0 and results[0].step_latencies_s[0] >= 0.05
    assert slow.info()["tool_latency_s"] == 0.05


def test_tasks_are_seeded_and_train_differs_from_test(env):
    again = load()
    expressions = lambda e, split, **kw: [t.metadata["expression"] for t in e.tasks(split, **kw)]  # noqa: E731
    assert expressions(env, "test") == expressions(again, "test")
    assert len(env.tasks("test")) == 200 and len(env.tasks("train", n=50)) == 50
    train = {t.metadata["expression"] for t in env.tasks("train", n=1000)}
    test = {t.metadata["expression"] for t in env.tasks("test")}
    assert not train & test
    assert [t.id for t in env.tasks("train", n=3, seed=1)] != [t.id for t in env.tasks("train", n=3, seed=2)]
    for t in env.tasks("test", n=30):
        assert t.answer == str(evaluate(t.metadata["expression"]))
        assert t.prompt[-1]["content"] == f"What is {t.metadata['expression']}?"
        assert t.tools[0]["function"]["name"] == "calc"
    chained = {"(" in x or "-" in x for x in expressions(env, "test")}
    assert chained == {True, False}  # chain_prob=0.5 gives both kinds
    plain = load(chain_prob=0.0)
    assert all(len(t.metadata["expression"].split()) == 3 for t in plain.tasks("test", n=30))


def test_bare_prompt_and_max_digits():
    env = load(chain_prob=0.0, bare_prompt=True, max_digits=2)
    tasks = env.tasks("test", n=50)
    for t in tasks:
        assert t.prompt == [{"role": "user", "content": f"What is {t.metadata['expression']}?"}]
        assert t.tools == []
        a, b = (int(x) for x in t.metadata["expression"].split(" * "))
        assert 1 <= a < 100 and 1 <= b < 100
    assert any(int(x) >= 10 for t in tasks for x in t.metadata["expression"].split(" * "))
    # the tool still answers when it is not shown
    task = tasks[0]
    call = json.dumps({"name": "calc", "arguments": {"expression": task.metadata["expression"]}})
    env_ = env.make_env(task)
    first = asyncio.run(env_.step(f"<tool_call>\n{call}\n</tool_call>"))
    assert not first.done and first.observation[-1]["content"] == task.answer
    assert asyncio.run(env_.step(f"It is {task.answer}.")).reward == 1.0


def test_without_the_system_prompt_the_question_comes_alone_with_the_tools():
    """system_prompt=False: a client's `tools=` request; bare_prompt wins over it."""
    full, plain = load(chain_prob=0.0), load(chain_prob=0.0, system_prompt=False)
    for f, p in zip(full.tasks("test", n=5), plain.tasks("test", n=5)):
        assert f.prompt[0] == {"role": "system", "content": SYSTEM} and p.prompt == f.prompt[1:]
        assert p.tools == f.tools == [plain.calc.schema] == plain.info()["tools"]
    assert plain.info()["system_prompt"] is False
    bare = load(chain_prob=0.0, bare_prompt=True, system_prompt=False).tasks("test", n=1)[0]
    assert len(bare.prompt) == 1 and bare.tools == []


def test_operator_and_template_make_other_families():
    env = load(chain_prob=0.0, operator="-", template="What is {a} minus {b}?", max_digits=3)
    for t in env.tasks("test", n=30):
        a, b = (int(x) for x in t.metadata["expression"].split(" - "))
        assert t.prompt[-1]["content"] == f"What is {a} minus {b}?" and t.answer == str(a - b)
    default = load(chain_prob=0.0).tasks("test", n=5)
    assert all(t.prompt[-1]["content"] == f"What is {t.metadata['expression']}?" and " * " in t.prompt[-1]["content"]
               for t in default)


@pytest.mark.parametrize("kwargs", [{"tool_latency_s": -1}, {"chain_prob": 1.5}, {"max_turns": "x"},
                                    {"max_digits": 1}, {"bare_prompt": "yes"}, {"system_prompt": 0}, {"operator": "/"},
                                    {"template": "Compute {x}."}, {"template": "Add {a}."},
                                    {"template": "Multiply {a} by {b}.", "chain_prob": 0.5}])
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        load_env("calculator", **kwargs)
