"""The Env API pieces: tool schemas and calls, Hermes parsing, rubrics, ToolEnv, the runner,
the registry and `flywheel env`. Everything is hand-worked; slow paths use tiny limits."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from typing import Literal, Optional

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.envs import Environment, Rubric, Tool, ToolError, list_envs, load_env, tool
from flywheel.models.tool_calls import HermesParser
from flywheel.envs.base import Policy
from flywheel.envs.registry import EnvLoadError
from flywheel.envs.rubric import EpisodeState, RewardFn
from flywheel.envs.tool_env import EpisodeFinished, SingleTurnEnv, ToolEnv, ToolLimits
from flywheel.envs.tools import schema_from_signature, validate_arguments
from flywheel.rollout.play import play
from flywheel.types import Task, ToolCall


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- tool schemas


def search(query: str, limit: int = 5, scale: float = 1.0, exact: bool = False, ids: list[int] | None = None,
           mode: Literal["fast", "slow"] = "fast", note: Optional[str] = None, tags: list = []) -> str:  # noqa: B006
    """Search the index
    for documents.

    Longer explanation that is not part of the description.

    Args:
        query: what to look for,
            continued on a second line.
        limit (int): how many results.
        mode: how hard to try.

    Returns:
        matching documents.
    """
    return f"{query}:{limit}"


def test_schema_from_signature_and_google_docstring():
    t = Tool.from_function(search)
    assert t.name == "search" and t.description == "Search the index for documents."
    assert t.parameters == {
        "type": "object",
        "properties": {
            "query": {"type": "string", "description": "what to look for, continued on a second line."},
            "limit": {"type": "integer", "description": "how many results.", "default": 5},
            "scale": {"type": "number", "default": 1.0},
            "exact": {"type": "boolean", "default": False},
            "ids": {"type": "array", "items": {"type": "integer"}, "nullable": True, "default": None},
            "mode": {"enum": ["fast", "slow"], "description": "how hard to try.", "default": "fast"},
            "note": {"type": "string", "nullable": True, "default": None},
            "tags": {"type": "array", "default": []},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    assert t.schema == {"type": "function", "function": {"name": "search", "description": t.description,
                                                         "parameters": t.parameters}}


def test_schema_edge_cases():
    def no_args() -> str:
        return "x"

    def untyped(a, b: dict, c: int | str):
        """No args section."""

    assert schema_from_signature(no_args) == {"type": "object", "properties": {}, "additionalProperties": False}
    s = Tool.from_function(untyped).parameters
    assert s["properties"] == {"a": {"type": "string"}, "b": {"type": "object"},
                               "c": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}
    assert s["required"] == ["a", "b", "c"]
    assert Tool.from_function(no_args, name="other", description="given").schema["function"]["description"] == "given"

    def star(*args):
        pass

    with pytest.raises(TypeError, match=r"\*args / \*\*kwargs"):
        Tool.from_function(star)


@pytest.mark.parametrize("arguments, problems", [
    ({"query": "q"}, []),
    ({"query": "q", "scale": 2, "ids": [1, 2], "note": None, "mode": "slow"}, []),  # int is a number; null ok
    ({}, ["missing required argument 'query'"]),
    ({"query": "q", "bogus": 1},
     ["unknown argument 'bogus' (expected: query, limit, scale, exact, ids, mode, note, tags)"]),
    ({"query": "q", "limit": "5"}, ["argument 'limit': must be integer, got str '5'"]),
    ({"query": "q", "limit": True}, ["argument 'limit': must be integer, got bool True"]),  # bool is not int
    ({"query": "q", "scale": False}, ["argument 'scale': must be number, got bool False"]),
    ({"query": "q", "limit": 2.5}, ["argument 'limit': must be integer, got float 2.5"]),
    ({"query": "q", "exact": 1}, ["argument 'exact': must be boolean, got int 1"]),
    ({"query": "q", "ids": [1, "x"]}, ["argument 'ids': item 1 must be integer, got str 'x'"]),
    ({"query": "q", "ids": 3}, ["argument 'ids': must be array, got int 3"]),
    ({"query": "q", "mode": "medium"}, ["argument 'mode': must be one of ['fast', 'slow'], got 'medium'"]),
    ({"query": None}, ["argument 'query': must not be null"]),
    ({"query": "x" * 50, "limit": "y" * 50},
     [f"argument 'limit': must be integer, got str {repr('y' * 50)[:40]}..."]),
    ({"limit": "5", "zzz": 0},
     ["missing required argument 'query'", "argument 'limit': must be integer, got str '5'",
      "unknown argument 'zzz' (expected: query, limit, scale, exact, ids, mode, note, tags)"]),
])
def test_validate_arguments_messages(arguments, problems):
    assert validate_arguments(Tool.from_function(search).parameters, arguments) == problems


def test_bad_arguments_raise_tool_error_and_never_call_the_function():
    called = []

    def f(x: int) -> str:
        called.append(x)
        return "ok"

    with pytest.raises(ToolError) as e:
        run(Tool.from_function(f).call({"x": "1", "y": 2}))
    assert e.value.kind == "bad_arguments"
    assert str(e.value) == "f: argument 'x': must be integer, got str '1'; unknown argument 'y' (expected: x)"
    assert called == []


# ---------------------------------------------------------------- tool calls


def test_sync_tools_run_in_a_worker_thread_unless_non_blocking_and_async_on_the_loop():
    main = threading.get_ident()

    def where() -> dict:
        return {"thread": "main" if threading.get_ident() == main else "worker", "text": "héllo"}

    async def where_async() -> str:
        await asyncio.sleep(0)
        return "main" if threading.get_ident() == main else "worker"

    blocking, cheap = Tool.from_function(where), Tool.from_function(where, blocking=False)
    assert blocking.blocking and not cheap.blocking and not Tool.from_function(where_async).blocking
    # non-string results come back as JSON text, non-ASCII kept
    assert run(blocking.call({})) == '{"thread": "worker", "text": "héllo"}'
    assert run(cheap.call({})) == '{"thread": "main", "text": "héllo"}'
    assert run(Tool.from_function(where_async).call({})) == "main"


def test_tool_decorator_forms():
    @tool
    def a(x: int) -> int:
        """Double x."""
        return 2 * x

    @tool(name="bee", timeout_s=5, blocking=False)
    def b() -> object:
        return {3}  # not JSON-serialisable: falls back to str()

    assert isinstance(a, Tool) and a.name == "a" and a.description == "Double x." and a.timeout_s == 30.0
    assert run(a.call({"x": 21})) == "42"
    assert b.name == "bee" and b.timeout_s == 5 and not b.blocking
    assert run(b.call({})) == "{3}"


def test_tool_exceptions_and_timeouts_become_tool_error_kinds():
    def boom(x: int) -> str:
        return str(1 // x)

    async def slow_async() -> str:
        await asyncio.sleep(1)
        return "late"

    def slow_sync() -> str:
        time.sleep(0.2)
        return "late"

    async def raises_tool_error() -> str:
        raise ToolError("bad_arguments", "custom: nope")

    cases = [(Tool.from_function(boom), {"x": 0}, "exception",
              "boom: ZeroDivisionError: integer division or modulo by zero"),
             (Tool.from_function(slow_async, timeout_s=0.02), {}, "timeout", "slow_async: timed out after 0.02 s"),
             (Tool.from_function(slow_sync, timeout_s=0.02), {}, "timeout", "slow_sync: timed out after 0.02 s"),
             (Tool.from_function(raises_tool_error), {}, "bad_arguments", "custom: nope")]
    for t, args, kind, message in cases:
        with pytest.raises(ToolError) as e:
            run(t.call(args))
        assert (e.value.kind, str(e.value)) == (kind, message)


# ---------------------------------------------------------------- Hermes parsing


def call_text(obj) -> str:
    return f"<tool_call>{obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}</tool_call>"


def test_parser_plain_text_and_a_single_call():
    p = HermesParser()
    turn = p.parse("  just an answer \n")
    assert (turn.content, turn.tool_calls, turn.errors) == ("just an answer", [], [])
    turn = p.parse('Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "cats"}}\n</tool_call>\nDone?')
    assert turn.content == "Let me look.\n\nDone?"
    assert turn.tool_calls == [ToolCall("search", {"query": "cats"}, "call_0")]
    assert turn.errors == []


def test_parser_nested_json_two_calls_and_non_ascii():
    nested = {"name": "put", "arguments": {"doc": {"a": [1, {"b": "}"}], "c": None}, "text": "naïve 東京 🚀"}}
    turn = HermesParser().parse("A " + call_text(nested) + " B " + call_text({"name": "get", "arguments": {}}) + " C")
    assert turn.content == "A  B  C"
    assert turn.tool_calls == [ToolCall("put", nested["arguments"], "call_0"), ToolCall("get", {}, "call_1")]
    assert turn.tool_calls[0].to_message_part() == {"type": "function", "id": "call_0",
                                                    "function": {"name": "put", "arguments": nested["arguments"]}}


def test_parser_missing_closing_tag_takes_the_rest_of_the_turn():
    turn = HermesParser().parse('thinking <tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert turn.content == "thinking" and turn.tool_calls == [ToolCall("f", {"x": 1}, "call_0")]
    turn = HermesParser().parse(call_text({"name": "f"}) + '<tool_call>{"name": "g", "argu')
    assert [c.name for c in turn.tool_calls] == ["f"] and len(turn.errors) == 1
    assert turn.errors[0].startswith("tool call 2: invalid JSON")


def test_parser_a_json_list_of_calls_in_one_tag():
    # the SmolLM2 family's format: every call of the turn in one tag; a bad element is an error
    turn = HermesParser().parse('<tool_call>[{"name": "f", "arguments": {"x": 1}}, {"arguments": {}}, '
                                '{"name": "g", "arguments": {}}]</tool_call>')
    assert turn.tool_calls == [ToolCall("f", {"x": 1}, "call_0"), ToolCall("g", {}, "call_2")]
    assert turn.errors == ["tool call 2: missing 'name'"]
    assert HermesParser().parse("<tool_call>[]</tool_call>").tool_calls == []


def test_parser_string_encoded_arguments_and_parameters_alias():
    turn = HermesParser().parse(call_text({"name": "f", "arguments": json.dumps({"x": "ü"})})
                                + call_text({"name": "g", "arguments": ""})
                                + call_text({"name": "h", "parameters": {"y": 2}}))
    assert turn.tool_calls == [ToolCall("f", {"x": "ü"}, "call_0"), ToolCall("g", {}, "call_1"),
                               ToolCall("h", {"y": 2}, "call_2")]


@pytest.mark.parametrize("body, error", [
    ('{"name": "f", "arguments": {"x": 1}', "tool call 1: invalid JSON (Expecting ',' delimiter at column 36): "
                                            '{"name": "f", "arguments": {"x": 1}'),
    ("not json", "tool call 1: invalid JSON (Expecting value at column 1): not json"),
    ('["f"]', "tool call 1: expected a JSON object with 'name' and 'arguments', got str"),  # a list of calls
    ('[[{"name": "f"}]]', "tool call 1: expected a JSON object with 'name' and 'arguments', got list"),
    ('"f"', "tool call 1: expected a JSON object with 'name' and 'arguments', got str"),
    ('{"arguments": {}}', "tool call 1: missing 'name'"),
    ('{"name": "", "arguments": {}}', "tool call 1: missing 'name'"),
    ('{"name": 3}', "tool call 1: missing 'name'"),
    ('{"name": "f", "arguments": "{x: 1}"}', "tool call 1 (f): 'arguments' is a string that is not JSON: {x: 1}"),
    ('{"name": "f", "arguments": [1, 2]}', "tool call 1 (f): 'arguments' must be an object, got list"),
    ('{"name": "f", "arguments": "[1]"}', "tool call 1 (f): 'arguments' must be an object, got list"),
])
def test_parser_malformed_calls_become_errors_not_exceptions(body, error):
    turn = HermesParser().parse("before " + call_text(body) + " after")
    assert turn.tool_calls == [] and turn.errors == [error] and turn.content == "before  after"


def test_parser_long_invalid_bodies_are_clipped_and_errors_are_numbered_with_calls():
    turn = HermesParser().parse(call_text({"name": "ok"}) + call_text("x" * 300))
    assert turn.tool_calls == [ToolCall("ok", {}, "call_0")]
    assert turn.errors == ["tool call 2: invalid JSON (Expecting value at column 1): " + "x" * 120 + "..."]


# ---------------------------------------------------------------- rubric


def test_rubric_weights_by_hand_and_weight_zero_is_still_logged():
    async def half(st):
        await asyncio.sleep(0)
        return 0.5

    rubric = Rubric([RewardFn(lambda st: 1, weight=1.0, name="a"),
                     RewardFn(half, weight=0.5, name="b"),
                     RewardFn(lambda st: 1, weight=0.0, name="fmt", inline=True)])
    reward, metrics = run(rubric.score(EpisodeState(task=Task(id="t", prompt="p"))))
    assert reward == 1.25  # 1*1 + 0.5*0.5 + 0*1
    assert metrics == {"reward/a": 1.0, "reward/b": 0.5, "reward/fmt": 1.0}


def test_rubric_plain_functions_with_weights_and_add():
    main = threading.get_ident()
    seen = {}

    def correct(st):
        seen["correct"] = threading.get_ident() != main  # sync functions run in a worker thread
        return float(st.final_text == "42")

    def short(st):
        return float(len(st.final_text) < 5)

    rubric = Rubric([correct, short], weights=[2.0, -1.0]).add(lambda st: 3, weight=0.0, name="three")
    reward, metrics = run(rubric.score(EpisodeState(task=Task(id="t", prompt="p"), final_text="42")))
    assert (reward, metrics) == (1.0, {"reward/correct": 1.0, "reward/short": 1.0, "reward/three": 3.0})
    assert seen["correct"] is True
    assert run(Rubric().score(EpisodeState(task=Task(id="t", prompt="p")))) == (0.0, {})


# ---------------------------------------------------------------- ToolEnv


def echo(text: str) -> str:
    """Echo the text back."""
    return text


def boom() -> str:
    raise RuntimeError("kaput")


async def nap(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "rested"


def submit(answer: str) -> str:
    """Submit the final answer."""
    raise EpisodeFinished(answer, message="answer received")


TOOLS = [Tool.from_function(echo), Tool.from_function(boom), Tool.from_function(nap, timeout_s=0.05),
         Tool.from_function(submit)]
RUBRIC = Rubric([RewardFn(lambda st: float(st.final_text == "done" or st.submitted == "done"), name="ok", inline=True)])
COUNTS = ["tool_calls", "tool_errors", "malformed_calls", "unknown_tool", "bad_arguments", "tool_exceptions",
          "tool_timeouts", "calls_over_limit", "truncated_observations"]


def make_env(**limits) -> ToolEnv:
    task = Task(id="t", prompt=[{"role": "user", "content": "go"}])
    return ToolEnv(task, TOOLS, RUBRIC, ToolLimits(**limits))


def call(name, **arguments) -> str:
    return call_text({"name": name, "arguments": arguments})


def counts(result, **nonzero) -> None:
    assert {k: result.metrics[k] for k in COUNTS} == {k: float(nonzero.get(k, 0)) for k in COUNTS}


def test_tool_env_plays_a_tool_turn_then_a_final_answer():
    env = make_env()
    assert run(env.initial_observation()) == [{"role": "user", "content": "go"}]
    assert [t["function"]["name"] for t in env.tools] == ["echo", "boom", "nap", "submit"]
    first = run(env.step("checking " + call("echo", text="hi")))
    assert not first.done and first.reward == 0.0
    assert first.observation == [{"role": "tool", "content": "hi", "tool_call_id": "call_1_0"}]
    last = run(env.step("done"))
    assert last.done and last.reward == 1.0 and last.observation == []
    assert last.metrics["reward/ok"] == 1.0 and last.metrics["turns"] == 2.0
    counts(last, tool_calls=1)
    assert env.state.messages[1] == {"role": "assistant", "content": "checking",
                                     "tool_calls": [{"type": "function", "id": "call_1_0",
                                                     "function": {"name": "echo", "arguments": {"text": "hi"}}}]}
    assert env.state.messages[-1] == {"role": "assistant", "content": "done"}


@pytest.mark.parametrize("action, message, counted", [
    ('<tool_call>{"name": "echo", "arguments": {</tool_call>', "error: tool call 1: invalid JSON", "malformed_calls"),
    (call("nope", x=1), "error: unknown tool 'nope'; available: echo, boom, nap, submit", "unknown_tool"),
    (call("echo", txt="hi"), "error: echo: missing required argument 'text'; unknown argument 'txt'", "bad_arguments"),
    (call("boom"), "error: boom: RuntimeError: kaput", "tool_exceptions"),
    (call("nap", seconds=1), "error: nap: timed out after 0.05 s", "tool_timeouts"),
])
def test_each_tool_failure_is_an_observation_and_a_counted_metric(action, message, counted):
    env = make_env()
    result = run(env.step(action))
    assert not result.done and len(result.observation) == 1
    assert result.observation[0]["role"] == "tool" and result.observation[0]["content"].startswith(message)
    final = run(env.step("done"))
    assert final.reward == 1.0  # the episode went on and finished normally
    counts(final, tool_calls=0 if counted == "malformed_calls" else 1, tool_errors=1, **{counted: 1})


def test_max_tool_calls_per_turn():
    env = make_env(max_tool_calls_per_turn=2)
    result = run(env.step(call("echo", text="a") + call("echo", text="b") + call("echo", text="c")))
    assert [m["content"] for m in result.observation] == [
        "a", "b", "error: at most 2 tool calls per turn; echo was not run"]
    counts(run(env.step("done")), tool_calls=2, calls_over_limit=1)
    assert [c.arguments["text"] for c in env.state.tool_calls] == ["a", "b"]


def test_max_turns_ends_the_episode_and_scores_it():
    env = make_env(max_turns=2)
    assert not run(env.step(call("echo", text="a"))).done
    last = run(env.step(call("echo", text="b")))
    assert last.done and last.reward == 0.0 and last.metrics["turns"] == 2.0 and last.metrics["reward/ok"] == 0.0
    assert env.state.messages[-1] == {"role": "tool", "content": "b", "tool_call_id": "call_2_0"}


def test_long_observations_are_truncated_with_the_marker():
    env = make_env(max_observation_tokens=10)
    result = run(env.step(call("echo", text="abcdefghijklmnop") + call("echo", text="short")))
    assert [m["content"] for m in result.observation] == [
        "abcdefghij\n[... output truncated: 6 more tokens]", "short"]
    # the default counter is UTF-8 bytes: "é" is 2, so 4 of the 6 bytes fit in a limit of 5
    env = make_env(max_observation_tokens=5)
    assert run(env.step(call("echo", text="ééé"))).observation[0]["content"] == \
        "éé\n[... output truncated: 2 more tokens]"
    # a tokenizer's counter can be plugged in: one token per word
    words = ToolEnv(Task(id="t", prompt="p"), TOOLS, RUBRIC, ToolLimits(max_observation_tokens=2),
                    count_tokens=lambda s: len(s.split()))
    assert run(words.step(call("echo", text="one two three four"))).observation[0]["content"] == \
        "one two \n[... output truncated: 2 more tokens]"
    counts(run(words.step("done")), tool_calls=1, truncated_observations=1)


def test_episode_timeout_ends_with_reward_zero():
    env = make_env(episode_timeout_s=0.01)
    result = run(env.step(call("nap", seconds=0.03) + call("echo", text="done")))
    assert result.done and result.reward == 0.0
    assert result.metrics["episode_timeout"] == 1.0 and "reward/ok" not in result.metrics
    assert [m["content"] for m in env.state.messages[-2:]] == ["rested", "done"]


def test_episode_finished_from_a_submit_tool_ends_the_episode():
    env = make_env()
    result = run(env.step("I am sure. " + call("submit", answer="done") + call("echo", text="never run")))
    assert result.done and result.reward == 1.0 and env.state.submitted == "done"
    assert env.state.messages[-1] == {"role": "tool", "content": "answer received", "tool_call_id": "call_1_0"}
    counts(result, tool_calls=1)


def test_a_final_answer_after_the_episode_timeout_scores_zero(monkeypatch):
    import flywheel.envs.tool_env as tool_env

    clock = [1000.0]  # the env's clock, moved by hand: no real wait, no race with a loaded machine
    monkeypatch.setattr(tool_env, "monotonic", lambda: clock[0])
    env = make_env(episode_timeout_s=10.0)
    assert not run(env.step(call("echo", text="x"))).done
    clock[0] += 10.5
    result = run(env.step("done"))
    assert result.done and result.reward == 0.0 and result.metrics.get("episode_timeout") == 1.0


def test_single_turn_env():
    env = SingleTurnEnv(Task(id="t", prompt="12+3=", answer="15"), Rubric([RewardFn(
        lambda st: float(st.final_text.strip() == st.task.answer), name="c", inline=True)]))
    assert run(env.initial_observation()) == "12+3="
    result = run(env.step(" 15"))
    assert (result.done, result.reward, result.metrics, result.observation) == (True, 1.0, {"reward/c": 1.0}, [])


# ---------------------------------------------------------------- runner


class EchoEnvironment(Environment):
    """Single-turn: reward 1 when the reply equals the task's answer."""

    name = "echo"

    def tasks(self, split="train", n=None, seed=0):
        return [Task(id=f"t{i}", prompt=[{"role": "user", "content": str(i)}], answer=str(i)) for i in range(n or 3)]

    def make_env(self, task):
        return SingleTurnEnv(task, Rubric([RewardFn(lambda st: float(st.final_text == st.task.answer), name="c",
                                                    inline=True)]))


