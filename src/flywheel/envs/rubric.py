"""A Rubric combines weighted reward functions into one reward.

Each function takes the finished `EpisodeState` and returns a float (sync or async; sync
functions run in a worker thread so CPU-heavy verification never blocks the event loop).
reward = sum(weight_i * f_i(state)); every function's value is also logged as a metric, and
weight-0 functions are metrics only.
"""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from flywheel.types import Message, Task, ToolCall


@dataclass
class EpisodeState:
    task: Task
    messages: list[Message] = field(default_factory=list)  # the whole conversation so far
    final_text: str = ""  # the last assistant text (outside tool calls)
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: int = 0
    submitted: Any = None  # what a `submit`-style tool received, if any
    metrics: dict[str, float] = field(default_factory=dict)
    scratch: dict[str, Any] = field(default_factory=dict)  # per-env working data


@dataclass
class RewardFn:
    fn: Callable[[EpisodeState], float]
    weight: float = 1.0
    name: str = ""
    inline: bool = False  # cheap and pure: call on the event loop instead of a thread

    def __post_init__(self):
        self.name = self.name or getattr(self.fn, "__name__", "reward")


class Rubric:
    def __init__(self, funcs: list[RewardFn | Callable] | None = None, weights: list[float] | None = None):
        self.funcs: list[RewardFn] = []
        for i, f in enumerate(funcs or []):
            rf = f if isinstance(f, RewardFn) else RewardFn(f, weight=(weights[i] if weights else 1.0))
            self.funcs.append(rf)

    def add(self, fn: Callable, weight: float = 1.0, name: str = "", inline: bool = False) -> "Rubric":
        self.funcs.append(RewardFn(fn, weight, name, inline))
        return self

    async def score(self, state: EpisodeState) -> tuple[float, dict[str, float]]:
        if all(rf.inline and not inspect.iscoroutinefunction(rf.fn) for rf in self.funcs):
            values = [float(rf.fn(state)) for rf in self.funcs]  # no yield to the event loop
        else:
            values = await asyncio.gather(*(self._call(rf, state) for rf in self.funcs))
        reward = sum(rf.weight * v for rf, v in zip(self.funcs, values))
        return float(reward), {f"reward/{rf.name}": float(v) for rf, v in zip(self.funcs, values)}

    @staticmethod
    async def _call(rf: RewardFn, state: EpisodeState) -> float:
        if inspect.iscoroutinefunction(rf.fn):
            return float(await rf.fn(state))
        if rf.inline:
            return float(rf.fn(state))
        return float(await asyncio.to_thread(rf.fn, state))
