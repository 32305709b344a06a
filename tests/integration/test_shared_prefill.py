"""A prefill of prompts that start alike (a system prompt, tool schemas) computes their common
prefix once (inference/decode.py `_prefill_on_prefix`): the same logprobs as full forwards of
each prompt, in a fresh batch and when joining one that is decoding, with fewer tokens run."""

import pytest
import torch

from flywheel.inference import LocalEngine, SamplingParams
from flywheel.inference.decode import SHARED_PREFIX_MIN, DecodeRequest
from flywheel.models import TinySpec, build_tiny_model, load

SYSTEM = "You are a careful assistant. Tools: calc(expression) evaluates arithmetic exactly.\n"
QUESTIONS = ["What is 12 + 34?", "Add 7 and 8.", "Sum: 100, 250, 3", "Hi"]
SAMPLE = SamplingParams(n=3, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module", params=["mha", "gqa"])
def model_dir(request, tmp_path_factory):
    kv = 2 if request.param == "gqa" else None
    return build_tiny_model(tmp_path_factory.mktemp(request.param),
                            TinySpec(hidden=64, layers=2, heads=4, kv_heads=kv, ffn=128, seed=3))


@pytest.fixture(params=["dense", "packed"])
def engine(request, model_dir):
    return LocalEngine.from_path(str(model_dir), seed=0, lean=True, packed=request.param == "packed")


@pytest.fixture(scope="module")
def reference(model_dir):
    model, _ = load(model_dir)
    return model


def worst_logprob_error(reference, prompts, outputs) -> float:
    worst = 0.0
    for prompt, samples in zip(prompts, outputs):
        for s in samples:
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + s.token_ids])).logits[0].float()
            ref = logits[len(prompt) - 1:-1].log_softmax(-1).gather(-1, torch.tensor(s.token_ids)[:, None])[:, 0]
            worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    return worst


def spy_forwards(engine) -> list[tuple[int, int]]:
    shapes, forward = [], engine.runner.forward

    def spy(tokens, *args, **kw):
        shapes.append(tuple(tokens.shape))
        return forward(tokens, *args, **kw)

    engine.runner.forward = spy
    return shapes


def test_prompts_sharing_a_prefix_prefill_it_once_with_the_same_logprobs(engine, reference):
    prompts = [engine.encode(SYSTEM + q) for q in QUESTIONS]
    shared = len(engine.encode(SYSTEM))
    assert shared >= SHARED_PREFIX_MIN
    shapes = spy_forwards(engine)
    out = engine.generate(prompts, SAMPLE)
    longest = max(len(p) for p in prompts)
    assert shapes[0] == (1, shared) and shapes[1] == (len(prompts), longest - shared)  # prefix, then the rests
    assert worst_logprob_error(reference, prompts, out) < 1e-4


def test_greedy_is_the_same_with_and_without_sharing(model_dir):
    outs = []
    for share in (True, False):
        engine = LocalEngine.from_path(str(model_dir), seed=0, share_prefix=share)
        prompts = [engine.encode(SYSTEM + q) for q in QUESTIONS]
        outs.append([s[0].token_ids for s in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                                     ignore_eos=True))])
    assert outs[0] == outs[1]


def test_a_shared_prefill_joins_a_batch_that_is_decoding(engine, reference):
    first = engine.encode("12+34=")
    batch = engine.batch()
    batch.admit([DecodeRequest("first", first, SamplingParams(n=2, max_tokens=10, ignore_eos=True))])
    batch.step()
    batch.step()
    prompts = [engine.encode(SYSTEM + q) for q in QUESTIONS]
    batch.admit([DecodeRequest(i, p, SAMPLE) for i, p in enumerate(prompts)])
    done = {}
    while batch.live:
        done.update(dict(batch.step().finished))
    assert worst_logprob_error(reference, [first] + prompts, [done["first"]] + [done[i] for i in range(4)]) < 1e-4


def test_prompts_alike_for_fewer_tokens_than_the_minimum_prefill_whole(engine):
    prompts = [engine.encode("Hello there, " + q) for q in QUESTIONS]  # 13 tokens in common
    shapes = spy_forwards(engine)
    engine.generate(prompts, SAMPLE)
    assert shapes[0] == (len(prompts), max(len(p) for p in prompts))


def test_a_later_prefill_reuses_the_cached_prefix_with_the_same_logprobs(engine, reference):
    engine.generate([engine.encode(SYSTEM + q) for q in QUESTIONS[:2]], SAMPLE)  # computes and keeps the prefix
    shared = len(engine.encode(SYSTEM))
    assert len(engine.prefixes) == 1
    later = [engine.encode(SYSTEM + "What is 9 * 9?")]
    shapes = spy_forwards(engine)
    out = engine.generate(later, SAMPLE)
    assert shapes[0] == (1, len(later[0]) - shared)  # only the prompt's own tokens: the prefix came from the cache
    assert engine.prefixes.hits == 1 and engine.prefixes.tokens_reused == shared
    assert worst_logprob_error(reference, later, out) < 1e-4


def test_new_weights_empty_the_prefix_cache(engine):
    engine.generate([engine.encode(SYSTEM + q) for q in QUESTIONS[:2]], SAMPLE)
    assert len(engine.prefixes) == 1
    name = engine.state_names()[0]
    engine.update_weights({name: engine._params[name].detach() * 1.01}, version=1)
    assert len(engine.prefixes) == 0
    shapes = spy_forwards(engine)
    engine.generate([engine.encode(SYSTEM + "What is 9 * 9?")], SAMPLE)
    assert shapes[0][0] == 1 and shapes[0][1] == len(engine.encode(SYSTEM + "What is 9 * 9?"))  # whole, no stale keys


def test_a_cached_prefix_is_not_taken_when_computing_a_longer_one_saves_more(engine):
    engine.generate([engine.encode(SYSTEM + q) for q in QUESTIONS[:2]], SAMPLE)  # caches SYSTEM's prefix
    longer = SYSTEM + "Reply with the number only, and check the sum twice before answering. "
    prompts = [engine.encode(longer + q) for q in QUESTIONS]
    shapes = spy_forwards(engine)
    engine.generate(prompts, SAMPLE)
    assert shapes[0] == (1, len(engine.encode(longer)))  # a fresh, longer prefix ...
    assert len(engine.prefixes) == 2  # ... kept beside the first
