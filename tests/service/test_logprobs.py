"""Chat-completion logprobs: each token's own bytes, no vocabulary padding, top_logprobs
(streamed too), and OpenAI's validation of `top_logprobs`."""

from __future__ import annotations

import math
from contextlib import contextmanager

import httpx
import pytest
import torch

from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import TinySpec, build_tiny_model
from flywheel.models.tiny import build_tokenizer
from flywheel.models.token_bytes import token_table, token_text
from flywheel.serve import OpenAIService
from live_server import serve_openai

SPEC = TinySpec(hidden=64, layers=2, heads=4, ffn=128)
HELLO = [{"role": "user", "content": "Say café!"}]
TEXT = "café!"  # what the scripted model writes (é is two byte tokens)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("lp") / "m", SPEC)
    service = OpenAIService(model, version="v1", default_max_tokens=12, window_s=0.005)
    srv, client = serve_openai(service)
    yield service, srv, client
    srv.close()
    service.close()


@contextmanager
def scripted(engine, text: str, bonus: float = 30.0):
    """Make the random model write `text`, then <|im_end|>: each forward's logits get `bonus`
    on the token that follows its input's last token in the script (the chat prompt ends
    with a newline; every token of `text` must have one successor)."""
    seq = [engine.tokenizer.encode("\n", add_special_tokens=False)[0], *text.encode(), engine.tokenizer.eos_token_id]
    successor = torch.full((engine.vocab_size,), -1, dtype=torch.long)  # (V,)
    for prev, nxt in zip(seq, seq[1:]):
        assert successor[prev] in (-1, nxt), "the script is ambiguous"
        successor[prev] = nxt
    original = engine.runner.forward

    def forward(tokens_B_S, *args, **kw):
        logits_B_V = original(tokens_B_S, *args, **kw)
        nxt_B = successor[tokens_B_S[:, -1].cpu()].to(logits_B_V.device)  # (B,) one row per input row
        hit = (nxt_B >= 0).nonzero().squeeze(1)
        return logits_B_V.index_put((hit, nxt_B[hit]), torch.tensor(bonus, device=logits_B_V.device),
                                    accumulate=True)

    engine.runner.forward = forward
    try:
        yield
    finally:
        del engine.runner.forward


def joined(entries) -> bytes:
    return b"".join(bytes(e.bytes) for e in entries)


# --------------------------------------------------------------------------- the bytes table


def test_the_byte_table_gives_each_token_its_own_bytes():
    tok = build_tokenizer()
    table = token_table(tok)
    assert token_table(tok) is table  # cached
    ids = tok.encode("é ok", add_special_tokens=False)
    assert [table.bytes_of(i) for i in ids] == [b"\xc3", b"\xa9", b" ", b"o", b"k"]
    assert [token_text(table.bytes_of(i)) for i in ids[:3]] == ["bytes:\\xc3", "bytes:\\xa9", " "]
    assert table.bytes_of(tok.eos_token_id) == b"<|im_end|>" and table.text_bytes(tok.eos_token_id) == 0
    assert table.bytes_of(len(tok)) is None and table.bytes_of(len(tok) + 40) is None  # vocabulary padding


def test_gpt2_and_sentencepiece_vocabularies():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from flywheel.models.token_bytes import bytes_to_unicode

    alphabet = bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    vocab["Ã©"] = 256  # GPT-2 spelling of b"\xc3\xa9"
    vocab["Ġcaf"] = 257
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[("Ã", "©")]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    gpt2 = token_table(PreTrainedTokenizerFast(tokenizer_object=raw))
    assert gpt2.bytes_of(256) == "é".encode() and token_text(gpt2.bytes_of(256)) == "é"
    assert gpt2.bytes_of(257) == b" caf" and gpt2.bytes_of(0xC3) == b"\xc3"

    sp = Tokenizer(models.BPE(vocab={"<unk>": 0, "<0xC3>": 1, "<0xA9>": 2, "\u2581caf": 3}, merges=[],
                              unk_token="<unk>", byte_fallback=True))
    sp.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    table = token_table(PreTrainedTokenizerFast(tokenizer_object=sp))
    assert [table.bytes_of(i) for i in (1, 2, 3)] == [b"\xc3", b"\xa9", b" caf"]


# --------------------------------------------------------------------------- over the wire


def test_logprob_bytes_rebuild_the_text_and_name_partial_characters(live):
    service, _, client = live
    with scripted(service.engine, TEXT):
        r = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=12, temperature=0,
                                           logprobs=True)
    choice = r.choices[0]
    assert choice.message.content == TEXT and choice.finish_reason == "stop"
    entries = choice.logprobs.content
    assert joined(entries) == TEXT.encode()
    assert [e.token for e in entries] == ["c", "a", "f", "bytes:\\xc3", "bytes:\\xa9", "!"]
    assert all(e.top_logprobs == [] for e in entries)


def test_legacy_completion_logprobs_name_tokens_the_same_way(live):
    service, _, client = live
    with scripted(service.engine, TEXT):
        r = client.completions.create(model="flywheel", prompt="Say café!\n", max_tokens=12, temperature=0,
                                      logprobs=0)
    choice = r.choices[0]
    assert choice.text == TEXT
    assert choice.logprobs.tokens == ["c", "a", "f", "bytes:\\xc3", "bytes:\\xa9", "!"]
    assert choice.logprobs.text_offset == [0, 1, 2, 3, 3, 4]  # é starts at character 3
    assert len(choice.logprobs.token_logprobs) == 6