class SlowPolicy(Policy):
    """Sleeps, counts how many episodes are inside act at once; per-task misbehaviour."""

    def __init__(self, delay=0.02, hang=(), fail=()):
        self.delay, self.hang, self.fail = delay, set(hang), set(fail)
        self.active = self.peak = 0

    async def act(self, task, history, tools, episode=0):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(10 if task.id in self.hang else self.delay)
            if task.id in self.fail:
                raise RuntimeError("policy bug")
            return task.answer
        finally:
            self.active -= 1


def test_runner_honours_the_concurrency_limit_and_keeps_task_order():
    env = EchoEnvironment()
    tasks = env.tasks(n=9)
    policy = SlowPolicy()
    results = run(play(env, tasks, policy, concurrency=3))
    assert policy.peak == 3
    assert [r.task.id for r in results] == [t.id for t in tasks]
    assert all(r.reward == 1.0 and r.error is None and r.steps == 1 for r in results)
    assert results[0].transcript == [{"role": "user", "content": "0"}, {"role": "assistant", "content": "0"}]
    assert len(results[0].step_latencies_s) == 1 and results[0].duration_s >= 0.02
    unbounded = SlowPolicy()
    run(play(env, tasks, unbounded, concurrency=64))
    assert unbounded.peak == 9


def test_runner_timeout_and_exceptions_end_only_their_episode():
    env = EchoEnvironment()
    tasks = env.tasks(n=5)
    t0 = time.perf_counter()
    results = run(play(env, tasks, SlowPolicy(hang={"t1"}, fail={"t3"}), concurrency=5, timeout_s=0.2))
    assert time.perf_counter() - t0 < 2
    assert [r.error for r in results] == [None, "timeout", None, "RuntimeError: policy bug", None]
    assert [r.reward for r in results] == [1.0, 0.0, 1.0, 0.0, 1.0]


