"""Envs built from a task, tools and a rubric.

`ToolEnv` runs the multi-turn loop: the assistant's text is parsed for tool calls; each call
is executed (never raising: errors come back as tool messages and are counted); the episode
ends when the assistant answers without calling a tool, when a tool marks it finished (e.g.
`submit`), or at the limits, and the rubric scores it. `SingleTurnEnv` is the one-answer case.
"""

from __future__ import annotations

from time import monotonic  # a name of this module, so tests can move the clock
from dataclasses import dataclass
from typing import Callable

from flywheel.envs.base import Env, StepResult
from flywheel.models.tool_calls import HermesParser, ToolCallParser
from flywheel.envs.rubric import EpisodeState, Rubric
from flywheel.envs.tools import EpisodeFinished, Tool, ToolError  # noqa: F401  (EpisodeFinished re-exported)
from flywheel.types import Message, Task

TRUNCATION_MARKER = "\n[... output truncated: {dropped} more tokens]"


@dataclass(frozen=True)
class ToolLimits:
    max_turns: int = 8  # assistant turns per episode
    max_tool_calls_per_turn: int = 4  # calls beyond this get an error message, not executed
    max_observation_tokens: int = 512  # a tool result longer than this is cut, with a marker
    episode_timeout_s: float = 120.0  # wall clock from the first step; then the episode ends with reward 0


class SingleTurnEnv(Env):
    """One answer, scored by the rubric."""

    def __init__(self, task: Task, rubric: Rubric):
        self.task, self.rubric = task, rubric
        self.state = EpisodeState(task=task)

    async def initial_observation(self) -> list[Message] | str:
        return self.task.prompt

    async def step(self, action: str) -> StepResult:
        self.state.turns += 1
        self.state.final_text = action
        self.state.messages.append({"role": "assistant", "content": action})
        reward, metrics = await self.rubric.score(self.state)
        return StepResult([], reward, True, metrics)


class ToolEnv(Env):
    def __init__(self, task: Task, tools: list[Tool], rubric: Rubric, limits: ToolLimits = ToolLimits(),
                 parser: ToolCallParser | None = None, count_tokens: Callable[[str], int] | None = None):
        """count_tokens: the policy tokenizer's length function, for max_observation_tokens
        (default: UTF-8 bytes, exact for byte-level tokenizers and an upper bound otherwise)."""
        self.task, self.rubric, self.limits = task, rubric, limits
        self.tool_map = {t.name: t for t in tools}
        self.tools = task.tools if task.tools is not None else [t.schema for t in tools]
        self.parser = parser or HermesParser()
        self.count_tokens = count_tokens or (lambda s: len(s.encode()))
        self.state = EpisodeState(task=task, messages=list(task.prompt) if isinstance(task.prompt, list) else [])
        self.counts = {"tool_calls": 0, "tool_errors": 0, "malformed_calls": 0, "unknown_tool": 0,
                       "bad_arguments": 0, "tool_exceptions": 0, "tool_timeouts": 0, "calls_over_limit": 0,
                       "truncated_observations": 0}
        self._started: float | None = None

    async def initial_observation(self) -> list[Message] | str:
        return self.task.prompt

    async def step(self, action: str) -> StepResult:
        if self._started is None:
            self._started = monotonic()
        st = self.state
        st.turns += 1
        parsed = self.parser.parse(action)
        for i, call in enumerate(parsed.tool_calls):
            call.id = f"call_{st.turns}_{i}"  # unique within the episode
        st.messages.append({"role": "assistant", "content": parsed.content,
                            **({"tool_calls": [c.to_message_part() for c in parsed.tool_calls]}
                               if parsed.tool_calls else {})})
        if not parsed.tool_calls and not parsed.errors:  # a final answer
            st.final_text = parsed.content
            if self._timed_out():
                st.metrics["episode_timeout"] = 1.0
            return await self._finish()
        observation: list[Message] = []
        for err in parsed.errors:
            self._count("malformed_calls")
            observation.append(self._tool_message(self._clip(f"error: {err}")))
        finished = False
        for i, call in enumerate(parsed.tool_calls):
            if i >= self.limits.max_tool_calls_per_turn:
                self._count("calls_over_limit")
                observation.append(self._tool_message(
                    f"error: at most {self.limits.max_tool_calls_per_turn} tool calls per turn; "
                    f"{call.name} was not run"))
                continue
            st.tool_calls.append(call)
            self.counts["tool_calls"] += 1
            text, finished = await self._run(call)
            observation.append(self._tool_message(text, call.id))
            if finished:
                break
        if finished or st.turns >= self.limits.max_turns or self._timed_out():
            if self._timed_out():
                st.metrics["episode_timeout"] = 1.0
            return await self._finish(observation)
        return StepResult(observation, 0.0, False, {})

    async def _run(self, call) -> tuple[str, bool]:
        tool = self.tool_map.get(call.name)
        if tool is None:
            self._count("unknown_tool")
            return self._clip(f"error: unknown tool {call.name!r}; available: {', '.join(self.tool_map)}"), False
        try:
            return self._clip(await tool.call(call.arguments)), False
        except EpisodeFinished as done:
            self.state.submitted = done.value
            return str(done), True
        except ToolError as e:
            self._count({"bad_arguments": "bad_arguments", "timeout": "tool_timeouts"}.get(e.kind, "tool_exceptions"))
            return self._clip(f"error: {e}"), False

    def _count(self, key: str) -> None:
        self.counts[key] += 1
        if key not in ("calls_over_limit", "truncated_observations"):
            self.counts["tool_errors"] += 1

    def _clip(self, text: str) -> str:
        limit = self.limits.max_observation_tokens
        n = self.count_tokens(text)
        if n <= limit:
            return text
        self.counts["truncated_observations"] += 1
        lo, hi = 0, len(text)  # the longest prefix within the limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.count_tokens(text[:mid]) <= limit else (lo, mid - 1)
        return text[:lo] + TRUNCATION_MARKER.format(dropped=n - self.count_tokens(text[:lo]))

    @staticmethod
    def _tool_message(content: str, call_id: str | None = None) -> Message:
        msg = {"role": "tool", "content": content}
        if call_id:
            msg["tool_call_id"] = call_id
        return msg

    def _timed_out(self) -> bool:
        return self._started is not None and monotonic() - self._started > self.limits.episode_timeout_s

    async def _finish(self, observation: list[Message] | None = None) -> StepResult:
        if observation:
            self.state.messages.extend(observation)
        if self.state.metrics.get("episode_timeout"):
            reward, metrics = 0.0, {}
        else:
            reward, metrics = await self.rubric.score(self.state)
        metrics = {**metrics, **{k: float(v) for k, v in self.counts.items()}, **self.state.metrics,
                   "turns": float(self.state.turns)}
        return StepResult([], reward, True, metrics)
