"""The tiny-model folder, its byte-level tokenizer and chat template, token-in-token-out
conversations, and the errors `load` gives for folders that are not models."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from flywheel.models import ChatRenderer, ChatTemplateError, ModelLoadError, load
from flywheel.models.loading import check_model_folder, load_tokenizer
from flywheel.models.tiny import TinySpec, build_tiny_model

SPEC = TinySpec(hidden=64, layers=2, heads=2, ffn=128)
PAD, IM_START, IM_END = 256, 257, 258


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), SPEC)


@pytest.fixture(scope="module")
def loaded(folder):
    return load(folder)


@pytest.fixture(scope="module")
def tok(loaded):
    return loaded[1]


@pytest.fixture(scope="module")
def renderer(tok):
    return ChatRenderer(tok)


def b(text: str) -> list[int]:
    """Byte ids of ASCII/UTF-8 text (the tiny tokenizer's id for byte x is x)."""
    return list(text.encode("utf-8"))


# ---------------------------------------------------------------- the folder


def test_folder_loads_with_plain_transformers(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    tok = AutoTokenizer.from_pretrained(str(folder))
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert tok.encode("hi", add_special_tokens=False) == [104, 105]
    assert tok.chat_template and "<tool_call>" in tok.chat_template
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    # The template lives in tokenizer_config.json, where every transformers version reads it.
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())
    assert not (folder / "chat_template.jinja").exists()
    with torch.no_grad():
        logits = model(torch.tensor([[104, 105]])).logits
    assert logits.shape == (1, 2, 320)


def test_config_is_qwen2_with_the_given_shape(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen2"
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (64, 2, 2, 2, 128)
    assert cfg["vocab_size"] == 320  # 259 used ids rounded up to a multiple of 64
    assert cfg["max_position_embeddings"] == 4096
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["eos_token_id"], cfg["pad_token_id"]) == (IM_END, PAD)
    gen = json.loads((folder / "generation_config.json").read_text())
    assert sorted(gen["eos_token_id"]) == [PAD, IM_END]


def test_parameter_count_matches_the_shape(folder, loaded):
    # embedding (tied with the head) 320*64 = 20480; per layer: q, k, v 3*(64*64+64) = 12480,
    # o 64*64 = 4096, MLP 3*64*128 = 24576, two RMSNorms 2*64 = 128 -> 41280; final norm 64.
    expected = 20480 + 2 * 41280 + 64
    assert expected == 103104
    model = loaded[0]
    assert sum(p.numel() for p in model.parameters()) == expected
    info = json.loads((folder / "flywheel_tiny.json").read_text())
    assert info["parameters"] == expected
    assert (info["hidden"], info["layers"], info["heads"], info["ffn"], info["seed"]) == (64, 2, 2, 128, 0)


def test_grouped_query_attention_shape(tmp_path):
    folder = build_tiny_model(tmp_path, TinySpec(hidden=32, layers=1, heads=4, kv_heads=2, ffn=32))
    cfg = json.loads((folder / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (4, 2)
    weights = load_file(folder / "model.safetensors")
    assert tuple(weights["model.layers.0.self_attn.k_proj.weight"].shape) == (16, 32)  # 2 heads * 8


@pytest.mark.parametrize("spec, msg", [
    (TinySpec(hidden=30, heads=4), "hidden (30) must be divisible by heads (4)"),
    (TinySpec(hidden=32, heads=4, kv_heads=3), "heads (4) must be divisible by kv_heads (3)"),
])
def test_bad_shapes_are_rejected(tmp_path, spec, msg):
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        build_tiny_model(tmp_path / "m", spec)
    assert not (tmp_path / "m").exists()


def test_same_seed_same_weights_different_seed_different(folder, tmp_path):
    again = build_tiny_model(tmp_path / "again", SPEC)
    other = build_tiny_model(tmp_path / "other", TinySpec(**{**SPEC.__dict__, "seed": 1}))
    w0, w_again, w_other = (load_file(f / "model.safetensors") for f in (folder, again, other))
    assert w0.keys() == w_again.keys() == w_other.keys()
    assert all(torch.equal(w0[k], w_again[k]) for k in w0)
    random_init = [k for k in w0 if k.endswith("proj.weight") or k.endswith("embed_tokens.weight")]
    assert random_init and not any(torch.equal(w0[k], w_other[k]) for k in random_init)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_is_byte_level(tok):
    ascii_text = bytes(range(1, 128)).decode("ascii")  # every ASCII byte, controls included
    assert tok.encode(ascii_text, add_special_tokens=False) == list(range(1, 128))
    assert tok.encode("\x00a", add_special_tokens=False) == [0, 97]
    text = "héllo ✓ 日本 🙂"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == b(text) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert len(tok) == 259


def test_special_tokens_are_single_ids(tok):
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [PAD, IM_START, IM_END]
    assert (tok.pad_token_id, tok.eos_token_id) == (PAD, IM_END)
    assert tok.encode("<|im_start|>user\nx<|im_end|>", add_special_tokens=False) == \
        [IM_START, *b("user\nx"), IM_END]
    assert tok.encode("<|endoftext|>", add_special_tokens=False) == [PAD]
    assert tok.decode([IM_START, 104, IM_END]) == "<|im_start|>h<|im_end|>"


def test_every_text_encodes_to_its_utf8_bytes(folder):
    # flywheel's loader honours the folder's generic tokenizer class; transformers 5's
    # AutoTokenizer would substitute Qwen2Tokenizer and NFC-normalise this to [195, 169]
    tok = load_tokenizer(folder)
    text = "e\u0301"  # 'e' + combining acute accent (NFD)
    assert tok.encode(text, add_special_tokens=False) == [101, 204, 129]
    assert tok.padding_side == "left"


# ---------------------------------------------------------------- chat template

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "5"},
]
TOOL_SYSTEM = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call these functions. Their signatures are "
    "inside <tools></tools>:\n<tools>\n"
    '{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n'
    "</tools>\n\nTo call a function, write a JSON object with its name and arguments inside "
    "<tool_call></tool_call> tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>'
TOOL_CHAT_TEXT = (
    TOOL_SYSTEM
    + "<|im_start|>user\n2+3?<|im_end|>\n"
    + "<|im_start|>assistant\n" + CALL_TEXT + "\n"
    + "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
    + "<|im_start|>assistant\n5<|im_end|>\n"
)


def test_template_renders_tools_in_the_hermes_convention(tok):
    assert tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False) == TOOL_CHAT_TEXT