def test_vocabulary_padding_never_appears(live):
    """The random model samples ids past the tokenizer's vocabulary (they make no text):
    the logprobs hold one entry per token of the message, none with empty bytes."""
    service, _, client = live
    r = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=40, temperature=1.0,
                                       seed=3, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    known = len(service.engine.tokenizer)
    assert all(e.bytes and e.token for e in entries)
    assert all(e.bytes and a.token for e in entries for a in e.top_logprobs)
    assert r.usage.completion_tokens > len(entries) >= 1  # padding was sampled, then left out
    assert all(len(e.top_logprobs) == 3 for e in entries)
    # the alternatives' token ids are all known ones: their bytes come from the table
    table = token_table(service.engine.tokenizer)
    names = {token_text(table.bytes_of(i)) for i in range(known)}
    assert all(a.token in names for e in entries for a in e.top_logprobs)


def _check_top(entries, k):
    for e in entries:
        tops = e.top_logprobs
        assert len(tops) == k
        lps = [a.logprob for a in tops]
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-5
        same = [a for a in tops if a.bytes == e.bytes]
        if same:
            assert same[0].logprob == e.logprob  # one distribution for the token and its alternatives
        else:
            assert e.logprob <= lps[-1]


def test_top_logprobs_under_the_sampled_distribution(live):
    service, _, client = live
    with scripted(service.engine, TEXT, bonus=6.0):
        r = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=12, temperature=0.7,
                                           top_p=0.6, seed=5, logprobs=True, top_logprobs=5)
    entries = r.choices[0].logprobs.content
    assert entries
    for e in entries:  # top_p filters: alternatives outside the support are left out (fewer than 5)
        lps = [a.logprob for a in e.top_logprobs]
        assert 1 <= len(lps) <= 5 and lps == sorted(lps, reverse=True) and all(math.isfinite(x) for x in lps)
        assert sum(math.exp(x) for x in lps) <= 1 + 1e-5
        if len(lps) < 5:  # the whole support is listed, so the sampled token is in it
            assert e.logprob in lps
        assert e.logprob in lps or e.logprob <= lps[-1]
    assert any(len(e.top_logprobs) < 5 for e in entries)
    with scripted(service.engine, TEXT):
        r = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=12, temperature=1.0,
                                           logprobs=True, top_logprobs=5)
    assert r.choices[0].message.content == TEXT
    _check_top(r.choices[0].logprobs.content, 5)
    assert all(e.top_logprobs[0].bytes == e.bytes for e in r.choices[0].logprobs.content)


def test_the_engine_returns_top_logprobs_only_when_asked(live):
    service, _, _ = live
    engine: LocalEngine = service.engine
    prompt = engine.encode("hello")
    [[plain]] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4))
    [[asked]] = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, top_logprobs=2))
    assert plain.top_logprobs is None and asked.token_ids == plain.token_ids
    assert [len(t) for t in asked.top_logprobs] == [2] * len(asked.token_ids)
    assert [t[0] for t in asked.top_logprobs] == [(i, pytest.approx(lp, abs=1e-5))
                                                 for i, lp in zip(asked.token_ids, asked.logprobs)]


def test_streamed_chunks_carry_their_tokens_logprobs(live):
    service, _, client = live
    with scripted(service.engine, TEXT):
        full = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=12, temperature=0,
                                              logprobs=True, top_logprobs=4)
        stream = list(client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=12,
                                                     temperature=0, logprobs=True, top_logprobs=4, stream=True))
    content, entries = "", []
    for chunk in stream:
        for c in chunk.choices:
            piece = c.delta.content or ""
            content += piece
            got = c.logprobs.content if c.logprobs is not None else []
            if piece:  # a content chunk carries the tokens that complete its text
                assert joined(got) == piece.encode()
            entries += got
    assert content == TEXT
    assert [e.model_dump() for e in entries] == [e.model_dump() for e in full.choices[0].logprobs.content]
    _check_top(entries, 4)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("body", [{"logprobs": True, "top_logprobs": 21}, {"logprobs": True, "top_logprobs": -1},
                                  {"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 0}])
def test_top_logprobs_is_validated_as_openai_does(live, body):
    _, srv, _ = live
    r = httpx.post(srv.url + "/chat/completions",
                   json={"model": "flywheel", "messages": HELLO, "max_tokens": 2, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "top_logprobs", error


def test_a_logprob_stream_sends_entries_with_the_text_they_complete():
    """Fed token by token (as a continuous batch reports them): each piece of text goes out
    with the entries of the tokens that make it; a byte inside a character waits for the
    rest of it, a special token for the next text, a final stop token for the end."""
    from flywheel.serve import responses as R

    tok = build_tokenizer()
    table = token_table(tok)
    text, lps = R.TextStream(R.text_decoder(tok)), R.LogprobStream(table)
    ids = tok.encode("a", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_start|>")] \
        + tok.encode("é!", add_special_tokens=False) + [tok.eos_token_id]
    sent = []
    for i, t in enumerate(ids):
        lps.feed([t], [(-0.5 - i, [(t, -0.5 - i)])])
        piece = text.feed([t])
        out = lps.take(piece) if piece else None
        sent.append((piece, None if out is None else [e["token"] for e in out["content"]]))
    assert sent == [("a", ["a"]), ("", None), ("", None), ("é", ["<|im_start|>", "bytes:\\xc3", "bytes:\\xa9"]),
                    ("!", ["!"]), ("", None)]
    assert lps.sent == 5 and len(lps.pending) == 1  # the stop token: left to the final chunks
