"""The demo's world: traffic mixes, day plans, and how a simulated user judges and corrects."""

import dataclasses
import json
import random
from collections import Counter

from flywheel.demo.users import Episode, feedback_for
from flywheel.demo.world import WorldConfig, call_expression, correction_for, day_plan, traffic_mix
from flywheel.envs import load_env


def test_traffic_mix_gives_the_newcomer_its_share_and_splits_the_rest():
    cfg = WorldConfig(new_family_share=0.5)
    assert traffic_mix(cfg, 1) == {"add": 1.0}
    assert traffic_mix(cfg, 2) == {"add": 0.5, "subtract": 0.5}
    assert traffic_mix(cfg, 3) == {"add": 0.25, "subtract": 0.25, "multiply": 0.5}
    assert cfg.new(1) is None and cfg.new(3).name == "multiply"


def test_day_plans_are_seeded_follow_the_mix_and_never_reuse_a_question():
    cfg = WorldConfig(episodes_per_day=400, days_per_week=2)
    plan = day_plan(cfg, 3, 1)
    assert plan == day_plan(cfg, 3, 1)
    counts = Counter(f for f, _ in plan)
    assert 160 < counts["multiply"] < 240 and counts["add"] + counts["subtract"] + counts["multiply"] == 400
    indices = [i for w in (1, 2, 3) for d in range(1, cfg.days(w) + 1) for _, i in day_plan(cfg, w, d)]
    assert len(indices) == len(set(indices)) == 2000 and cfg.days(1) == 1


def test_call_expression_reads_the_first_calc_call():
    text = 'Let me compute that.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "12 - 3"}}\n</tool_call>'
    assert call_expression(text) == "12 - 3"
    assert call_expression("The answer is 9.") is None
    assert call_expression('<tool_call>\n{"name": "calc", "arguments": {"expression": 5}}\n</tool_call>') is None
    assert call_expression('<tool_call>{"name": "other", "arguments": {}}</tool_call>') is None


def test_correction_targets_the_turn_that_went_wrong():
    turn, msg = correction_for("12 - 3", "9", None)
    assert turn == 0 and json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"expression": "12 - 3"}
    assert correction_for("12 - 3", "9", "12 + 3")[0] == 0
    assert correction_for("12 - 3", "9", "12-3") == (-1, {"role": "assistant", "content": "The answer is 9."})


def test_feedback_carries_a_verifier_and_sometimes_a_correction():
    task = load_env("calculator", chain_prob=0.0, bare_prompt=True, operator="-",
                    template="What is {a} minus {b}?").tasks("train", n=1)[0]
    failed = Episode("subtract", task, trace_ids=["r1", "r2"], called=task.metadata["expression"], final="It is 3.")
    always = feedback_for(failed, random.Random(0), correction_rate=1.0)
    assert always[0][0] == "r2" and always[0][1]["score"] == 0.0
    assert always[0][1]["verifier"]["env"] == "calculator" and always[0][1]["verifier"]["task"]["answer"] == task.answer
    assert always[1] == ("r2", {"correction": {"role": "assistant", "content": f"The answer is {task.answer}."},
                                "idempotency_key": "r2/correction"})
    assert len(feedback_for(failed, random.Random(0), correction_rate=0.0)) == 1
    passed = Episode("subtract", task, trace_ids=["r1", "r2"], success=True)
    assert [b["score"] for _, b in feedback_for(passed, random.Random(0), 1.0)] == [1.0]
    assert feedback_for(Episode("subtract", task), random.Random(0), 1.0) == []


def test_a_tools_family_sends_the_calc_schema_and_no_system_prompt():
    from flywheel.demo.world import FAMILIES
    from flywheel.envs import load_env

    family = dataclasses.replace(FAMILIES[1], tools=True)
    task = load_env("calculator", **family.settings).tasks("train", n=1)[0]
    assert [t["function"]["name"] for t in task.tools] == ["calc"]
    assert [m["role"] for m in task.prompt] == ["user"]
    bare = load_env("calculator", **FAMILIES[1].settings).tasks("train", n=1)[0]
    assert not bare.tools and bare.prompt == task.prompt


def test_an_episode_follows_parsed_tool_calls_the_openai_way():
    """With tools in the request the server returns `tool_calls`: the user runs the call and
    answers with a tool message carrying the call's id, then reads the final answer."""
    import asyncio

    from flywheel.demo.users import play
    from flywheel.demo.world import FAMILIES
    from flywheel.envs import load_env

    family = dataclasses.replace(FAMILIES[2], tools=True)
    task = load_env("calculator", **family.settings).tasks("train", n=1)[0]
    sent = []

    class Server:  # the two replies of a model that calls calc, then answers
        async def post(self, path, json):
            sent.append(json)
            if len(sent) == 1:
                message = {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_7", "type": "function",
                    "function": {"name": "calc", "arguments": f'{{"expression": "{task.metadata["expression"]}"}}'}}]}
            else:
                message = {"role": "assistant", "content": f"It is {task.answer}."}
            body = {"id": f"r{len(sent)}", "usage": {"completion_tokens": 5}, "choices": [{"message": message}]}
            return type("R", (), {"status_code": 200, "json": lambda self: body, "text": ""})()

    ep = asyncio.run(play(Server(), task, family.name))
    assert ep.success and ep.called == task.metadata["expression"] and ep.trace_ids == ["r1", "r2"]
    assert sent[0]["tools"] == task.tools
    call_turn, result = sent[1]["messages"][-2:]
    assert call_turn["tool_calls"][0]["id"] == "call_7" and result == {
        "role": "tool", "content": task.answer, "tool_call_id": "call_7"}
