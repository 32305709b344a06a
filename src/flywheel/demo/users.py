"""Simulated users of the demo: agent stacks that call the served model over HTTP.

One episode: POST /v1/chat/completions with the question (and the task's tool schemas, when
it has them: then the server parses calls into `tool_calls`, else they stay in the text); when
the reply calls `calc`, run it (the user's side executes tools, as with any OpenAI-compatible
server) and send the result back; the first reply without a call is the final answer. Then the outcome goes to
POST /v1/traces/{id}/feedback on the final turn's trace (score + verifier), and sometimes a
corrected turn on the turn that went wrong (world.correction_for). Feedback is sent after the
day's traffic, when the server has written its traces (a 404 for a trace not yet written is
retried).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any

from flywheel.demo.world import ENV, call_expression, correction_for

MAX_TURNS = 3


@dataclass
class Episode:
    family: str
    task: Any  # flywheel.types.Task
    trace_ids: list[str] = field(default_factory=list)  # one per turn (the server's response ids)
    called: str | None = None  # the calc expression of the first call
    final: str = ""
    success: bool = False
    completion_tokens: int = 0
    error: str | None = None


async def play(http, task, family: str, max_tokens: int = 120) -> Episode:
    """One episode against the server at `http` (an httpx.AsyncClient on .../v1)."""
    from flywheel.envs.calculator import evaluate, final_number

    ep = Episode(family, task)
    messages = [dict(m) for m in task.prompt]
    tools = {"tools": task.tools} if task.tools else {}
    for _ in range(MAX_TURNS):
        r = await http.post("/chat/completions", json={"model": "flywheel", "messages": messages,
                                                       "max_tokens": max_tokens, "temperature": 0, **tools})
        if r.status_code != 200:
            ep.error = f"HTTP {r.status_code}: {r.text[:200]}"
            return ep
        body = r.json()
        ep.trace_ids.append(body["id"])
        ep.completion_tokens += body["usage"]["completion_tokens"]
        message = body["choices"][0]["message"]
        text = message["content"] or ""
        call = next((c for c in message.get("tool_calls") or [] if c["function"]["name"] == "calc"), None)
        expression = _argument(call) if call else call_expression(text)
        if expression is None:
            ep.final = text
            break
        if ep.called is None:
            ep.called = expression
        try:
            result = str(evaluate(expression))
        except ValueError as e:
            result = f"error: {e}"
        if call:  # the OpenAI way: the assistant turn with its calls, then the result for the call's id
            messages += [{"role": "assistant", "content": message["content"], "tool_calls": message["tool_calls"]},
                         {"role": "tool", "content": result, "tool_call_id": call["id"]}]
        else:
            messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
    ep.success = final_number(ep.final) == task.answer
    return ep


def _argument(call: dict) -> str | None:
    """A parsed calc call's `expression` argument (None when its arguments are not the schema's)."""
    try:
        arguments = json.loads(call["function"]["arguments"])
    except (json.JSONDecodeError, TypeError):
        return None
    expression = arguments.get("expression") if isinstance(arguments, dict) else None
    return expression if isinstance(expression, str) else None


def feedback_for(ep: Episode, rng: random.Random, correction_rate: float) -> list[tuple[str, dict]]:
    """(trace id, feedback) to send for a finished episode."""
    if not ep.trace_ids:
        return []
    out = [(ep.trace_ids[-1], {"score": 1.0 if ep.success else 0.0, "idempotency_key": f"{ep.trace_ids[-1]}/outcome",
                               "verifier": {"env": ENV, "task": dataclasses.asdict(ep.task)}})]
    if not ep.success and rng.random() < correction_rate:
        turn, message = correction_for(ep.task.metadata["expression"], ep.task.answer, ep.called, bool(ep.task.tools))
        trace_id = ep.trace_ids[turn]
        out.append((trace_id, {"correction": message, "idempotency_key": f"{trace_id}/correction"}))
    return out


async def post_feedback(http, items: list[tuple[str, dict]], concurrency: int = 16, retries: int = 50) -> int:
    """Send every item; a trace the server has not written yet (404) is retried. Returns the count sent."""
    gate = asyncio.Semaphore(concurrency)

    async def one(trace_id: str, body: dict) -> None:
        async with gate:
            for attempt in range(retries):
                r = await http.post(f"/traces/{trace_id}/feedback", json=body)
                if r.status_code == 200:
                    return
                if r.status_code != 404:
                    raise RuntimeError(f"feedback on {trace_id} refused: HTTP {r.status_code} {r.text[:300]}")
                await asyncio.sleep(0.1 * (attempt + 1))
            raise RuntimeError(f"trace {trace_id} never appeared in the store")

    await asyncio.gather(*(one(t, b) for t, b in items))
    return len(items)


async def run_day(url: str, work: list[tuple[str, Any]], concurrency: int, correction_rate: float, seed: str,
                  on_episode=None) -> list[Episode]:
    """Play every (family, task) with `concurrency` users at once, then send all feedback."""
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async def one(family: str, task) -> Episode:
            async with gate:
                ep = await play(http, task, family)
            if on_episode is not None:
                on_episode(ep)
            return ep

        episodes = await asyncio.gather(*(one(f, t) for f, t in work))
        rng = random.Random(seed)
        items = [item for ep in episodes for item in feedback_for(ep, rng, correction_rate)]
        await post_feedback(http, items)
    return list(episodes)
