"""The drifting world of the flagship demo: task families that arrive week by week, how much
traffic each gets, and how a simulated user judges and corrects an answer.

Every family is the `calculator` environment with another operator and question template,
asked without a system prompt or tool schemas (the tiny served model is fine-tuned on its
`calc` tool), so one tool serves all of them and what changes week to week is what users ask.
A world of `tools` families sends the calc schema with every request instead, as an agent
stack on an OpenAI client does (`tools=`): what a pretrained model needs to learn the call's
protocol (demo/presets.py):

    week 1  add        "What is 123 + 45?"          the model was trained on it
    week 2  subtract   "What is 123 minus 45?"      new: the model fails it
    week 3  multiply   "What is 12 times 34?"       new again

A user plays an episode turn by turn over HTTP (the model calls `calc`, the user's agent
stack runs it and sends the result back), checks the final number, reports the outcome with
a verifier (the task, which the calculator environment replays), and on a failure sometimes
(`correction_rate`) sends a corrected turn: the right tool call when the call was wrong,
else the right final answer.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

ENV = "calculator"
COMMON = {"chain_prob": 0.0, "bare_prompt": True, "max_turns": 3}


@dataclass(frozen=True)
class Family:
    """A task family: the calculator environment with one operator and question template."""

    name: str
    arrives: int  # the week it first appears
    operator: str
    template: str
    max_digits: int = 3
    tools: bool = False  # requests carry the calc schema (no system prompt either way)

    @property
    def settings(self) -> dict[str, Any]:
        return {**COMMON, "operator": self.operator, "template": self.template, "max_digits": self.max_digits,
                **({"bare_prompt": False, "system_prompt": False} if self.tools else {})}


FAMILIES = (
    Family(name="add", arrives=1, operator="+", template="What is {a} + {b}?"),
    Family(name="subtract", arrives=2, operator="-", template="What is {a} minus {b}?"),
    Family(name="multiply", arrives=3, operator="*", template="What is {a} times {b}?", max_digits=2),
)


@dataclass(frozen=True)
class WorldConfig:
    """The simulated world: how long it runs, how much traffic a day brings and how users act."""

    weeks: int = 3
    days_per_week: int = 3  # from week 2 on: a traffic batch, then a cycle, per day (week 1 is one baseline day)
    episodes_per_day: int = 600
    new_family_share: float = 0.5  # of a week's traffic, for the family that arrived that week
    correction_rate: float = 0.5  # failures whose user sends a corrected turn
    concurrency: int = 32  # simulated users at once
    seed: int = 0
    families: tuple[Family, ...] = FAMILIES

    def days(self, week: int) -> int:
        """Week 1 brings nothing new: one day shows the baseline; later weeks get `days_per_week`."""
        return 1 if week == 1 else self.days_per_week

    def live(self, week: int) -> list[Family]:
        return [f for f in self.families if f.arrives <= week]

    def new(self, week: int) -> Family | None:
        return next((f for f in self.families if f.arrives == week and week > 1), None)


def traffic_mix(cfg: WorldConfig, week: int) -> dict[str, float]:
    """Share of the week's episodes per live family: the newcomer gets `new_family_share`, the
    older families split the rest evenly (all even in week 1)."""
    live, new = cfg.live(week), cfg.new(week)
    if new is None:
        return {f.name: 1.0 / len(live) for f in live}
    old = [f for f in live if f.name != new.name]
    return {**{f.name: (1.0 - cfg.new_family_share) / len(old) for f in old}, new.name: cfg.new_family_share}


def day_plan(cfg: WorldConfig, week: int, day: int) -> list[tuple[str, int]]:
    """(family, index into that family's train tasks) for each episode of a day, in arrival
    order. Indices never repeat across days, so users keep asking new questions."""
    rng = random.Random(f"demo/{cfg.seed}/{week}/{day}")
    mix = traffic_mix(cfg, week)
    names = list(mix)
    picks = rng.choices(names, weights=[mix[n] for n in names], k=cfg.episodes_per_day)
    offset = (sum(cfg.days(w) for w in range(1, week)) + (day - 1)) * cfg.episodes_per_day
    return [(name, offset + i) for i, name in enumerate(picks)]


# ---------------------------------------------------------------- judging an episode


def call_expression(text: str) -> str | None:
    """The `expression` of the first well-formed calc call in an assistant turn, else None."""
    from flywheel.models.tool_calls import HermesParser

    for call in HermesParser().parse(text).tool_calls:
        if call.name == "calc" and isinstance(call.arguments.get("expression"), str):
            return call.arguments["expression"]
    return None


CALL_PREAMBLE = "Let me compute that."  # what the tiny base says before a call (envs/calculator.py's scripted policy)


def correct_call(expression: str, tools: bool = False) -> dict[str, Any]:
    """The assistant turn a user would have wanted first: call calc on the question's expression.
    tools: the request offered the calc schema (OpenAI tool calling): the turn is the call alone
    (content null), the shape such a turn has; else the call in the words the tiny base was
    taught, CALL_PREAMBLE first. A correction carries only what should change: a preamble a
    pretrained model never said, taught beside the call, spills into its other answers
    (docs/benchmarks.md)."""
    return {"role": "assistant", "content": None if tools else CALL_PREAMBLE, "tool_calls": [
        {"id": "call_0", "type": "function",
         "function": {"name": "calc", "arguments": json.dumps({"expression": expression})}}]}


def correct_answer(answer: str) -> dict[str, Any]:
    return {"role": "assistant", "content": f"The answer is {answer}."}


def correction_for(expression: str, answer: str, called: str | None, tools: bool = False) -> tuple[int, dict[str, Any]]:
    """(turn to correct, corrected message): turn 0 when the call was missing or wrong
    (compared with whitespace removed), else the final turn. tools: see correct_call."""
    if called is None or called.replace(" ", "") != expression.replace(" ", ""):
        return 0, correct_call(expression, tools)
    return -1, correct_answer(answer)
