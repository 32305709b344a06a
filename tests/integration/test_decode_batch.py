"""DecodeBatch, the engine's one decode loop: stepping, joining, aborting, and what a weight
update does to rows in flight (pinned: they finish on the old version; follow: they go on
with the new weights, each token tagged with its version)."""

import threading

import pytest
import torch

from flywheel.inference import LocalEngine, SamplingParams
from flywheel.inference.decode import DecodeRequest
from flywheel.models import TinySpec, build_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("decode"), TinySpec(hidden=64, layers=2, heads=4, ffn=128, seed=5))


@pytest.fixture(params=["lean", "hf"])
def engine(request, model_dir):
    return LocalEngine.from_path(str(model_dir), seed=0, lean=request.param == "lean")


def _new_weights(engine, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    name = "model.layers.1.mlp.down_proj.weight"
    return {name: torch.randn(engine._params[name].shape, generator=g)}


def test_steps_report_every_row_and_generate_is_admit_then_step(engine):
    prompt = engine.encode("12+34=")
    ref = engine.generate([prompt], SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True))[0]
    batch = engine.batch()
    batch.admit([DecodeRequest("a", prompt, SamplingParams(n=2, temperature=0, max_tokens=5, ignore_eos=True))])
    seen, finished = [], []
    while batch.live:
        out = batch.step()
        assert out.keys == ["a", "a"] and out.indices == [0, 1] and out.versions == [0, 0]
        seen.append(out.tokens)
        finished += out.finished
    assert [key for key, _ in finished] == ["a"]
    samples = finished[0][1]
    assert [s.token_ids for s in samples] == [ref[0].token_ids] * 2 == [[t[0] for t in seen]] * 2
    assert samples[0].logprobs == pytest.approx(ref[0].logprobs, abs=1e-5)


def test_an_aborted_request_leaves_at_the_next_step_with_what_it_has(engine):
    batch = engine.batch()
    batch.admit([DecodeRequest("stay", engine.encode("abc"), GREEDY),
                 DecodeRequest("go", engine.encode("xyz"), SamplingParams(n=2, temperature=0, max_tokens=8,
                                                                          ignore_eos=True))])
    batch.step()
    batch.step()
    batch.abort("go")
    out = batch.step()
    assert out.keys == ["stay"]  # the aborted rows' tokens of this step are dropped
    (key, samples), = out.finished
    assert key == "go" and [s.finish_reason for s in samples] == ["cancelled"] * 2
    assert [len(s.token_ids) for s in samples] == [2, 2]
    while batch.live:
        last = batch.step()
    assert last.finished[0][1][0].finish_reason == "length"


def test_a_row_with_stop_strings_leaves_a_later_rows_finish_alone(engine):
    """Row 0 is checked for its stop strings (none reached) and goes on; row 1 ends by its budget
    in the same step and finishes by length. Regression: the stop-string check rebound the
    step's list of stop-token hits, so row 1's lookup raised a TypeError."""
    batch = engine.batch()
    batch.admit([DecodeRequest("long", engine.encode("abc"), SamplingParams(temperature=0, max_tokens=4,
                                                                            ignore_eos=True, stop=("\x00never",))),
                 DecodeRequest("short", engine.encode("xyz"), SamplingParams(temperature=0, max_tokens=2,
                                                                             ignore_eos=True))])
    finished = {}
    while batch.live:
        finished.update(batch.step().finished)
    assert [s.finish_reason for s in finished["short"]] == ["length"]
    assert [s.finish_reason for s in finished["long"]] == ["length"]
    assert [len(s.token_ids) for s in finished["long"] + finished["short"]] == [4, 2]


def test_a_refused_request_is_named_and_nothing_is_admitted(engine):
    batch = engine.batch()
    with pytest.raises(ValueError, match=r"request 'bad' has token id 100000, outside"):
        batch.admit([DecodeRequest("ok", [1, 2], GREEDY), DecodeRequest("bad", [100000], GREEDY)])
    assert batch.live == 0 and not engine._pins  # no pin is left behind
    with pytest.raises(ValueError, match="adapter"):
        batch.admit([DecodeRequest("lora", [1, 2], GREEDY, adapter="tenant-a")])


def test_a_pinned_batch_finishes_on_the_old_weights_and_the_update_waits(engine):
    prompt = engine.encode("a longer prompt")
    ref = engine.generate([prompt], GREEDY)[0][0]
    batch = engine.batch()
    batch.admit([DecodeRequest(0, prompt, GREEDY)])
    batch.step()
    updated = threading.Event()
    updater = threading.Thread(target=lambda: (engine.update_weights(_new_weights(engine, 1), version=3),
                                               updated.set()))
    updater.start()
    while not engine.update_waiting:  # the update is waiting for the batch
        updater.join(0.01)
    assert not batch.can_join or batch.live == 0  # a batch an update waits on takes nobody new
    outs = []
    while batch.live:
        assert not updated.is_set()
        outs.append(batch.step())
    updater.join(20)
    assert updated.is_set() and engine.version == 3
    (_, (sample,)), = outs[-1].finished
    assert sample.token_ids == ref.token_ids and sample.version == 0 and sample.token_versions is None
    assert sample.logprobs == pytest.approx(ref.logprobs, abs=1e-5)
    after = engine.generate([prompt], GREEDY)[0][0]
    assert after.version == 3 and after.logprobs != pytest.approx(ref.logprobs, abs=1e-3)


