"""Demonstrations: play an environment's scripted policy and keep the solved episodes as SFT rows.

Each kept episode becomes one row of the OpenAI chat fine-tuning format that `flywheel sft`
reads (see train/sft_data.py):

    {"messages": [system, user, assistant(tool_calls), tool, ..., assistant(final answer)],
     "tools": [the task's tool schemas]}

Assistant turns are stored *parsed*: the text the policy wrote goes through the env's tool-call
parser (Hermes by default), so calls become `tool_calls` entries (arguments as a JSON string,
ids `call_<turn>_<i>` as ToolEnv numbers them) and the text around them becomes `content`.
Rendering a row through the chat template therefore produces assistant text that parses back
to the same calls: what the model learns to emit is exactly what the env reads.

`bare=True` drops the system message and the tool schemas. The assistant turns stay the same,
but the row is several times shorter (for calculator ~180 tokens instead of ~1,000, most of
it the tool block): a cheap first SFT stage that teaches the turn structure and the copying
of numbers before a short stage on full rows. The env always shows the full prompt, so bare
rows alone do not make a working policy.

An episode is skipped, and counted by reason, when it ended in an error, scored below
`min_reward`, is a raw-text (non-chat) episode, wrote a malformed tool call, or did not end
with a final answer (e.g. it ran out of turns).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flywheel.envs.base import Environment, Policy
from flywheel.models.tool_calls import HermesParser, ToolCallParser
from flywheel.rollout.play import EpisodeResult, play
from flywheel.types import Message


@dataclass
class DemoReport:
    episodes: int = 0
    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    seconds: float = 0.0

    def summary(self) -> str:
        head = f"{self.kept} of {self.episodes} episodes kept"
        if not self.skipped:
            return head
        return head + "; skipped: " + ", ".join(f"{n} {why}" for why, n in self.skipped.most_common())


class EpisodeSkipped(Exception):
    """An episode that cannot become a demo; the message is the reason (a count key)."""


def episode_to_row(result: EpisodeResult, parser: ToolCallParser | None = None,
                   bare: bool = False) -> dict[str, Any]:
    """One played episode -> one OpenAI chat SFT row (without system message and tools when
    `bare`). Raises EpisodeSkipped with the reason."""
    parser = parser or HermesParser()
    transcript = result.transcript
    if isinstance(transcript, str):
        raise EpisodeSkipped("raw-text episode (not chat)")
    messages: list[Message] = []
    turn = 0
    for m in transcript:
        if m.get("role") == "system" and bare:
            continue
        if m.get("role") != "assistant":
            messages.append(_clean_other(m))
            continue
        turn += 1
        parsed = parser.parse(m.get("content") or "")
        if parsed.errors:
            raise EpisodeSkipped("malformed tool call")
        out: Message = {"role": "assistant", "content": parsed.content or None}
        if parsed.tool_calls:
            out["tool_calls"] = [{"id": f"call_{turn}_{i}", "type": "function",
                                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                 for i, c in enumerate(parsed.tool_calls)]
        elif not parsed.content:
            raise EpisodeSkipped("empty assistant turn")
        messages.append(out)
    if not messages or messages[-1]["role"] != "assistant" or "tool_calls" in messages[-1]:
        raise EpisodeSkipped("no final answer (out of turns)")
    return {"messages": messages} if bare else {"messages": messages, "tools": list(result.task.tools or [])}


def _clean_other(m: Message) -> Message:
    """System, user and tool messages with the keys the chat format knows."""
    keys = ("role", "content", "tool_call_id") if m.get("role") == "tool" else ("role", "content")
    return {k: m[k] for k in keys if k in m}


async def collect_demos(env: Environment, tasks, policy: Policy | None = None, min_reward: float = 1.0,
                        parser: ToolCallParser | None = None, bare: bool = False, concurrency: int = 64,
                        timeout_s: float = 300.0) -> tuple[list[dict], DemoReport]:
    """Play `policy` (default: the env's scripted policy) once per task; rows of the episodes
    that scored at least `min_reward`, in task order, and the counts."""
    t0 = time.perf_counter()
    if policy is None:
        try:
            policy = env.scripted_policy()
        except NotImplementedError as e:
            raise ValueError(str(e)) from None
    results = await play(env, list(tasks), policy, concurrency=concurrency, timeout_s=timeout_s)
    rows, report = [], DemoReport(episodes=len(results))
    for r in results:
        try:
            if r.error:
                raise EpisodeSkipped("timeout" if r.error == "timeout" else f"error ({r.error.split(':')[0]})")
            if r.reward < min_reward:
                raise EpisodeSkipped(f"reward below {min_reward:g}")
            rows.append(episode_to_row(r, parser, bare))
        except EpisodeSkipped as why:
            report.skipped[str(why)] += 1
    report.kept = len(rows)
    report.seconds = time.perf_counter() - t0
    return rows, report


def make_demos(env: Environment, n: int, split: str = "train", seed: int = 0, min_reward: float = 1.0,
               out: str | Path | None = None, bare: bool = False) -> tuple[list[dict], DemoReport]:
    """Scripted demos on the first `n` tasks of `split` (seeded); written as JSONL to `out`
    when given (its folder is created; the file is opened before any episode is played, so
    an unwritable path fails at once). ValueError on bad arguments."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    handle = _open_for_writing(out) if out is not None else None
    try:
        tasks = env.tasks(split, n=n, seed=seed)
        if not tasks:
            raise ValueError(f"environment {env.name!r} has no {split!r} tasks")
        rows, report = asyncio.run(collect_demos(env, tasks, min_reward=min_reward, bare=bare))
        if handle is not None:
            for row in rows:
                handle.write(json.dumps(row) + "\n")
    finally:
        if handle is not None:
            handle.close()
    return rows, report


def _open_for_writing(path: str | Path):
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"--out {str(path)!r} is a folder; give a .jsonl file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "w", encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write {str(path)!r}: {e.strerror or e}") from None
