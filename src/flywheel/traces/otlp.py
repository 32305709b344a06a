"""OTLP trace exports (OpenTelemetry GenAI spans) as flywheel traces: pure, no web imports.

`convert(body)` takes an ExportTraceServiceRequest in the OTLP/JSON mapping (what an OTLP/HTTP
client posts as application/json; serve/otlp/codec.py turns a protobuf body into the same
dict): `{"resourceSpans": [{"resource": {"attributes": [...]}, "scopeSpans": [{"scope":
{"name"}, "spans": [{"traceId": 32 hex, "spanId": 16 hex, "parentSpanId", "name",
"startTimeUnixNano", "endTimeUnixNano", "attributes": [{"key", "value": AnyValue}],
"events": [{"name", "timeUnixNano", "attributes"}]}]}]}]}`, AnyValue one of stringValue,
boolValue, intValue (a number or a decimal string), doubleValue, arrayValue {values},
kvlistValue {values: [{key, value}]}, bytesValue (base64). Unknown keys are ignored, as the
OTLP spec asks of receivers. An envelope that breaks these rules raises `OtlpMalformed`
naming the field (`resourceSpans[0].scopeSpans[1].spans[3].traceId: expected 32 hex
characters`): the whole request is refused.

Which spans count. A span is a GenAI span when an attribute or an event name starts with
`gen_ai.`; the others are counted and ignored. What a span says of its chat is read by
otlp_messages.py (the conventions' message attributes, the older flattened attributes, the
older events).

One agent run, one trace. GenAI spans are grouped into runs: a span belongs to its nearest
`invoke_agent` span (`gen_ai.operation.name`; itself when it is one) found in the same
export, walking parents through any span; spans with no such ancestor group by traceId. The
run's chat spans (those carrying messages; the agent span's own messages only when no chat
span under it has any) are stitched in start-time order: a span whose input begins with the
conversation so far replaces it (the agent resent its history, the usual case, so the last
call's input is the whole run), otherwise its input is appended (the agent sent only the new
turn; system messages already held are not repeated). The output of every call but the last
is appended as the assistant turn; when the next call's input lacks a tool call's result, the
run's `execute_tool` span with that `gen_ai.tool.call.id` supplies it
(`gen_ai.tool.call.result`). The last call's first output is the trace's `response`.

The trace: `messages`, `tools` (the last call's, else the run's), `response`, `model`
(gen_ai.response.model, else gen_ai.request.model, of the last call), `usage` (input and
output tokens summed over the calls that report them), `latency_ms` (first start to last end
of the run's spans), `created_at` (the run's first start), `source` "otlp:<service.name>",
`metadata.otel` (trace and span ids, service, scope, agent, finish reason), and the
idempotency key `otlp:<traceId>:<spanId of the last call>`: re-sending an export stores
nothing new. A run whose content cannot be read is rejected whole, its spans counted, with
the reason naming the span and attribute.

Outcomes. The run's `gen_ai.evaluation.result` evaluations (span events, or zero-length spans
of their own under the evaluated span: otlp_evaluations.py) are its trace's `feedback`, each
a FeedbackIn (score, label, text, a verifier from flywheel's `flywheel.verifier.env` /
`flywheel.verifier.task` attributes) with an idempotency key of its trace, span and event
index. An evaluation span is a GenAI span (never an ignored one) and belongs to the run of
its parents; one whose parents are not in the export joins the run whose chat span has its
`gen_ai.response.id`, else it is counted (`orphan_evaluations`): a run's evaluations must
arrive in the run's export. A malformed evaluation (a score that is not a number, a task
that is not a JSON object) rejects its run, as malformed content does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from flywheel.traces.otlp_envelope import OtlpMalformed, Span, parse_request
from flywheel.traces.otlp_evaluations import evaluations_in, run_feedback
from flywheel.traces.otlp_messages import ContentError, Message, SpanChat, span_chat

__all__ = ["Conversion", "OtlpMalformed", "OtlpTrace", "RunError", "Span", "convert"]


@dataclass
class RunError:
    span_paths: list[str]  # the spans rejected with it (the whole run)
    message: str  # names the span and the attribute


@dataclass
class OtlpTrace:
    record: dict[str, Any]  # a TraceIn
    span_paths: list[str]  # the run's GenAI spans
    last_call: str  # the path of the span whose output is the response
    feedback: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (where, FeedbackIn) per evaluation


@dataclass
class Conversion:
    spans: int = 0  # in the request
    ignored: int = 0  # without GenAI attributes
    no_content: int = 0  # GenAI spans of runs that carried no messages (content capture off?)
    orphan_evaluations: int = 0  # evaluations with no run of the export to go to
    traces: list[OtlpTrace] = field(default_factory=list)
    errors: list[RunError] = field(default_factory=list)

    @property
    def rejected_spans(self) -> int:
        return sum(len(e.span_paths) for e in self.errors)


def convert(body: Any) -> Conversion:
    """An OTLP/JSON ExportTraceServiceRequest as traces, counts and per-run errors; raises
    OtlpMalformed for a body that breaks the envelope's rules."""
    spans = parse_request(body)
    out = Conversion(spans=len(spans))
    genai = [s for s in spans if s.genai]
    out.ignored = len(spans) - len(genai)
    for run in attach_by_response_id(group_runs(spans, genai)):
        try:
            built = build_trace(run)
            feedback = run_feedback(run) if built is not None else []
        except ContentError as e:
            out.errors.append(RunError([s.path for s in run], str(e)))
            continue
        if built is None:
            out.no_content += sum(not s.evaluation for s in run)
            out.orphan_evaluations += sum(evaluations_in(s) for s in run)
        else:
            out.traces.append(OtlpTrace(built[0], [s.path for s in run], built[1], feedback))
    return out