def test_a_following_batch_takes_an_update_between_steps_and_tags_each_token(engine):
    prompt = engine.encode("a longer prompt")
    ref = engine.generate([prompt], GREEDY)[0][0]
    batch = engine.batch(follow=True)
    batch.admit([DecodeRequest(0, prompt, GREEDY)])
    versions = [batch.step().versions[0] for _ in range(3)]
    engine.update_weights(_new_weights(engine, 2), version=9)  # lands at once: nothing pins the weights
    while batch.live:
        out = batch.step()
        versions += out.versions
    (_, (sample,)), = out.finished
    # tokens 0-2 came from version-0 logits; token 3 from the last version-0 forward (run
    # before the update); from token 4 on, from version-9 forwards
    assert versions == sample.token_versions == [0, 0, 0, 0, 9, 9, 9, 9]
    assert sample.version == 0 and engine.version == 9
    assert sample.token_ids[:4] == ref.token_ids[:4]
    assert sample.logprobs[:4] == pytest.approx(ref.logprobs[:4], abs=1e-5)
    assert sample.logprobs[4:] != pytest.approx(ref.logprobs[4:], abs=1e-3)


def test_requests_join_a_running_batch_without_changing_greedy_answers(model_dir):
    engine = LocalEngine.from_path(str(model_dir), seed=0, lean=True)
    prompts = [engine.encode(t) for t in ("x", "12+34=", "a much longer prompt than the others")]
    refs = [engine.generate([p], GREEDY)[0][0] for p in prompts]
    batch = engine.batch(max_rows=8)
    batch.admit([DecodeRequest(0, prompts[0], GREEDY)])
    done = {}
    for i in range(1, 3):
        for key, samples in batch.step().finished:
            done[key] = samples[0]
        batch.admit([DecodeRequest(i, prompts[i], GREEDY)])
    while batch.live:
        for key, samples in batch.step().finished:
            done[key] = samples[0]
    for i, ref in enumerate(refs):
        assert done[i].token_ids == ref.token_ids
        assert done[i].logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_the_hf_runner_batch_takes_requests_only_when_empty(model_dir):
    engine = LocalEngine.from_path(str(model_dir), seed=0, lean=False)
    batch = engine.batch()
    batch.admit([DecodeRequest(0, [5, 6], GREEDY)])
    batch.step()
    assert not batch.can_join
    with pytest.raises(RuntimeError, match="takes no request"):
        batch.admit([DecodeRequest(1, [7], GREEDY)])


def _full_forward_logprobs(model_dir, weights: dict[str, torch.Tensor] | None, prompt: list[int],
                           tokens: list[int]) -> list[float]:
    """log p(token_i | prompt, tokens_<i) by one plain forward of the whole sequence under the
    model's weights with `weights` swapped in."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for name, value in (weights or {}).items():
            model.get_parameter(name).copy_(value)
        ids = torch.tensor([prompt + tokens])
        lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_a_recomputing_batch_matches_a_full_forward_of_the_mixed_sequence(model_dir):
    """In-flight updates with keys and values recomputed: rows of different lengths (and one
    that joins after the update) go on under the new weights, and every token's logprob is
    a full forward's of the whole mixed sequence under the version it is tagged with."""
    engine = LocalEngine.from_path(str(model_dir), seed=0, lean=True)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    prompts = {"a": engine.encode("12+34="), "b": engine.encode("a much longer prompt"), "c": engine.encode("x")}
    batch = engine.batch(follow=True, recompute=True)
    batch.admit([DecodeRequest(k, prompts[k], params) for k in ("a", "b")])
    done = {}
    for _ in range(3):
        done.update(batch.step().finished)
    new = _new_weights(engine, 7)
    engine.update_weights(new, version=4)  # lands between two steps: nothing pins a following batch
    batch.admit([DecodeRequest("c", prompts["c"], params)])  # joins on the new weights
    while batch.live:
        done.update(batch.step().finished)
    weights = {0: None, 4: new}
    for key in ("a", "b", "c"):
        (sample,) = done[key]
        versions = sample.token_versions
        assert versions == ([0] * 3 + [4] * 5 if key != "c" else [4] * 8), (key, versions)
        for v in set(versions):
            want = _full_forward_logprobs(model_dir, weights[v], prompts[key], sample.token_ids)
            got = [lp for lp, tv in zip(sample.logprobs, versions) if tv == v]
            assert got == pytest.approx([w for w, tv in zip(want, versions) if tv == v], abs=1e-4), (key, v)
    with pytest.raises(ValueError, match="recompute needs follow=True"):
        engine.batch(recompute=True)


def test_generate_with_a_between_steps_hook_takes_an_update_mid_sample(model_dir):
    """LocalEngine.generate as a rollout worker runs it with in-flight updates: the hook (the
    worker's weight pickup) lands version 4 before the fourth step; samples carry both
    versions and each token is a full forward's under its own."""
    engine = LocalEngine.from_path(str(model_dir), seed=0, lean=True)
    new = _new_weights(engine, 11)
    calls = []

    def hook():
        calls.append(engine.version)
        if len(calls) == 4:
            engine.update_weights(new, version=4)

    engine.between_steps = hook
    prompt = engine.encode("12+34=")
    (sample,), = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True))
    assert sample.token_versions == [0] * 3 + [4] * 5 and sample.version == 0
    for v, weights in ((0, None), (4, new)):
        want = _full_forward_logprobs(model_dir, weights, prompt, sample.token_ids)
        got = [(lp, w) for lp, w, tv in zip(sample.logprobs, want, sample.token_versions) if tv == v]
        assert [g for g, _ in got] == pytest.approx([w for _, w in got], abs=1e-4), v