def test_play_episode_on_a_raw_text_task_and_a_multi_turn_tool_env():
    class Raw(EchoEnvironment):
        def tasks(self, split="train", n=None, seed=0):
            return [Task(id="r", prompt="2+2=", answer="4")]

    (result,) = run(play(Raw(), Raw().tasks()[:1], SlowPolicy(delay=0)))
    assert result.transcript == "2+2=4" and result.reward == 1.0

    class Tools(EchoEnvironment):
        def make_env(self, task):
            return ToolEnv(task, TOOLS, RUBRIC)

    class TwoTurns(Policy):
        async def act(self, task, history, tools, episode=0):
            return call("echo", text="hi") if history[-1]["role"] == "user" else "done"

    (result,) = run(play(Tools(), Tools().tasks(n=1), TwoTurns()))
    assert result.reward == 1.0 and result.steps == 2 and [m["role"] for m in result.transcript] == \
        ["user", "assistant", "tool", "assistant"]


# ---------------------------------------------------------------- registry


CUSTOM_MODULE = '''
from flywheel.envs.base import Environment
from flywheel.envs.tool_env import SingleTurnEnv
from flywheel.envs.rubric import Rubric
from flywheel.types import Task


class Custom(Environment):
    name = "custom"

    def __init__(self, size=2):
        self.size = size

    def tasks(self, split="train", n=None, seed=0):
        return [Task(id=str(i), prompt="x") for i in range(self.size)]

    def make_env(self, task):
        return SingleTurnEnv(task, Rubric())


def load(size: int = 2):
    return Custom(size=size)


def not_an_env():
    return {"name": "custom"}


def broken():
    raise ValueError("broken env")
'''


