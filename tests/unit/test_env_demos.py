"""Scripted demos as SFT data (`flywheel env demos`): rows the SFT loader accepts, whose
rendering through the tiny model's chat template gives back, turn for turn, the tool calls
the env parsed when the demo was played; skips counted by reason; clear errors."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from flywheel.cli.main import app
from flywheel.config import SFTDataConfig
from flywheel.envs import load_env
from flywheel.models.tool_calls import HermesParser
from flywheel.envs.base import Policy
from flywheel.rollout.demos import collect_demos, make_demos
from flywheel.models import ChatRenderer
from flywheel.models.tiny import IM_END, IM_START, build_tokenizer
from flywheel.train.sft_data import load_sft_examples

ASSISTANT = f"{IM_START}assistant\n"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def calculator():
    return load_env("calculator")


@pytest.fixture(scope="module")
def demos(calculator):
    rows, report = make_demos(calculator, 8, split="train", seed=3)
    return rows, report, calculator.tasks("train", n=8, seed=3)


def assistant_turns(rendered: str) -> list[str]:
    """The text of each assistant turn of a rendered conversation (without the end token)."""
    return [part.split(IM_END, 1)[0] for part in rendered.split(ASSISTANT)[1:]]


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


# ---------------------------------------------------------------- rows


def test_every_scripted_episode_is_kept_as_a_two_turn_tool_call_row(demos):
    rows, report, tasks = demos
    assert (report.episodes, report.kept, dict(report.skipped)) == (8, 8, {})
    assert report.summary() == "8 of 8 episodes kept"
    for row, task in zip(rows, tasks):
        assert set(row) == {"messages", "tools"} and row["tools"] == task.tools
        roles = [m["role"] for m in row["messages"]]
        assert roles == ["system", "user", "assistant", "tool", "assistant"]
        assert row["messages"][:2] == task.prompt
        call_turn, tool, final = row["messages"][2:]
        (call,) = call_turn["tool_calls"]
        assert call["type"] == "function" and call["id"] == tool["tool_call_id"] == "call_1_0"
        assert call["function"]["name"] == "calc"
        assert json.loads(call["function"]["arguments"]) == {"expression": task.metadata["expression"]}
        assert tool["content"] == task.answer
        assert "tool_calls" not in final and task.answer in final["content"]
    assert json.loads(json.dumps(rows)) == rows  # plain JSON


def test_rows_are_accepted_by_the_sft_loader_with_the_assistant_turns_trained(demos, tok, tmp_path):
    rows, _, _ = demos
    path = write_jsonl(tmp_path / "demos.jsonl", rows)
    examples, report = load_sft_examples([path], tok, SFTDataConfig(train=[path], format="chat",
                                                                       on_error="raise"))
    assert report.examples == len(rows) and report.summary() == f"{len(rows)} examples from 1 file ({len(rows)} lines)"
    renderer = ChatRenderer(tok)
    for row, ex in zip(rows, examples):
        rendered = renderer.render(row["messages"], row["tools"])
        assert tok.decode(ex.ids) == rendered  # token in = what the template renders
        trained = tok.decode([i for i, m in zip(ex.ids, ex.loss_mask) if m])
        assert trained == "".join(t + IM_END for t in assistant_turns(rendered))


def test_rendered_assistant_turns_parse_back_to_the_same_tool_calls(demos, tok):
    rows, _, _ = demos
    renderer, parser = ChatRenderer(tok), HermesParser()
    for row in rows:
        turns = assistant_turns(renderer.render(row["messages"], row["tools"]))
        wanted = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(turns) == len(wanted) == 2
        for text, message in zip(turns, wanted):
            parsed = parser.parse(text)
            assert parsed.errors == []
            assert parsed.content == (message["content"] or "")
            assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
                (c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in message.get("tool_calls", [])]


def test_rendered_turns_are_what_the_scripted_policy_wrote_and_solve_the_task(demos, tok, calculator):
    """Replaying the template's assistant text in the env gives the same tool results and reward 1."""
    rows, _, tasks = demos
    renderer, policy = ChatRenderer(tok), calculator.scripted_policy()

    async def replay(row, task):
        env = calculator.make_env(task)
        history = list(task.prompt)
        turns = assistant_turns(renderer.render(row["messages"], row["tools"]))
        for text in turns:
            assert text == await policy.act(task, history, task.tools)
            step = await env.step(text)
            history += [{"role": "assistant", "content": text}, *step.observation]
        return step, history

    for row, task in zip(rows, tasks):
        step, history = asyncio.run(replay(row, task))
        assert step.done and step.reward == 1.0 and step.metrics["reward/used_tool"] == 1.0
        assert [m["content"] for m in history if m["role"] == "tool"] == [task.answer]


def test_demos_follow_env_settings_split_and_seed(tmp_path):
    env = load_env("calculator", chain_prob=0.0)
    rows, _ = make_demos(env, 5, split="test", seed=1, out=tmp_path / "d.jsonl")
    exprs = [json.loads(r["messages"][2]["tool_calls"][0]["function"]["arguments"])["expression"] for r in rows]
    assert exprs == [t.metadata["expression"] for t in env.tasks("test", n=5, seed=1)]
    assert all("(" not in e and e.count("*") == 1 for e in exprs)  # no chains at chain_prob 0
    assert [json.loads(line) for line in (tmp_path / "d.jsonl").read_text().splitlines()] == rows


