"""The compact chat template (models/chat_template_compact.jinja): the standard template with a
one-line-per-tool block. Without tools it renders every conversation exactly as the standard
template does; with tools, the block is the tools' signatures, worked out by hand here."""

from __future__ import annotations

import pytest

from flywheel.envs import load_env
from flywheel.models.tiny import TEMPLATES, build_tokenizer, chat_template

CALL = {"id": "call_1_0", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "1 + 2"}'}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 1 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}],
    [{"role": "user", "content": "What is 1 + 2?"},
     {"role": "assistant", "content": "Let me compute that.", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1_0", "content": "3"}, {"role": "tool", "content": "3"},
     {"role": "assistant", "content": "The answer is 3."}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]}],
]


@pytest.fixture(scope="module")
def toks():
    return build_tokenizer("hermes"), build_tokenizer("compact")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_without_tools_it_renders_as_the_standard_template(toks, messages, generation_prompt):
    hermes, compact = (t.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
                       for t in toks)
    assert compact == hermes


def test_the_calculator_tool_renders_as_one_signature_line(toks):
    tools = load_env("calculator").info()["tools"]  # what `flywheel env show calculator` prints
    messages = CONVERSATIONS[2]
    text = toks[1].apply_chat_template(messages, tools=tools, tokenize=False)
    head = "<|im_start|>system\n# Tools\ncalc(expression: string)<|im_end|>\n"
    assert text == head + toks[0].apply_chat_template(messages, tokenize=False)
    with_system = toks[1].apply_chat_template(CONVERSATIONS[1], tools=tools, tokenize=False)
    assert with_system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\ncalc(expression: string)<|im_end|>\n"
                                  "<|im_start|>user\nhi<|im_end|>\n")


def test_optional_parameters_union_types_and_bare_functions(toks):
    tools = [{"type": "function", "function": {"name": "search", "parameters": {
                 "type": "object", "required": ["q"],
                 "properties": {"q": {"type": "string"}, "k": {"type": ["integer", "null"]}, "raw": {}}}}},
             {"type": "function", "function": {"name": "now"}}]
    text = toks[1].apply_chat_template([{"role": "user", "content": "x"}], tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools\nsearch(q: string, k?: integer|null, raw?: any)\n"
                           "now()<|im_end|>\n")


def test_an_unknown_template_name_is_refused():
    assert set(TEMPLATES) == {"hermes", "compact"}
    with pytest.raises(ValueError, match="not one of hermes, compact"):
        chat_template("chatml")