# ---------------------------------------------------------------- runs

def group_runs(spans: list[Span], genai: list[Span]) -> list[list[Span]]:
    """The GenAI spans by agent run (see the module's text), each run in start-time order."""
    by_id = {(s.trace_id, s.span_id): s for s in spans}
    runs: dict[tuple[str, str], list[Span]] = {}
    for span in genai:
        runs.setdefault((span.trace_id, _agent_of(span, by_id)), []).append(span)
    return [sorted(run, key=lambda s: (s.start_ns, s.order)) for run in runs.values()]


def attach_by_response_id(runs: list[list[Span]]) -> list[list[Span]]:
    """Runs made only of evaluation spans (their evaluated span was not among their parents in
    the export) join the run whose span answered with their `gen_ai.response.id`."""
    by_response: dict[str, list[Span]] = {}
    for run in runs:
        for span in run:
            rid = span.attributes.get("gen_ai.response.id")
            if not span.evaluation and isinstance(rid, str) and rid:
                by_response.setdefault(rid, run)
    out = []
    for run in runs:
        target = None
        if all(s.evaluation for s in run):
            target = next((by_response[r] for s in run if isinstance(r := s.attributes.get("gen_ai.response.id"), str)
                           and r in by_response), None)
        if target is None:
            out.append(run)
        else:
            target.extend(run)
    return out


def _agent_of(span: Span, by_id: dict[tuple[str, str], Span]) -> str:
    seen: set[str] = set()
    node: Span | None = span
    while node is not None and node.span_id not in seen:
        if node.operation == "invoke_agent":
            return node.span_id
        seen.add(node.span_id)
        node = by_id.get((span.trace_id, node.parent_id)) if node.parent_id else None
    return ""


def build_trace(run: list[Span]) -> tuple[dict[str, Any], str] | None:
    """(the TraceIn of one run, the path of its last call), or None when none of its spans
    carries messages."""
    chats = []
    for span in run:
        try:
            chat = span_chat(span.attributes, span.events)
        except ContentError as e:
            raise ContentError(f"{span.path}: {e}") from None
        if not chat.empty:
            chats.append((span, chat))
    if any(s.operation != "invoke_agent" for s, _ in chats):
        chats = [(s, c) for s, c in chats if s.operation != "invoke_agent"]
    if not chats:
        return None
    messages = _stitch(chats, _tool_results(run))
    last, last_chat = chats[-1]
    if not messages:
        raise ContentError(f"{last.path}: the chat has no input messages (gen_ai.input.messages)")
    record: dict[str, Any] = {"idempotency_key": f"otlp:{last.trace_id}:{last.span_id}",
                              "source": f"otlp:{last.service}"[:200], "messages": messages}
    timed = [s for s in run if not s.evaluation]  # an evaluation comes after the run: not part of its time
    starts = [s.start_ns for s in timed if s.start_ns]
    if starts:
        record["created_at"] = _iso(min(starts))
    if last_chat.outputs:
        record["response"] = last_chat.outputs[0]
    model = _str_attr(last, "gen_ai.response.model") or _str_attr(last, "gen_ai.request.model")
    if model:
        record["model"] = model[:200]
    tools = last_chat.tools or _union_tools(c.tools for _, c in chats)
    if tools:
        record["tools"] = tools
    usage = _usage([s for s, _ in chats])
    if usage:
        record["usage"] = usage
    ends = [s.end_ns for s in timed if s.start_ns and s.end_ns >= s.start_ns]
    if starts and ends:
        record["latency_ms"] = (max(ends) - min(starts)) / 1e6
    record["metadata"] = {"otel": _provenance(run, last, last_chat, len(chats))}
    return record, last.path