def test_template_content_with_several_calls_and_string_arguments(tok):
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"name": "a", "arguments": '{"x": 1}'},  # bare call, arguments already JSON text
            {"type": "function", "function": {"name": "b", "arguments": {}}},
        ]},
        {"role": "tool", "content": "A"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n<tool_call>\n"
        '{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
        '{"name": "b", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nA\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_template_without_tools_is_plain_chatml(tok):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"}]
    assert tok.apply_chat_template(messages, tokenize=False) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"


@pytest.mark.parametrize("messages, msg", [
    ([{"role": "user", "content": "u"}, {"role": "system", "content": "s"}], "a system message may only come first"),
    ([{"role": "robot", "content": "r"}], "unknown role: robot"),
])
def test_template_rejects_misplaced_system_and_unknown_roles(tok, messages, msg):
    with pytest.raises(Exception, match=msg):
        tok.apply_chat_template(messages, tokenize=False)


def test_hf_assistant_mask_covers_the_assistant_text_and_end_token(tok):
    out = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids == tok.encode(TOOL_CHAT_TEXT, add_special_tokens=False)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == CALL_TEXT + "5<|im_end|>"


# ---------------------------------------------------------------- Conversation


def test_generation_prompt(renderer):
    user = [{"role": "user", "content": "hi"}]
    expected = [IM_START, *b("user\nhi"), IM_END, 10, IM_START, *b("assistant\n")]
    assert renderer.prompt_ids(user) == expected
    conv = renderer.start(user)
    assert conv.ids == [IM_START, *b("user\nhi"), IM_END, 10]
    assert conv.add_generation_prompt() == expected
    assert conv.add_generation_prompt() == expected  # idempotent: the header is added once
    assert conv.ids == expected and conv.assistant_mask == [0] * len(expected)
    with pytest.raises(ChatTemplateError, match="after the generation prompt"):
        conv.append_messages([{"role": "user", "content": "again"}])


def test_conversation_turn_by_turn_equals_encoding_the_whole_render(renderer, tok):
    conv = renderer.start(TOOL_CHAT[:2], tools=TOOLS)
    prompt = conv.add_generation_prompt()
    assert prompt == renderer.prompt_ids(TOOL_CHAT[:2], TOOLS)
    assert tok.decode(prompt) == TOOL_SYSTEM + "<|im_start|>user\n2+3?<|im_end|>\n<|im_start|>assistant\n"

    conv.append_sampled(tok.encode(CALL_TEXT, add_special_tokens=False), TOOL_CHAT[2])
    assert conv.ids[-1] == IM_END  # the newline after the turn is owed, not yet appended
    conv.append_messages(TOOL_CHAT[3:5])  # two consecutive tool results: one user turn
    conv.append_sampled([53, IM_END], TOOL_CHAT[5])  # "5<|im_end|>"
    conv.finish()

    full = renderer.encode(renderer.render(TOOL_CHAT, TOOLS))
    assert full == tok.encode(TOOL_CHAT_TEXT, add_special_tokens=False)
    assert conv.ids == full
    assert conv.messages == TOOL_CHAT
    assert len(conv.assistant_mask) == len(conv.ids)
    assert tok.decode([i for i, m in zip(conv.ids, conv.assistant_mask) if m]) == CALL_TEXT + "5<|im_end|>"

    hf = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert hf["input_ids"] == conv.ids
    assert hf["assistant_masks"] == conv.assistant_mask


def test_conversation_from_messages_matches_turn_by_turn(renderer, tok):
    conv = renderer.start(TOOL_CHAT, tools=TOOLS)
    conv.finish()
    hf = tok.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=True)
    assert (conv.ids, conv.assistant_mask) == (hf["input_ids"], hf["assistant_masks"])


