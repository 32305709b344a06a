"""The demo base model (docs/loop.md's production model) through a real `flywheel serve` and the
official `openai` client, as a standard agent stack calls it: the calculator's own tool schemas
(`flywheel env show calculator`) as `tools=`, an addition question, the `tool_calls` the reply
carries run by the client, the result sent back as a `tool` message, then the final answer.
Twenty questions drawn with a fixed seed, all counted: a clear majority must come back as a
well-formed `calc` call on the question's numbers and end with the right number."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

QUESTIONS = 20


def calculator_tools() -> list[dict]:
    """The tools as `flywheel env show calculator` prints them (its JSON, before the notes)."""
    from typer.testing import CliRunner

    from flywheel.cli.main import app

    shown = CliRunner().invoke(app, ["env", "show", "calculator"])
    assert shown.exit_code == 0, shown.output
    info, _ = json.JSONDecoder().raw_decode(shown.stdout)
    return info["tools"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(model, port: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "flywheel.cli.main", "serve", "--model", str(model),
                             "--port", str(port), "--no-traces", "--threads", "2", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"flywheel serve exited ({proc.returncode}):\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("flywheel serve did not come up in 120 s")


def episode(client, tools: list[dict], a: int, b: int) -> tuple[str | None, str]:
    """(the expression of the first reply's calc call, or None; the final answer's text)."""
    from flywheel.envs.calculator import evaluate

    messages: list = [{"role": "user", "content": f"What is {a} + {b}?"}]
    first = client.chat.completions.create(model="flywheel", messages=messages, tools=tools,
                                           temperature=0, max_tokens=120)
    choice = first.choices[0]
    calls = choice.message.tool_calls or []
    if choice.finish_reason != "tool_calls" or len(calls) != 1 or calls[0].function.name != "calc":
        return None, choice.message.content or ""
    expression = json.loads(calls[0].function.arguments)["expression"]
    messages += [choice.message, {"role": "tool", "tool_call_id": calls[0].id, "content": str(evaluate(expression))}]
    final = client.chat.completions.create(model="flywheel", messages=messages, tools=tools,
                                           temperature=0, max_tokens=120)
    assert final.choices[0].finish_reason == "stop" and not final.choices[0].message.tool_calls
    return expression, final.choices[0].message.content or ""


@pytest.mark.slow  # the demo base model (built once into the cache: minutes the first time) served over HTTP
def test_a_standard_client_gets_tool_calls_and_the_right_answer():
    from flywheel.demo.base import base_model
    from flywheel.envs.calculator import final_number

    tools = calculator_tools()
    proc = _serve(base_model(log=print), _free_port())
    try:
        port = proc.args[proc.args.index("--port") + 1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        rng = random.Random(0)
        called = right = 0
        for _ in range(QUESTIONS):
            a, b = rng.randrange(10, 1000), rng.randrange(10, 1000)
            expression, answer = episode(client, tools, a, b)
            called += expression is not None and expression.replace(" ", "") == f"{a}+{b}"
            right += final_number(answer) == str(a + b)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"calc called right: {called}/{QUESTIONS}; final answer right: {right}/{QUESTIONS}")
    assert called >= 0.8 * QUESTIONS and right >= 0.75 * QUESTIONS, (called, right)