def _stitch(chats: list[tuple[Span, SpanChat]], tool_results: dict[str, str]) -> list[Message]:
    conversation: list[Message] = []
    for n, (_, chat) in enumerate(chats):
        inputs = chat.inputs
        if _starts_with(inputs, conversation):
            conversation = list(inputs)
        else:
            conversation += [m for m in inputs if not (m["role"] in ("system", "developer")
                                                       and any(_same(m, c) for c in conversation))]
        if n == len(chats) - 1 or not chat.outputs:
            continue
        answer = chat.outputs[0]
        conversation.append(answer)
        answered = {m.get("tool_call_id") for m in chats[n + 1][1].inputs if m["role"] == "tool"}
        for call in answer.get("tool_calls") or []:
            call_id = call.get("id")
            if call_id and call_id not in answered and call_id in tool_results:
                conversation.append({"role": "tool", "tool_call_id": call_id, "content": tool_results[call_id]})
    return conversation


def _key(m: Message) -> tuple:
    """What makes two messages the same turn (tool-call arguments may be re-encoded between calls)."""
    content = m.get("content")
    calls = tuple((c.get("id"), c["function"]["name"]) for c in m.get("tool_calls") or [])
    return m["role"], content if isinstance(content, str) or content is None else repr(content), calls, \
        m.get("tool_call_id")


def _same(a: Message, b: Message) -> bool:
    return _key(a) == _key(b)


def _starts_with(messages: list[Message], prefix: list[Message]) -> bool:
    return len(messages) >= len(prefix) and all(_same(a, b) for a, b in zip(messages, prefix))


def _tool_results(run: list[Span]) -> dict[str, str]:
    """tool call id -> result, from the run's execute_tool spans."""
    out = {}
    for span in run:
        call_id, result = span.attributes.get("gen_ai.tool.call.id"), span.attributes.get("gen_ai.tool.call.result")
        if span.operation == "execute_tool" and isinstance(call_id, str) and result is not None:
            out[call_id] = result if isinstance(result, str) else _json(result)
    return out


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _union_tools(lists) -> list[dict]:
    seen: dict[str, dict] = {}
    for tools in lists:
        for tool in tools:
            seen.setdefault(tool["function"]["name"], tool)
    return list(seen.values())


def _usage(spans: list[Span]) -> dict[str, int] | None:
    prompt = completion = 0
    found = False
    for span in spans:
        inp = _count(span, "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens")
        out = _count(span, "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens")
        if inp is not None or out is not None:
            found = True
            prompt += inp or 0
            completion += out or 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion} if found else None


def _count(span: Span, *names: str) -> int | None:
    for name in names:
        value = span.attributes.get(name)
        if value is None:
            continue
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ContentError(f"{span.path}: {name}: expected a non-negative integer, got {value!r}")
        return value
    return None


def _str_attr(span: Span, name: str) -> str | None:
    value = span.attributes.get(name)
    return value if isinstance(value, str) and value else None


def _provenance(run: list[Span], last: Span, chat: SpanChat, turns: int) -> dict[str, Any]:
    agent = next((s for s in run if s.operation == "invoke_agent"), None)
    facts = {
        "trace_id": last.trace_id, "span_id": last.span_id, "span_ids": [s.span_id for s in run],
        "agent_span_id": agent.span_id if agent else None, "service_name": last.service, "scope": last.scope or None,
        "operation": last.operation, "turns": turns,
        "provider": _str_attr(last, "gen_ai.provider.name") or _str_attr(last, "gen_ai.system"),
        "agent_name": next((_str_attr(s, "gen_ai.agent.name") for s in run if _str_attr(s, "gen_ai.agent.name")), None),
        "conversation_id": next((_str_attr(s, "gen_ai.conversation.id") for s in run
                                 if _str_attr(s, "gen_ai.conversation.id")), None),
        "response_id": _str_attr(last, "gen_ai.response.id"),
        "finish_reason": chat.finish_reasons[0] if chat.finish_reasons else None,
        "choices": len(chat.outputs) if len(chat.outputs) > 1 else None,
    }
    return {k: v for k, v in facts.items() if v is not None}


def _iso(ns: int) -> str:
    t = datetime.fromtimestamp(ns // 10 ** 9, timezone.utc) + timedelta(microseconds=(ns % 10 ** 9) // 1000)
    return t.isoformat()
