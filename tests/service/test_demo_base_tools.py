"""The demo base model is trained on what the server serves: for a chat request that passes the
calculator's own tool schemas (`flywheel env show calculator`) as `tools=`, the prompt ids the
server builds are, token for token, the ids the base model's SFT rows were rendered with up to
the assistant's turn; the assistant turn it was taught parses, through the server's own path,
into `tool_calls` with a well-formed `calc` call; and the follow-up request a client sends
(the server's message, then the tool result) is again the rows' next prefix. The same holds for
the bare rows and a request without tools. No training: a random model with the recipe's
chat template, since the prompts depend on the template alone."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flywheel.config import SFTDataConfig
from flywheel.demo.base import BASE_RECIPE, addition_demos
from flywheel.envs import load_env
from flywheel.envs.calculator import evaluate
from flywheel.models import TinySpec, build_tiny_model, load_tokenizer
from flywheel.serve import OpenAIService
from flywheel.serve import responses as R
from flywheel.train.sft_data import load_sft_examples

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo-base-tools")
    model = build_tiny_model(root / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64,
                                                     template=BASE_RECIPE.template))
    rows = addition_demos(dataclasses.replace(BASE_RECIPE, demos=24))
    path = root / "demos.jsonl"  # as base_model writes them and run_sft reads them
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples, _ = load_sft_examples([str(path)], load_tokenizer(model), SFTDataConfig(train=[str(path)], format="chat"))
    service = OpenAIService(model, version="v1")
    yield service, rows, examples
    service.close()


def trained_spans(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each run of trained tokens: one per assistant turn."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def server_prompt(service: OpenAIService, messages: list[dict], tools: list[dict] | None) -> list[int]:
    """The prompt ids the server renders for this /v1/chat/completions body."""
    body = {"model": "flywheel", "messages": messages, **({"tools": tools} if tools else {})}
    return service._prepare_chat(body, "default").prompt


def test_both_prompt_formats_are_in_the_demos(served):
    _, rows, _ = served
    with_tools = [r for r in rows if "tools" in r]
    assert 0 < len(with_tools) < len(rows)
    assert all(r["messages"][0]["role"] == "user" for r in rows)  # no system message: as a plain client asks
    assert all(r["tools"] == load_env("calculator").info()["tools"] for r in with_tools)


def test_a_tools_request_is_served_exactly_as_the_rows_were_trained(served):
    service, rows, examples = served
    tools = load_env("calculator").info()["tools"]  # the schema a client copies from `flywheel env show`
    checked = 0
    for row, ex in zip(rows, examples):
        offered = row.get("tools")
        (call_start, call_end), (answer_start, _) = trained_spans(ex.loss_mask)
        user, _, tool, _ = row["messages"]
        assert server_prompt(service, [user], tools if offered else None) == ex.ids[:call_start]
        # the turn the model is taught, decoded as the engine decodes a sample, through the server's parsing
        taught = service.engine.tokenizer.decode(ex.ids[call_start:call_end], skip_special_tokens=True)
        message, finish = R.assistant_message(taught, tools_offered=bool(offered), finish_reason="stop",
                                              parser=service.parser)
        if not offered:  # no tools, no tool_calls (as OpenAI): the call stays in the text
            assert "tool_calls" not in message and '"name": "calc"' in message["content"]
            continue
        [call] = message["tool_calls"]
        assert finish == "tool_calls" and message["content"] == "Let me compute that."
        assert call["function"]["name"] == "calc"
        expression = json.loads(call["function"]["arguments"])["expression"]
        assert str(evaluate(expression)) == tool["content"]
        follow_up = [user, message, {"role": "tool", "tool_call_id": call["id"], "content": tool["content"]}]
        assert server_prompt(service, follow_up, tools) == ex.ids[:answer_start]
        checked += 1
    assert checked >= 5