def test_bare_rows_drop_system_and_tools_but_keep_the_same_assistant_tokens(demos, calculator, tok, tmp_path):
    rows, _, _ = demos
    bare, report = make_demos(calculator, 8, split="train", seed=3, bare=True)
    assert report.kept == 8
    assert bare == [{"messages": row["messages"][1:]} for row in rows]
    paths = [write_jsonl(tmp_path / "full.jsonl", rows), write_jsonl(tmp_path / "bare.jsonl", bare)]
    cfg = SFTDataConfig(train=paths, format="chat")
    (full_ex, _), (bare_ex, _) = (load_sft_examples([p], tok, cfg) for p in paths)
    for f, b in zip(full_ex, bare_ex):
        assert len(b.ids) * 3 < len(f.ids)  # the tool block is most of a full row
        trained = lambda ex: [i for i, m in zip(ex.ids, ex.loss_mask) if m]
        assert trained(f) == trained(b)


# ---------------------------------------------------------------- skips


class _Scripted(Policy):
    def __init__(self, turns):
        self.turns = turns

    async def act(self, task, history, tools, episode=0):
        done = sum(m["role"] == "assistant" for m in history)
        return self.turns(task)[min(done, len(self.turns(task)) - 1)]


def _call(expression: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expression": expression}}) + "</tool_call>"


@pytest.mark.parametrize("turns, min_reward, reason", [
    (lambda t: ["The answer is 1."], 1.0, "reward below 1"),
    (lambda t: ["<tool_call>{not json</tool_call>", f"It is {t.answer}."], 0.0, "malformed tool call"),
    (lambda t: [_call("1 + 1")], 0.0, "no final answer (out of turns)"),
])
def test_unusable_episodes_are_skipped_and_counted_by_reason(calculator, turns, min_reward, reason):
    tasks = calculator.tasks("train", n=3)
    rows, report = asyncio.run(collect_demos(calculator, tasks, _Scripted(turns), min_reward=min_reward))
    assert rows == [] and (report.episodes, report.kept, dict(report.skipped)) == (3, 0, {reason: 3})
    assert report.summary() == f"0 of 3 episodes kept; skipped: 3 {reason}"


def test_a_direct_answer_without_tools_is_kept_as_a_plain_turn(calculator):
    tasks = calculator.tasks("train", n=2)
    rows, report = asyncio.run(collect_demos(calculator, tasks, _Scripted(lambda t: [f"It is {t.answer}."])))
    assert report.kept == 2
    assert rows[0]["messages"][2:] == [{"role": "assistant", "content": f"It is {tasks[0].answer}."}]


def test_raw_text_envs_give_no_chat_rows():
    rows, report = make_demos(load_env("arithmetic"), 2)
    assert rows == [] and dict(report.skipped) == {"raw-text episode (not chat)": 2}


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("n", [0, -3, 1.5, True, None])
def test_n_must_be_a_positive_integer(calculator, n):
    with pytest.raises(ValueError, match=r"^n must be a positive integer, got "):
        make_demos(calculator, n)


def test_unwritable_out_fails_before_playing(calculator, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"^cannot write '.*file/d.jsonl': "):
        make_demos(calculator, 2, out=blocker / "d.jsonl")
    with pytest.raises(ValueError, match=r"is a folder; give a \.jsonl file path$"):
        make_demos(calculator, 2, out=tmp_path)


def test_bad_split_is_the_envs_error(calculator):
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        make_demos(calculator, 2, split="dev")


# ---------------------------------------------------------------- CLI


def test_cli_writes_rows_and_reports_counts(tmp_path):
    out = tmp_path / "sub" / "demos.jsonl"
    result = CliRunner().invoke(app, ["env", "demos", "calculator", "--out", str(out), "-n", "4",
                                      "--set", "chain_prob=0", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(f"4 of 4 episodes kept -> {out} (4 rows, ")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == make_demos(load_env("calculator", chain_prob=0), 4, seed=2)[0]
    bare = tmp_path / "bare.jsonl"
    result = CliRunner().invoke(app, ["env", "demos", "calculator", "--out", str(bare), "-n", "4",
                                      "--set", "chain_prob=0", "--seed", "2", "--bare"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line) for line in bare.read_text().splitlines()] == [
        {"messages": r["messages"][1:]} for r in rows]


@pytest.mark.parametrize("args, message", [
    (["nope", "--out", "{tmp}/d.jsonl"], "error: unknown environment 'nope': built-ins are "),
    (["calculator", "--out", "{tmp}/d.jsonl", "-n", "0"], "error: -n must be at least 1, got 0"),
    (["calculator", "--out", "{tmp}"], "error: --out '{tmp}' is a folder; give a .jsonl file path"),
    (["calculator", "--out", "{tmp}/d.jsonl", "--set", "chain_prob=2"], "error: tool_latency_s must be >= 0"),
    (["arithmetic", "--out", "{tmp}/d.jsonl", "-n", "2"], "error: no episode was kept, so {tmp}/d.jsonl is empty"),
])
def test_cli_errors_are_one_clear_line(tmp_path, args, message):
    result = CliRunner().invoke(app, ["env", "demos", *[a.format(tmp=tmp_path) for a in args]])
    assert result.exit_code == 2
    assert result.stderr.startswith(message.format(tmp=tmp_path)) and result.stderr.count("\n") == 1