@pytest.fixture()
def custom_module(tmp_path, monkeypatch):
    name = "flywheel_test_custom_env"
    (tmp_path / f"{name}.py").write_text(CUSTOM_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_registry_lists_builtins_and_loads_by_name():
    assert {"arithmetic", "calculator", "reasoning_gym"} <= set(list_envs())
    assert load_env("arithmetic").name == "arithmetic"
    assert load_env("calculator", tool_latency_s=0.5).tool_latency_s == 0.5


def test_registry_unknown_name():
    with pytest.raises(EnvLoadError, match=r"unknown environment 'nope': built-ins are arithmetic, calculator"):
        load_env("nope")
    assert issubclass(EnvLoadError, ValueError)


def test_registry_import_path(custom_module):
    env = load_env(f"{custom_module}:load", size=3)
    assert env.name == "custom" and len(env.tasks()) == 3
    with pytest.raises(EnvLoadError, match=r"bad settings \{'colour': 'red'\}.*unexpected keyword argument 'colour'"):
        load_env(f"{custom_module}:load", colour="red")
    with pytest.raises(EnvLoadError, match=r"returned dict, not an Environment"):
        load_env(f"{custom_module}:not_an_env")
    with pytest.raises(EnvLoadError, match=r"has no 'missing'"):
        load_env(f"{custom_module}:missing")
    with pytest.raises(EnvLoadError, match=r"cannot import 'no_such_module_xyz'"):
        load_env("no_such_module_xyz:load")
    with pytest.raises(ValueError, match="broken env"):  # the loader's own error passes through
        load_env(f"{custom_module}:broken")


# ---------------------------------------------------------------- CLI


@pytest.fixture(scope="module")
def cli():
    return CliRunner()


def test_cli_env_list(cli):
    result = cli.invoke(app, ["env", "list"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert "arithmetic      flywheel.envs.arithmetic:load" in lines
    assert any(line.split() == ["calculator", "flywheel.envs.calculator:load"] for line in lines)


def test_cli_env_show(cli):
    result = cli.invoke(app, ["env", "show", "arithmetic"])
    assert result.exit_code == 0, result.output
    info_text, rest = result.stdout.split("verifier task:", 1)  # then its shape (tests/unit/test_env_verifier.py)
    info = json.loads(info_text)
    assert info["name"] == "arithmetic" and info["train_tasks"] == 9800 and info["test_tasks"] == 200
    task = json.loads(rest.split("example verifier:\n")[1])["task"]
    (first,) = load_env("arithmetic").tasks("test", n=1)
    assert task == {"answer": first.answer}  # the trace's own prompt is replayed: the verifier sends none
    shown = json.loads(cli.invoke(app, ["env", "show", "calculator", "--set", "tool_latency_s=0.25"])
                       .stdout.split("verifier task:")[0])
    assert shown["tool_latency_s"] == 0.25 and shown["tools"][0]["function"]["name"] == "calc"


@pytest.mark.parametrize("name", ["arithmetic", "calculator"])
def test_cli_env_try_scripted(cli, name):
    result = cli.invoke(app, ["env", "try", name, "-k", "2"])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("episode ") == 2 and "reward 1" in result.stdout
    assert result.stdout.rstrip().endswith("mean reward 1.000 over 2 episodes")


@pytest.mark.parametrize("args, message", [
    (["env", "try", "arithmetic", "--set", "digits=abc"], "error: invalid literal for int() with base 10: 'abc'\n"),
    (["env", "try", "arithmetic", "--set", "digits"], "error: --set 'digits': expected key=value\n"),
    (["env", "show", "arithmetic", "--set", "operators=/"],
     "error: operators must be a non-empty string of +-*, got '/'\n"),
    (["env", "show", "calculator", "--set", "colour=red"],
     "error: environment 'calculator': bad settings {'colour': 'red'}"),
    (["env", "show", "nope"], "error: unknown environment 'nope'"),
])
def test_cli_bad_settings_are_user_errors(cli, args, message):
    result = cli.invoke(app, args)
    assert result.exit_code == 2 and result.stderr.startswith(message), result.output
    assert "Traceback" not in result.output
