"""A calculator agent instrumented with OpenTelemetry, whose traffic reaches flywheel over OTLP only.

The agent asks a flywheel-served model arithmetic questions ("What is 512 minus 38?") through
the official `openai` client, offering the calculator environment's `calc` tool; it runs the
calls the model makes and sends their results back, until the model answers. It records its
work as the GenAI semantic conventions say, the way the openai instrumentation records it:
one `invoke_agent` span per question, a `chat` span per model call (gen_ai.input.messages,
gen_ai.output.messages, gen_ai.tool.definitions, usage, response id and model) and an
`execute_tool` span per tool call. Then it checks the answer itself and records the outcome
as a `gen_ai.evaluation.result` event on the agent span, with flywheel's verifier attributes
(`flywheel.verifier.env: calculator`, `flywheel.verifier.task: {"answer": "474"}`), so a
failed run becomes an RL task the calculator environment replays and grades.

The spans go out through the SDK's BatchSpanProcessor and OTLP/HTTP protobuf exporter to
flywheel's /otlp/v1/traces (derived from --base-url unless --otlp-endpoint says otherwise):
no feedback call, no second channel. flywheel stitches a run from the spans of one export, so
the agent flushes at the end of each run (and the processor's own timer is set past any run's
length): a timer firing mid-run would send the run in two parts.

    python examples/otel_agent.py --base-url http://127.0.0.1:8000/v1 --requests 40 --seed 0
"""

from __future__ import annotations

import argparse
import json
import operator
import random
import re

from loop_traffic import calc  # the sibling example's calc tool (examples/ is on the path when run)
from openai import OpenAI
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Tracer

# the calculator environment's tool, as `flywheel env show calculator` prints it
TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression exactly.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string", "description":
        "numbers with + - * / // % ** and parentheses, e.g. \"(1234 * 567) + 89\"."}},
        "additionalProperties": False, "required": ["expression"]}}}]
OPS = {"plus": (operator.add, "What is {a} + {b}?"), "minus": (operator.sub, "What is {a} minus {b}?"),
       "times": (operator.mul, "What is {a} times {b}?")}


# ---------------------------------------------------------------- the conventions' message format

def to_parts(message: dict) -> dict:
    """An OpenAI chat message as a GenAI-conventions message ({"role", "parts"})."""
    parts = []
    if message.get("content"):
        parts.append({"type": "text", "content": message["content"]})
    for call in message.get("tool_calls") or []:
        parts.append({"type": "tool_call", "id": call["id"], "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"]})
    if message["role"] == "tool":
        return {"role": "tool", "parts": [{"type": "tool_call_response", "id": message["tool_call_id"],
                                           "response": message["content"]}]}
    return {"role": message["role"], "parts": parts}


def tool_definitions() -> str:
    return json.dumps([{"type": "function", **t["function"]} for t in TOOLS])


# ---------------------------------------------------------------- one run

