"""SFT data loading on the tiny byte-level tokenizer (token id == byte value for ASCII)."""

from __future__ import annotations

import json

import pytest

from flywheel.config import SFTDataConfig
from flywheel.models.chat import ChatRenderer
from flywheel.models.loading import load_tokenizer
from flywheel.models.tiny import build_tiny_model
from flywheel.train.sft_data import DataError, DataReport, load_sft_examples


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def write(tmp_path, *lines, name="data.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


def cfg(**kw) -> SFTDataConfig:
    return SFTDataConfig(train=["unused.jsonl"], **kw)


def masked_text(tok, ex) -> str:
    return tok.decode([i for i, m in zip(ex.ids, ex.loss_mask) if m])


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def test_chat_ids_follow_the_template_and_mask_only_assistant_turns(tok, tmp_path):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
                {"role": "assistant", "content": "6"}]
    path = write(tmp_path, {"messages": messages, "parallel_tool_calls": False})
    (ex,), report = load_sft_examples([path], tok, cfg())
    renderer = ChatRenderer(tok)
    assert ex.ids == renderer.encode(renderer.render(messages))
    assert len(ex.loss_mask) == len(ex.ids)
    assert masked_text(tok, ex) == "4<|im_end|>6<|im_end|>"
    assert ex.source == f"{path}:1"
    assert (report.examples, report.lines, report.warnings) == (1, 1, [])


def test_weight_zero_turn_is_not_trained(tok, tmp_path):
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bad", "weight": 0},
                {"role": "user", "content": "b"}, {"role": "assistant", "content": "good", "weight": 1}]
    (ex,), _ = load_sft_examples([write(tmp_path, {"messages": messages})], tok, cfg())
    plain = [{k: v for k, v in m.items() if k != "weight"} for m in messages]
    renderer = ChatRenderer(tok)
    assert ex.ids == renderer.encode(renderer.render(plain))
    assert masked_text(tok, ex) == "good<|im_end|>"


