"""Production traffic for `flywheel loop run`, through the public HTTP API only: the official
`openai` client for chat, plain HTTP for feedback. docs/loop.md walks through it.

Each episode asks one arithmetic question ("What is 123 + 45?", "What is 123 minus 45?") with
/v1/chat/completions; when the reply calls the `calc` tool (`<tool_call>{"name": "calc",
"arguments": {"expression": ...}}</tool_call>`), this script runs it, as any agent stack runs
its own tools, and sends the result back as a `tool` message; the first reply without a call
is the answer. Then it reports the outcome on the final turn's trace, whose id is the `id` of
that chat.completion response:

    POST /v1/traces/{id}/feedback  {"score": 0.0 or 1.0,
                                    "verifier": {"env": "calculator", "task": {"answer": "78"}}}

The verifier names the environment that grades a replay of the trace and the answer to grade
against; the trace itself (as served) is what the flywheel replays. On a failure it sometimes
also sends a corrected turn (`correction`): the call the model should have made.

    python examples/loop_traffic.py --url http://127.0.0.1:8000/v1 --episodes 300 --ops plus,minus
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import random
import re

import httpx
from openai import OpenAI

CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
# op -> (calc symbol, its function, how users ask)
OPS = {"plus": ("+", operator.add, "What is {a} + {b}?"), "minus": ("-", operator.sub, "What is {a} minus {b}?"),
       "times": ("*", operator.mul, "What is {a} times {b}?")}
_AST_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
            ast.Mod: operator.mod}


def calc(expression: str) -> str:
    """The `calc` tool on integers: + - * // % and parentheses (examples/otel_agent.py's too)."""
    def ev(node):
        if isinstance(node, ast.BinOp) and type(node.op) in _AST_OPS:
            return _AST_OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        raise ValueError(f"cannot evaluate {expression!r}")
    return str(ev(ast.parse(expression, mode="eval").body))


def expression_called(text: str) -> str | None:
    """The expression of the reply's first well-formed calc call, else None."""
    for raw in CALL.findall(text):
        try:
            call = json.loads(raw)
        except ValueError:
            continue
        if call.get("name") == "calc" and isinstance((call.get("arguments") or {}).get("expression"), str):
            return call["arguments"]["expression"]
    return None


def episode(client: OpenAI, question: str, max_tokens: int = 120,
            max_turns: int = 3, model: str = "flywheel") -> tuple[list[str], str, str | None]:
    """(response ids, one per turn; the final answer text; the first expression called)."""
    messages = [{"role": "user", "content": question}]
    ids, called, text = [], None, ""
    for _ in range(max_turns):
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
        ids.append(r.id)
        text = r.choices[0].message.content or ""
        expression = expression_called(text)
        if expression is None:
            break
        called = called or expression
        try:
            result = calc(expression)
        except (ValueError, SyntaxError) as e:
            result = f"error: {e}"
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": result}]
    return ids, text, called


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--ops", default="plus,minus", help=f"comma-separated, of {', '.join(OPS)}; asked in turn")
    p.add_argument("--correction-rate", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=120, help="new tokens per reply")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="flywheel", help="the model to call, e.g. a managed flywheel's production alias")
    p.add_argument("--api-key", default="unused")
    args = p.parse_args()
    rng = random.Random(args.seed)
    client = OpenAI(base_url=args.url, api_key=args.api_key)
    ops = args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        p.error(f"--ops: unknown {unknown[0]!r} (valid: {', '.join(OPS)})")
    solved = {op: [0, 0] for op in ops}
    with httpx.Client(base_url=args.url, timeout=60, headers={"authorization": f"Bearer {args.api_key}"}) as http:
        for i in range(args.episodes):
            op = ops[i % len(ops)]
            symbol, fn, question = OPS[op]
            a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
            answer = str(fn(a, b))
            ids, text, called = episode(client, question.format(a=a, b=b), args.max_tokens, model=args.model)
            numbers = re.findall(r"-?\d+", text)
            ok = bool(numbers) and numbers[-1] == answer
            solved[op][0] += ok
            solved[op][1] += 1
            feedback = {"score": 1.0 if ok else 0.0, "verifier": {"env": "calculator", "task": {"answer": answer}}}
            http.post(f"/traces/{ids[-1]}/feedback", json=feedback).raise_for_status()
            if not ok and rng.random() < args.correction_rate and called != f"{a} {symbol} {b}":
                fix = {"role": "assistant", "content": "Let me compute that.", "tool_calls": [
                    {"id": "call_0", "type": "function",
                     "function": {"name": "calc", "arguments": json.dumps({"expression": f"{a} {symbol} {b}"})}}]}
                http.post(f"/traces/{ids[0]}/feedback", json={"correction": fix}).raise_for_status()
    print("loop_traffic: episodes=%d " % args.episodes
          + " ".join(f"{op}_solved={n}/{total}" for op, (n, total) in solved.items()))


if __name__ == "__main__":
    main()