def chat(client: OpenAI, tracer: Tracer, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One model call in a `chat` span; returns the assistant message (OpenAI format)."""
    with tracer.start_as_current_span(f"chat {model}", kind=SpanKind.CLIENT, attributes={
            "gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai", "gen_ai.request.model": model,
            "gen_ai.request.max_tokens": max_tokens, "gen_ai.request.temperature": 0.0,
            "gen_ai.input.messages": json.dumps([to_parts(m) for m in messages]),
            "gen_ai.tool.definitions": tool_definitions()}) as span:
        r = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, temperature=0,
                                           max_tokens=max_tokens)
        choice = r.choices[0]
        answer = {"role": "assistant", "content": choice.message.content or ""}
        if choice.message.tool_calls:
            answer["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": c.function.arguments}} for c in choice.message.tool_calls]
        span.set_attributes({
            "gen_ai.response.id": r.id, "gen_ai.response.model": r.model,
            "gen_ai.response.finish_reasons": [choice.finish_reason or "stop"],
            "gen_ai.output.messages": json.dumps([{**to_parts(answer), "finish_reason": choice.finish_reason}])})
        if r.usage is not None:
            span.set_attributes({"gen_ai.usage.input_tokens": r.usage.prompt_tokens,
                                 "gen_ai.usage.output_tokens": r.usage.completion_tokens})
        return answer


def run(client: OpenAI, tracer: Tracer, model: str, question: str, answer: str, max_tokens: int = 120,
        max_turns: int = 3) -> bool:
    """One agent run in an `invoke_agent` span, graded at its end by a `gen_ai.evaluation.result`
    event on that span; True when the final answer's last number is `answer`."""
    with tracer.start_as_current_span("invoke_agent calculator", attributes={
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "calculator",
            "gen_ai.provider.name": "openai", "gen_ai.request.model": model}) as agent:
        messages = [{"role": "user", "content": question}]
        reply = {"content": ""}
        for _ in range(max_turns):
            reply = chat(client, tracer, model, messages, max_tokens)
            messages.append(reply)
            if not reply.get("tool_calls"):
                break
            for call in reply["tool_calls"]:
                with tracer.start_as_current_span(f"execute_tool {call['function']['name']}", attributes={
                        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": call["function"]["name"],
                        "gen_ai.tool.call.id": call["id"], "gen_ai.tool.type": "function",
                        "gen_ai.tool.call.arguments": call["function"]["arguments"]}) as tool:
                    try:
                        expression = json.loads(call["function"]["arguments"])["expression"]
                        result = calc(expression) if call["function"]["name"] == "calc" else "error: unknown tool"
                    except (ValueError, SyntaxError, KeyError, TypeError, ZeroDivisionError) as e:
                        result = f"error: {e}"
                    tool.set_attribute("gen_ai.tool.call.result", result)
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
        numbers = re.findall(r"-?\d+", reply.get("content") or "")
        ok = bool(numbers) and numbers[-1] == answer
        agent.add_event("gen_ai.evaluation.result", {
            "gen_ai.evaluation.name": "calculator_answer", "gen_ai.evaluation.score.value": 1.0 if ok else 0.0,
            "gen_ai.evaluation.score.label": "correct" if ok else "wrong",
            "gen_ai.evaluation.explanation": f"expected {answer}, the answer's last number is "
                                             f"{numbers[-1] if numbers else 'missing'}",
            "flywheel.verifier.env": "calculator", "flywheel.verifier.task": json.dumps({"answer": answer})})
        return ok


def otlp_endpoint(base_url: str) -> str:
    """flywheel's OTLP traces route beside its OpenAI-compatible base URL (.../v1)."""
    root = base_url.rstrip("/")
    return (root[:-3] if root.endswith("/v1") else root) + "/otlp/v1/traces"


def tracer_provider(endpoint: str, api_key: str, service: str = "calc-agent") -> TracerProvider:
    tp = TracerProvider(resource=Resource.create({"service.name": service}))
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=30, headers={"authorization": f"Bearer {api_key}"})
    # exports happen at the flush after each run, not on a timer that may cut a run in two
    tp.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=600_000))
    return tp


def main(argv: list[str] | None = None) -> dict[str, list[int]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the flywheel server's OpenAI base URL")
    p.add_argument("--api-key", default="unused", help="a `flywheel keys create` key (any text without keys)")
    p.add_argument("--model", default="flywheel", help="the model to call, e.g. a managed flywheel's alias")
    p.add_argument("--requests", type=int, default=20, help="questions to ask (agent runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ops", default="plus,minus", help=f"comma-separated, of {', '.join(OPS)}; asked in turn")
    p.add_argument("--max-tokens", type=int, default=120, help="new tokens per reply")
    p.add_argument("--otlp-endpoint", default=None, help="default: /otlp/v1/traces beside --base-url")
    args = p.parse_args(argv)
    ops = args.ops.split(",")
    if unknown := [op for op in ops if op not in OPS]:
        p.error(f"--ops: unknown {unknown[0]!r} (valid: {', '.join(OPS)})")
    rng = random.Random(args.seed)
    client = OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=120)
    tp = tracer_provider(args.otlp_endpoint or otlp_endpoint(args.base_url), args.api_key)
    tracer = tp.get_tracer("examples.otel_agent")
    solved = {op: [0, 0] for op in ops}
    try:
        for i in range(args.requests):
            op = ops[i % len(ops)]
            fn, template = OPS[op]
            a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
            ok = run(client, tracer, args.model, template.format(a=a, b=b), str(fn(a, b)), args.max_tokens)
            solved[op][0] += ok
            solved[op][1] += 1
            tp.force_flush(30_000)  # this run's spans, in one export
    finally:
        tp.shutdown()  # flushes the batch processor: every run's spans are exported
    print(f"otel_agent: requests={args.requests} "
          + " ".join(f"{op}_solved={n}/{total}" for op, (n, total) in solved.items()))
    return solved


if __name__ == "__main__":
    main()
