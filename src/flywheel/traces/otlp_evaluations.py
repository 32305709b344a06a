"""A run's `gen_ai.evaluation.result` events as flywheel feedback (see otlp.py): pure.

The GenAI semantic conventions record the outcome of evaluating a GenAI output as a
`gen_ai.evaluation.result` event parented to the evaluated span. It reaches a trace export in
two forms, both read here:
- a span event named `gen_ai.evaluation.result` on one of the run's spans (the agent's, a
  chat's), its attributes the event's;
- a span of its own (zero length, under the evaluated span) carrying the event's attributes
  (`gen_ai.evaluation.name` and no `gen_ai.operation.name`): what emitters that cannot add
  an event to a finished span write.
(The log-record form of the event travels over OTLP logs, which this endpoint does not take.)

Each evaluation becomes one FeedbackIn, source "user" (the caller's evaluator, not flywheel's
judge): `score` <- `gen_ai.evaluation.score.value` (a number), `label` <-
`gen_ai.evaluation.score.label`, `text` <- "<gen_ai.evaluation.name>: <gen_ai.evaluation.explanation>",
`created_at` <- the event's time (a span's end), idempotency key
`otlp:<traceId>:<spanId>:<event index>` (`...:span` for the span form), so a re-sent export
adds nothing. flywheel's extension for verifiable tasks: `flywheel.verifier.env` (an
environment's name) and `flywheel.verifier.task` (a JSON object, as text or a kvlist) on the
evaluation, else on the run's `invoke_agent` span, are the feedback's `verifier`: the trace
becomes an RL task that environment replays and grades, and its held-out failures are the
gate's new-failure suite. An evaluation that cannot be read raises ContentError naming the
span, the event and the attribute.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta, timezone
from typing import Any

from pydantic import ValidationError

from flywheel.traces.otlp_envelope import Span
from flywheel.traces.otlp_messages import ContentError
from flywheel.traces.schema import FeedbackIn, describe

EVENT = "gen_ai.evaluation.result"
NAME, SCORE, LABEL = "gen_ai.evaluation.name", "gen_ai.evaluation.score.value", "gen_ai.evaluation.score.label"
EXPLANATION = "gen_ai.evaluation.explanation"
VERIFIER_ENV, VERIFIER_TASK = "flywheel.verifier.env", "flywheel.verifier.task"


def run_feedback(run: list[Span]) -> list[tuple[str, dict[str, Any]]]:
    """(where, FeedbackIn as a dict) of each evaluation in the run, in the run's order."""
    agent = next((s for s in run if s.operation == "invoke_agent"), None)
    out = []
    for span in run:
        if span.evaluation:
            out.append(_feedback(span, span.path, span.attributes, f"otlp:{span.trace_id}:{span.span_id}:span",
                                 span.end_ns or span.start_ns, agent))
        for i, (name, attrs) in enumerate(span.events):
            if name == EVENT:
                when = span.event_times[i] if i < len(span.event_times) else 0
                out.append(_feedback(span, f"{span.path}.events[{i}]", attrs,
                                     f"otlp:{span.trace_id}:{span.span_id}:{i}", when, agent))
    return out


def evaluations_in(span: Span) -> int:
    """How many evaluations a span holds (itself, its events)."""
    return int(span.evaluation) + sum(name == EVENT for name, _ in span.events)


def _feedback(span: Span, where: str, attrs: dict[str, Any], key: str, when_ns: int,
              agent: Span | None) -> tuple[str, dict[str, Any]]:
    name = attrs.get(NAME)
    if not isinstance(name, str) or not name.strip():
        raise ContentError(f"{where}: {NAME}: required, a non-empty string (got {name!r})")
    body: dict[str, Any] = {"source": "user", "idempotency_key": key}
    score = attrs.get(SCORE)
    if score is not None:
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise ContentError(f"{where}: {SCORE}: expected a finite number, got {score!r}"[:300])
        body["score"] = float(score)
    label = attrs.get(LABEL)
    if label is not None:
        if not isinstance(label, str) or not 1 <= len(label.strip()) <= 200:
            raise ContentError(f"{where}: {LABEL}: expected a string of 1 to 200 characters, got {label!r}"[:300])
        body["label"] = label.strip()
    explanation = attrs.get(EXPLANATION)
    if explanation is not None and not isinstance(explanation, str):
        raise ContentError(f"{where}: {EXPLANATION}: expected a string, got {explanation!r}"[:300])
    body["text"] = f"{name.strip()}: {explanation}" if explanation else name.strip()
    verifier = _verifier(attrs, where) or (_verifier(agent.attributes, agent.path) if agent is not None else None)
    if verifier is not None:
        body["verifier"] = verifier
    if when_ns:
        body["created_at"] = _iso(when_ns)
    try:
        FeedbackIn.model_validate(body)
    except ValidationError as e:
        raise ContentError(f"{where}: {describe(e)}") from None
    return where, body


def _verifier(attrs: dict[str, Any], where: str) -> dict[str, Any] | None:
    env, task = attrs.get(VERIFIER_ENV), attrs.get(VERIFIER_TASK)
    if env is None and task is None:
        return None
    if not isinstance(env, str) or not env.strip():
        raise ContentError(f"{where}: {VERIFIER_ENV}: required with {VERIFIER_TASK}, an environment's name "
                           f"(got {env!r})")
    if task is None:
        raise ContentError(f"{where}: {VERIFIER_TASK}: required with {VERIFIER_ENV}, a JSON object "
                           "(e.g. {\"answer\": \"474\"})")
    if isinstance(task, str):
        try:
            task = json.loads(task)
        except json.JSONDecodeError as e:
            raise ContentError(f"{where}: {VERIFIER_TASK}: not valid JSON ({e})") from None
    if not isinstance(task, dict):
        raise ContentError(f"{where}: {VERIFIER_TASK}: expected a JSON object, got {type(task).__name__}")
    return {"env": env.strip(), "task": task}


def _iso(ns: int) -> str:
    t = datetime.fromtimestamp(ns // 10 ** 9, timezone.utc) + timedelta(microseconds=(ns % 10 ** 9) // 1000)
    return t.isoformat()
