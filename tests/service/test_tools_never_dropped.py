"""A request's tools never vanish: a model whose chat template renders no tools refuses a
request with tools (400 naming `tools`) instead of answering as if none were offered."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

from flywheel.models import ChatRenderer, TinySpec, build_tiny_model
from flywheel.serve import OpenAIService
from live_server import serve_openai

CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}
# ChatML with no tools section, like SmolLM2-Instruct's own template
NO_TOOLS = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_a_template_without_tools_refuses_tools_and_still_chats(tmp_path):
    folder = build_tiny_model(tmp_path / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert ChatRenderer(tokenizer).renders_tools  # flywheel's own template does
    tokenizer.chat_template = NO_TOOLS
    tokenizer.save_pretrained(folder)
    assert not ChatRenderer(AutoTokenizer.from_pretrained(folder)).renders_tools
    service = OpenAIService(folder, default_max_tokens=4)
    assert service.template_note() == ("chat template: the model's own; "
                                       "tools: refused with a 400 (the template renders none)")
    srv, client = serve_openai(service)
    try:
        hello = [{"role": "user", "content": "What is 2 + 3?"}]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="flywheel", messages=hello, tools=[CALC])
        assert "tools" in str(e.value) and "renders no tools" in str(e.value)
        # tool_choice none offers no tools: nothing to drop
        assert client.chat.completions.create(model="flywheel", messages=hello, tools=[CALC], tool_choice="none")
        assert client.chat.completions.create(model="flywheel", messages=hello).choices[0].message.role == "assistant"
    finally:
        srv.close()


def test_renders_and_rollout_conversations_refuse_tools_the_template_cannot_show(tmp_path):
    from flywheel.models import ToolsNotRendered

    folder = build_tiny_model(tmp_path / "m", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = NO_TOOLS
    renderer = ChatRenderer(tokenizer)
    hello = [{"role": "user", "content": "What is 2 + 3?"}]
    with pytest.raises(ToolsNotRendered, match="renders no tools"):
        renderer.render(hello, tools=[CALC], add_generation_prompt=True)
    with pytest.raises(ToolsNotRendered):
        renderer.start(hello, tools=[CALC])  # how an environment's episode opens
    assert renderer.render(hello, add_generation_prompt=True).startswith("<|im_start|>user")  # no tools: fine
