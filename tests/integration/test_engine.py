"""LocalEngine against full forward passes of the same model."""

import pytest
import torch

from flywheel.inference import LocalEngine, SamplingParams
from flywheel.models import TinySpec, build_tiny_model, load

PROMPTS = ["12+34=", "a longer prompt, padded", "x"]


@pytest.fixture(scope="module", params=["mha", "gqa"])
def model_dir(request, tmp_path_factory):
    kv = 2 if request.param == "gqa" else None
    return build_tiny_model(tmp_path_factory.mktemp(request.param),
                            TinySpec(hidden=64, layers=2, heads=4, kv_heads=kv, ffn=128, seed=3))


@pytest.fixture(params=["lean-dense", "lean-packed", "hf"])
def engine(request, model_dir):
    lean = request.param.startswith("lean")
    e = LocalEngine.from_path(str(model_dir), seed=0, lean=lean,
                              packed=request.param == "lean-packed" if lean else None)
    assert e.is_lean == lean
    return e


@pytest.fixture(scope="module")
def reference(model_dir):
    model, _ = load(model_dir)
    return model


def full_logprobs(model, prompt, tokens):
    """log p(tokens[i] | prompt + tokens[:i]) from one forward pass, (len(tokens), V)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)].log_softmax(-1)


def test_logprobs_match_a_full_forward(engine, reference):
    prompts = [engine.encode(p) for p in PROMPTS]
    out = engine.generate(prompts, SamplingParams(n=3, max_tokens=10, ignore_eos=True))
    worst = 0.0
    for p, samples in zip(prompts, out):
        assert len(samples) == 3
        for s in samples:
            assert len(s.token_ids) == 10 and s.finish_reason == "length"
            ref = full_logprobs(reference, p, s.token_ids).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 1e-4


def test_greedy_follows_the_argmax_chain(engine, reference):
    prompt = engine.encode(PROMPTS[1])
    (s,), = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ids = list(prompt)
    for _ in range(8):
        with torch.no_grad():
            ids.append(int(reference(torch.tensor([ids])).logits[0, -1].argmax()))
    assert s.token_ids == ids[len(prompt):]
    (s2,), = engine.generate([prompt], SamplingParams(temperature=0, top_k=5, max_tokens=8, ignore_eos=True))
    assert s2.token_ids == s.token_ids


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    prompt = engine.encode(PROMPTS[0])
    greedy = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0][0]
    for sp in (SamplingParams(top_k=1, max_tokens=6, ignore_eos=True, n=3),
               SamplingParams(top_p=1e-6, max_tokens=6, ignore_eos=True, n=3)):
        assert all(s.token_ids == greedy.token_ids for s in engine.generate([prompt], sp)[0])


def test_top_k_samples_stay_in_the_top_k(engine, reference):
    prompt = engine.encode(PROMPTS[0])
    samples = engine.generate([prompt], SamplingParams(top_k=3, temperature=1.5, max_tokens=6,
                                                       ignore_eos=True, n=8))[0]
    for s in samples:
        lp = full_logprobs(reference, prompt, s.token_ids)
        top3 = lp.topk(3, dim=-1).indices
        assert all(t in top3[i].tolist() for i, t in enumerate(s.token_ids))


def test_processed_logprobs_use_the_sampling_distribution(engine, reference):
    prompt = engine.encode(PROMPTS[0])
    (s,), = engine.generate([prompt], SamplingParams(temperature=0.5, max_tokens=5, ignore_eos=True,
                                                     logprobs_mode="processed"))
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + s.token_ids])).logits[0].float()
    scaled = (logits[len(prompt) - 1:-1] / 0.5).log_softmax(-1)
    ref = scaled.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4)


def test_processed_and_raw_logprobs_in_one_batch(engine, reference):
    prompt = engine.encode(PROMPTS[0])
    modes = [SamplingParams(temperature=0.5, max_tokens=5, ignore_eos=True, logprobs_mode=m)
             for m in ("processed", "raw")]
    (proc,), (raw,) = engine.generate([prompt, prompt], modes)
    for s, temperature in ((proc, 0.5), (raw, 1.0)):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + s.token_ids])).logits[0].float()
        lp = (logits[len(prompt) - 1:-1] / temperature).log_softmax(-1)
        ref = lp.gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
        assert torch.allclose(ref, torch.tensor(s.logprobs), atol=1e-4), s.logprobs


def test_seeded_engines_repeat_themselves(model_dir):
    runs = []
    for _ in range(2):
        e = LocalEngine.from_path(str(model_dir), seed=123)
        runs.append([s.token_ids for s in e.generate([e.encode("hi")], SamplingParams(n=4, max_tokens=6))[0]])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1  # n samples differ from each other


def _greedy(engine, prompt, k):
    return engine.generate([prompt], SamplingParams(temperature=0, max_tokens=k, ignore_eos=True))[0][0].token_ids


def test_stop_token_ends_each_row_on_its_own(engine):
    a, b = engine.encode(PROMPTS[0]), engine.encode(PROMPTS[1])
    ga, gb = _greedy(engine, a, 8), _greedy(engine, b, 8)
    stop = ga[2]
    first = ga.index(stop)
    out = engine.generate([a, b], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=(stop,),
                                                 ignore_eos=True))
    sa, sb = out[0][0], out[1][0]
    assert sa.token_ids == ga[:first + 1] and sa.finish_reason == "stop" and sa.stop_reason == stop
    expected_b = gb[:gb.index(stop) + 1] if stop in gb else gb
    assert sb.token_ids == expected_b
    assert sb.finish_reason == ("stop" if stop in gb else "length")


def test_stop_string_trims_text_and_keeps_the_token(engine):
    prompt = engine.encode(PROMPTS[1])
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True)
    engine.generator.manual_seed(7)
    full_ids = engine.generate([prompt], params)[0][0].token_ids  # varied, unlike a greedy loop
    # the stop string: the first token (after the first) whose text is one printable ASCII
    # character that the text before it, special tokens included, does not contain
    k, stop = next((k, engine.tokenizer.decode([t])) for k, t in enumerate(full_ids) if k > 0
                   and len(engine.tokenizer.decode([t])) == 1 and engine.tokenizer.decode([t]).isprintable()
                   and engine.tokenizer.decode([t]).isascii()
                   and engine.tokenizer.decode([t]) not in engine.tokenizer.decode(full_ids[:k]))
    engine.generator.manual_seed(7)
    (s,), = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, stop=(stop,)))
    assert s.finish_reason == "stop" and s.stop_reason == stop
    assert s.token_ids == full_ids[:k + 1]  # the token that made the stop string is kept
    assert s.text == engine.tokenizer.decode(full_ids[:k], skip_special_tokens=True)


def test_finished_rows_leave_the_batch_and_prompts_prefill_once(engine):
    sizes = []
    forward = engine.runner.forward

    def spy(tokens, *args, **kw):
        sizes.append(tuple(tokens.shape))
        return forward(tokens, *args, **kw)

    engine.runner.forward = spy
    a = engine.encode(PROMPTS[0])
    params = [SamplingParams(n=4, max_tokens=2, ignore_eos=True), SamplingParams(n=2, max_tokens=5, ignore_eos=True),
              SamplingParams(n=1, max_tokens=5, ignore_eos=True)]
    out = engine.generate([a, engine.encode(PROMPTS[2]), a], params)
    assert [len(x) for x in out] == [4, 2, 1]
    assert [len(s.token_ids) for x in out for s in x] == [2, 2, 2, 2, 5, 5, 5]
    # one prefill of the 2 distinct prompts, a step at all 7 rows, then only the 3 rows still going
    assert sizes[0] == (2, len(a)) and sizes[1] == (7, 1) and sizes[2:] == [(3, 1)] * 3


def test_weight_update_changes_outputs_and_version(engine):
    prompt = engine.encode(PROMPTS[0])
    before = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0][0]
    name = "model.layers.0.mlp.down_proj.weight"
    new = {name: torch.randn_like(engine._params[name]) * 0.5,
           "model.layers.0.self_attn.k_proj.weight": torch.randn_like(
               engine._params["model.layers.0.self_attn.k_proj.weight"])}
    engine.update_weights(new, version=7)
    after = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0][0]
    assert before.version == 0 and after.version == 7
    assert after.logprobs != before.logprobs
    # the engine computes with the new weights: compare against a fresh model with them loaded
    model, _ = load(engine_model_dir(engine))
    model.load_state_dict({**model.state_dict(), **new})
    ref = full_logprobs(model, prompt, after.token_ids).gather(-1, torch.tensor(after.token_ids)[:, None])[:, 0]
    assert torch.allclose(ref, torch.tensor(after.logprobs), atol=1e-4)


def engine_model_dir(engine):
    return engine.model.config._name_or_path


def test_bad_weight_updates_are_refused_whole(engine):
    p = engine._params["model.norm.weight"].clone()
    with pytest.raises(KeyError, match="no.such"):
        engine.update_weights({"model.norm.weight": p + 1, "no.such": p}, version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({"model.norm.weight": torch.zeros(3)}, version=1)
    assert torch.equal(engine._params["model.norm.weight"], p) and engine.version == 0


def test_bad_requests_are_clear_errors(engine):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1], []], SamplingParams())
    with pytest.raises(ValueError, match=r"prompt 0 has token id 100000, outside the model's vocabulary \[0, 320\)"):
        engine.generate([[1, 100000]], SamplingParams())
    with pytest.raises(ValueError, match="2 prompts but 1"):
        engine.generate([[1], [2]], [SamplingParams()])
    with pytest.raises(ValueError, match="positions"):
        engine.generate([[1] * 10], SamplingParams(max_tokens=10_000))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    assert engine.generate([], SamplingParams()) == []