def test_tools_and_tool_calls_with_string_arguments(tok, tmp_path):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}}
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "assistant", "content": "Sunny."}]
    (ex,), _ = load_sft_examples([write(tmp_path, {"messages": messages, "tools": tools})], tok, cfg())
    expected = json.loads(json.dumps(messages))
    expected[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    renderer = ChatRenderer(tok)
    assert ex.ids == renderer.encode(renderer.render(expected, tools))
    text = tok.decode(ex.ids)
    assert '# Tools' in text and json.dumps(tools[0]) in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert masked_text(tok, ex) == ('<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
                                    "</tool_call><|im_end|>Sunny.<|im_end|>")


def test_prompt_completion_by_hand(tok, tmp_path):
    path = write(tmp_path, {"prompt": "ab", "completion": "c"})
    eos = tok.eos_token_id
    (ex,), _ = load_sft_examples([path], tok, cfg())
    assert (ex.ids, ex.loss_mask) == ([97, 98, 99, eos], [0, 0, 1, 1])
    (ex,), _ = load_sft_examples([path], tok, cfg(add_eos=False, format="prompt_completion"))
    assert (ex.ids, ex.loss_mask) == ([97, 98, 99], [0, 0, 1])


def test_blank_lines_are_ignored(tok, tmp_path):
    path = write(tmp_path, "", GOOD, "   ", "\t", {"prompt": "", "completion": "x"})
    examples, report = load_sft_examples([path], tok, cfg())
    assert [e.source for e in examples] == [f"{path}:2", f"{path}:5"]
    assert (report.lines, report.examples, report.warnings) == (2, 2, [])
    assert examples[1].ids == [120, tok.eos_token_id]


def _chat(*messages, **extra):
    return {"messages": list(messages), **extra}


U = {"role": "user", "content": "q"}
A = {"role": "assistant", "content": "a"}

BAD = [  # (line, message fragment, DataReport counter)
    ('{"messages": [', "invalid JSON: Expecting value (column 15)", "skipped_invalid"),
    ("[1, 2]", "expected a JSON object, got array", "skipped_invalid"),
    ({"text": "hi"}, "neither 'messages' nor 'prompt'/'completion'", "skipped_invalid"),
    ({"messages": []}, "'messages' must be a non-empty array", "skipped_invalid"),
    ({"messages": "hi"}, "'messages' must be a non-empty array", "skipped_invalid"),
    (_chat(U, A, tools="x"), "'tools' must be an array of objects", "skipped_invalid"),
    (_chat("hi", A), "messages[0] is not an object (string)", "skipped_invalid"),
    (_chat({"content": "q"}, A), "messages[0] has no 'role'", "skipped_invalid"),
    (_chat(U, A, {"role": "robot", "content": "x"}), "unknown role 'robot' in messages[2]", "skipped_invalid"),
    (_chat({"role": "user", "content": 5}, A), "messages[0].content must be a string", "skipped_invalid"),
    (_chat(U, {"role": "assistant", "content": ""}), "messages[1]: assistant message has neither content nor tool_calls",
     "skipped_invalid"),
    (_chat(U, {**A, "weight": 2}), "messages[1]: 'weight' must be 0 or 1, got 2", "skipped_invalid"),
    (_chat({**U, "weight": 1}, A), "messages[0]: 'weight' is only allowed on assistant", "skipped_invalid"),
    (_chat(U, {"role": "assistant", "tool_calls": {"a": 1}}), "messages[1].tool_calls must be an array",
     "skipped_invalid"),
    (_chat(U, {"role": "assistant", "tool_calls": [{"name": "f"}]}), "messages[1].tool_calls[0] needs a 'function'",
     "skipped_invalid"),
    (_chat(U, {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}),
     "messages[1].tool_calls[0].function.name must be a non-empty string", "skipped_invalid"),
    (_chat(U, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a":'}}]}),
     "messages[1].tool_calls[0].function.arguments is not valid JSON", "skipped_invalid"),
    (_chat(U, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}),
     "messages[1].tool_calls[0].function.arguments must be a JSON object", "skipped_invalid"),
    (_chat(U, A, {"role": "system", "content": "late"}), "the chat template cannot render", "skipped_invalid"),
    (_chat(U, {**A, "weight": 0}), "no trained assistant message", "no_trained_tokens"),
    (_chat(U), "no trained assistant message", "no_trained_tokens"),
    ({"prompt": 1, "completion": "x"}, "'prompt' must be a string, got number", "skipped_invalid"),
    ({"prompt": "x"}, "missing 'completion'", "skipped_invalid"),
    ({"prompt": "x", "completion": ""}, "empty 'completion'", "skipped_invalid"),
    ({**_chat(U, A), "distill": "yes"}, "'distill' must be true or false, got string 'yes'", "skipped_invalid"),
    ({"prompt": "x", "completion": "y", "distill": 1}, "'distill' must be true or false, got number 1",
     "skipped_invalid"),
]


@pytest.mark.parametrize("line,fragment,counter", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_line_raises_naming_file_and_line(tok, tmp_path, line, fragment, counter):
    path = write(tmp_path, GOOD, line)
    with pytest.raises(DataError) as err:
        load_sft_examples([path], tok, cfg())
    assert str(err.value).startswith(f"{path}:2: ")
    assert fragment in str(err.value)


@pytest.mark.parametrize("line,fragment,counter", BAD, ids=[b[1][:40] for b in BAD])
def test_bad_line_is_skipped_counted_and_warned(tok, tmp_path, line, fragment, counter):
    path = write(tmp_path, GOOD, line)
    logged: list[str] = []
    examples, report = load_sft_examples([path], tok, cfg(on_error="skip"), log=logged.append)
    assert [e.source for e in examples] == [f"{path}:1"]
    counts = {k: getattr(report, k) for k in ("skipped_invalid", "no_trained_tokens", "truncated", "skipped_overlong")}
    assert counts == {k: int(k == counter) for k in counts}
    assert logged == report.warnings
    assert len(logged) == 1 and logged[0].startswith(f"{path}:2: ") and fragment in logged[0]


def test_format_chat_rejects_prompt_completion_lines(tok, tmp_path):
    path = write(tmp_path, {"prompt": "a", "completion": "b"})
    with pytest.raises(DataError, match=r":1: missing 'messages'"):
        load_sft_examples([path], tok, cfg(format="chat"))


def test_overlong_truncate_keeps_the_first_tokens(tok, tmp_path):
    path = write(tmp_path, {"prompt": "ab", "completion": "cdef"}, {"prompt": "abcd", "completion": "e"}, GOOD)
    logged: list[str] = []
    examples, report = load_sft_examples([path], tok, cfg(max_length=4), log=logged.append)
    assert (examples[0].ids, examples[0].loss_mask) == ([97, 98, 99, 100], [0, 0, 1, 1])
    assert [e.source for e in examples] == [f"{path}:1"]  # GOOD (line 3) is longer than 4 too
    assert (report.truncated, report.skipped_overlong, report.skipped_invalid) == (1, 2, 0)
    assert logged[0] == f"{path}:1: 7 tokens > max_length 4; truncated"
    assert logged[1] == f"{path}:2: 6 tokens > max_length 4 and truncating would leave no trained token; line skipped"


def test_overlong_skip(tok, tmp_path):
    path = write(tmp_path, {"prompt": "ab", "completion": "cdef"}, {"prompt": "a", "completion": "b"})
    logged: list[str] = []
    examples, report = load_sft_examples([path], tok, cfg(max_length=4, overlong="skip"), log=logged.append)
    assert [(e.ids, e.source) for e in examples] == [([97, 98, tok.eos_token_id], f"{path}:2")]
    assert (report.truncated, report.skipped_overlong) == (0, 1)
    assert logged == [f"{path}:1: 7 tokens > max_length 4; line skipped"]


def test_missing_file_and_files_without_examples(tok, tmp_path):
    with pytest.raises(DataError, match="nope.jsonl' does not exist"):
        load_sft_examples([str(tmp_path / "nope.jsonl")], tok, cfg())
    empty = write(tmp_path, "", "  ", name="empty.jsonl")
    with pytest.raises(DataError, match=r"empty.jsonl: no usable examples \(0 non-blank lines\)"):
        load_sft_examples([empty], tok, cfg())
    all_bad = write(tmp_path, "{", "[]", name="bad.jsonl")
    with pytest.raises(DataError, match=r"bad.jsonl: no usable examples \(2 non-blank lines, all skipped"):
        load_sft_examples([all_bad], tok, cfg(on_error="skip"), log=lambda msg: None)


def test_report_summary_and_default_warning(tok, tmp_path):
    a = write(tmp_path, GOOD, "{", name="a.jsonl")
    b = write(tmp_path, GOOD, _chat(U), name="b.jsonl")
    with pytest.warns(UserWarning) as caught:
        examples, report = load_sft_examples([a, b], tok, cfg(on_error="skip"))
    assert [str(w.message) for w in caught] == report.warnings
    assert report.warnings[0] == f"{a}:2: invalid JSON: Expecting property name enclosed in double quotes (column 2); line skipped"
    assert [e.source for e in examples] == [f"{a}:1", f"{b}:1"]
    assert report.files == [a, b]
    assert report.summary() == "2 examples from 2 files (4 lines): 1 invalid skipped, 1 with nothing to train skipped"
    assert DataReport(files=["x"], lines=3, examples=3).summary() == "3 examples from 1 file (3 lines)"


def test_readme_states_the_overlong_default():
    """README said over-long conversations were an error while the default cut them: the
    default and README's sentence are checked together."""
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert SFTDataConfig.model_fields["overlong"].default == "truncate"
    assert "is cut to it by default" in readme and "`data.overlong=skip` drops it instead" in readme
    assert "over-long conversations — are an" not in readme


def test_a_row_marked_distill_is_an_example_marked_distill_with_the_same_tokens(tok, tmp_path):
    rows = [GOOD, {**GOOD, "distill": True}, {"prompt": "1+1=", "completion": "2", "distill": True},
            {**GOOD, "distill": False}]
    examples, _ = load_sft_examples([write(tmp_path, *rows)], tok, cfg())
    assert [e.distill for e in examples] == [False, True, True, False]
    assert examples[0].ids == examples[1].ids and examples[0].loss_mask == examples[1].loss_mask