def test_untrained_assistant_turn_is_kept_out_of_the_mask(renderer):
    conv = renderer.start([{"role": "user", "content": "q"}])
    conv.append_assistant_message({"role": "assistant", "content": "no"}, trained=False)
    conv.append_messages([{"role": "user", "content": "q2"}])
    conv.append_assistant_message({"role": "assistant", "content": "yes"})
    conv.finish()
    assert conv.ids == [IM_START, *b("user\nq"), IM_END, 10, IM_START, *b("assistant\nno"), IM_END, 10,
                        IM_START, *b("user\nq2"), IM_END, 10, IM_START, *b("assistant\nyes"), IM_END, 10]
    assert [i for i, m in zip(conv.ids, conv.assistant_mask) if m] == [*b("yes"), IM_END]


def test_render_memo_is_keyed_by_content_and_bounded(tok):
    memo = ChatRenderer(tok, memo_size=2)
    calls = []
    real = tok.apply_chat_template

    def counting(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    tok.apply_chat_template = counting
    try:
        messages = [{"role": "user", "content": "hi"}]
        first = memo.render(messages)
        assert memo.render([{"role": "user", "content": "hi"}]) == first and len(calls) == 1  # equal content: remembered
        messages[0]["content"] = "bye"  # the same list, changed: rendered afresh
        assert memo.render(messages) == "<|im_start|>user\nbye<|im_end|>\n" and len(calls) == 2
        assert memo.render(messages, add_generation_prompt=True).endswith("assistant\n") and len(calls) == 3
        memo.render([{"role": "user", "content": "hi"}])  # evicted by the two since (memo of 2)
        assert len(calls) == 4
        off = ChatRenderer(tok, memo_size=0)
        off.render(messages), off.render(messages)
        assert len(calls) == 6
    finally:
        tok.apply_chat_template = real


def test_an_assistant_turn_costs_one_render(renderer, tok):
    renders = []
    real = renderer.render
    renderer.render = lambda *a, **kw: renders.append(1) or real(*a, **kw)
    try:
        conv = renderer.start(TOOL_CHAT[:2], tools=TOOLS)
        conv.add_generation_prompt()
        before = len(renders)
        conv.append_sampled(tok.encode(CALL_TEXT, add_special_tokens=False), TOOL_CHAT[2])
        assert len(renders) - before == 1
    finally:
        del renderer.render


# ---------------------------------------------------------------- load() and its errors


def test_load_returns_an_eval_mode_model(loaded):
    model, tok = loaded
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not model.training and not any(m.training for m in model.modules())
    assert next(model.parameters()).dtype == torch.float32
    assert tok.pad_token_id == PAD


def test_load_in_bfloat16(folder):
    model, _ = load(folder, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training


def test_load_unknown_dtype(folder):
    with pytest.raises(ModelLoadError, match="unknown dtype 'float7'"):
        load(folder, dtype="float7")


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path / "nope")
    assert str(e.value).startswith(f"model path {str(tmp_path / 'nope')!r} does not exist")
    assert "flywheel model tiny --out DIR" in str(e.value)


def test_file_instead_of_folder(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError) as e:
        load(path)
    assert str(e.value) == f"model path {str(path)!r} is a file, not a model folder"


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path)
    assert str(e.value) == f"{str(tmp_path)!r} is not a model folder: it has no config.json"


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2",\n')
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'config.json'}: invalid JSON at line 2: ")


def test_config_without_model_type(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ModelLoadError, match="has no 'model_type'; it is not a transformers model config"):
        check_model_folder(tmp_path)


def test_model_type_that_is_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "vit"}')
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path)
    assert str(e.value).startswith(f"{str(tmp_path)!r}: model_type 'vit' is not a causal language model")


def test_config_without_weights(folder, tmp_path):
    shutil.copy(folder / "config.json", tmp_path)
    with pytest.raises(ModelLoadError) as e:
        load(tmp_path)
    assert str(e.value) == f"{str(tmp_path)!r} has a config but no weights (*.safetensors or *.bin)"


def test_check_model_folder_returns_the_config(folder):
    assert check_model_folder(folder)["model_type"] == "qwen2"


def test_folder_without_tokenizer(folder, tmp_path):
    shutil.copy(folder / "config.json", tmp_path)
    shutil.copy(folder / "model.safetensors", tmp_path)
    with pytest.raises(ModelLoadError, match="has no tokenizer"):
        load(tmp_path)


def _copy(folder, dest):
    shutil.copytree(folder, dest)
    return dest


def test_a_folder_without_tokenizer_json_is_refused_by_name(folder, tmp_path):
    """It used to load an empty tokenizer (2 special tokens against 320 embedding rows), and
    sft / generate then failed later with "prompt 0 is empty"."""
    bare = _copy(folder, tmp_path / "bare")
    (bare / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="names PreTrainedTokenizerFast, which is built from tokenizer.json, "
                                             "and the folder has no tokenizer.json"):
        load(bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    del cfg["tokenizer_class"]  # AutoTokenizer then picks the model family's class
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"no vocabulary besides its 2 special tokens.*absent: tokenizer.json"):
        load_tokenizer(bare)


def test_a_tokenizer_larger_than_the_embedding_is_refused(folder, tmp_path):
    big = _copy(folder, tmp_path / "big")
    tok = load_tokenizer(big)
    tok.add_tokens([f"<extra_{i}>" for i in range(100)])  # ids 259..358 against 320 rows
    tok.save_pretrained(big)
    with pytest.raises(ModelLoadError, match="makes ids up to 358 but the model's embedding has 320 rows"):
        load(big)
    model, smaller = load(folder)  # 259 ids in 320 rows: padding rows are fine
    assert len(smaller) < model.get_input_embeddings().weight.shape[0]
