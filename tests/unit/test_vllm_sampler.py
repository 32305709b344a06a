"""VLLMSampler on CPU: request building, parsing of recorded vLLM outputs (tests/data/vllm/,
hand-written from vLLM's output classes), the version a sample reports, and the start-time
refusal when vLLM is absent. Nothing here runs vLLM."""

from __future__ import annotations

import builtins
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from flywheel.config import ConfigError
from flywheel.inference.sampler import Sampler, SamplingParams
from flywheel.inference.vllm_sampler import (EXTENSION, TokenVersions, VLLMSampler, VLLMUnavailable,
                                             WeightUpdateExtension, build_sampling_params, parse_output,
                                             require_vllm, to_json)

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"


def load(name: str):
    """A fixture as objects of RequestOutput's attribute shape (Logprob dict keys back to ints)."""
    raw = json.loads((DATA / name).read_text())
    outputs = []
    for c in raw["outputs"]:
        lps = None if c["logprobs"] is None else [
            {int(t): SimpleNamespace(**e) for t, e in p.items()} for p in c["logprobs"]]
        outputs.append(SimpleNamespace(**{**c, "logprobs": lps}))
    return SimpleNamespace(**{**raw, "outputs": outputs})


# ---------------------------------------------------------------------------- requests


def test_every_field_is_mapped():
    p = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=5, max_tokens=12, stop_token_ids=(7, 9),
                       stop=("</a>",), ignore_eos=True, logprobs_mode="processed", top_logprobs=4)
    kw = build_sampling_params(p, engine_logprobs_mode="processed_logprobs", seed=11)
    assert kw == {"n": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 12,
                  "stop_token_ids": [7, 9], "stop": ["</a>"], "include_stop_str_in_output": False,
                  "ignore_eos": True, "logprobs": 4, "detokenize": True, "skip_special_tokens": True, "seed": 11}


def test_defaults_ask_the_sampled_logprob_alone_and_no_seed():
    kw = build_sampling_params(SamplingParams())
    assert kw["logprobs"] == 0 and "seed" not in kw and kw["stop"] == [] and kw["stop_token_ids"] == []


def test_greedy_drops_top_p_and_top_k():
    kw = build_sampling_params(SamplingParams(temperature=0, top_p=0.5, top_k=3))
    assert (kw["temperature"], kw["top_p"], kw["top_k"]) == (0.0, 1.0, 0)


@pytest.mark.parametrize("params, engine, field", [
    (SamplingParams(logprobs_mode="processed"), "raw_logprobs", "logprobs_mode='processed'"),
    (SamplingParams(logprobs_mode="raw"), "processed_logprobs", "logprobs_mode='raw'"),
    (SamplingParams(), "raw_logits", "engine logprobs_mode 'raw_logits'"),
    (SamplingParams(temperature=2.5), "raw_logprobs", "temperature=2.5"),
    (SamplingParams(temperature=0.005), "raw_logprobs", "temperature=0.005"),
    (SamplingParams(temperature=0, n=2), "raw_logprobs", "n=2 with temperature=0"),
    (SamplingParams(top_logprobs=21), "raw_logprobs", "top_logprobs=21"),
])
def test_refusals_name_the_field(params, engine, field):
    with pytest.raises(ValueError, match=field.replace("(", r"\(")):
        build_sampling_params(params, engine_logprobs_mode=engine)


def test_max_logprobs_is_the_engines():
    assert build_sampling_params(SamplingParams(top_logprobs=30), max_logprobs=32)["logprobs"] == 30
    assert build_sampling_params(SamplingParams(top_logprobs=30), max_logprobs=-1)["logprobs"] == 30


# ---------------------------------------------------------------------------- responses


def test_n2_length_and_eos():
    a, b = parse_output(load("n2_top2_length_eos.json"), version=7, prompt_index=3)
    assert a.token_ids == [19, 374, 432, 13] and a.finish_reason == "length" and a.stop_reason is None
    assert a.logprobs == [-0.105361, -1.609438, -2.995732, -0.356675]
    assert b.token_ids == [20, 151645] and b.logprobs == [-2.302585, -0.040822]
    assert b.finish_reason == "stop" and b.stop_reason == 151645  # eos: vLLM says None, LocalEngine the id
    for s in (a, b):
        assert s.version == 7 and s.prompt_index == 3 and s.prompt_len == 12
        assert s.top_logprobs is None and s.token_versions is None
    assert a.text == "4 is it." and b.text == "5"


def test_top_logprobs_are_the_top_k_best_first_without_the_sampled_token_outside_them():
    a, b = parse_output(load("n2_top2_length_eos.json"), version=0, top_logprobs=2)
    assert a.top_logprobs == [[(19, -0.105361), (20, -2.302585)], [(13, -0.510826), (374, -1.609438)],
                              [(279, -0.693147), (264, -1.203973)], [(13, -0.356675), (0, -1.89712)]]
    assert b.top_logprobs[0] == [(19, -0.105361), (20, -2.302585)]
    one = parse_output(load("n2_top2_length_eos.json"), version=0, top_logprobs=1)[0]
    assert one.top_logprobs[2] == [(279, -0.693147)]


def test_stop_string_keeps_the_token_and_cuts_the_text():
    (s,) = parse_output(load("stop_string.json"), version=1)
    assert s.finish_reason == "stop" and s.stop_reason == "</answer>"
    assert s.token_ids == [27, 9217, 29, 19, 522, 9217, 29] and s.text == "<answer>4"
    assert len(s.logprobs) == 7 and s.logprobs[-1] == -0.001


def test_stop_token_and_filtered_alternatives_dropped():
    (s,) = parse_output(load("stop_token_processed_topk.json"), version=2, top_logprobs=3)
    assert s.finish_reason == "stop" and s.stop_reason == 151643 and s.token_ids == [19, 151643]
    assert s.logprobs == [-0.040822, -0.693147]
    assert s.top_logprobs == [[(19, -0.040822), (20, -3.218876)], [(151645, -0.693147), (151643, -0.693147)]]
    assert all(math.isfinite(lp) for row in s.top_logprobs for _, lp in row)


def test_abort_is_cancelled_and_unknown_reasons_raise():
    out = load("n2_top2_length_eos.json")
    out.outputs[0].finish_reason = "abort"
    assert parse_output(out, version=0)[0].finish_reason == "cancelled"
    for reason, words in [(None, "has not finished"), ("error", "'error'"), ("repetition", "'repetition'")]:
        out.outputs[0].finish_reason = reason
        with pytest.raises(ValueError, match=words):
            parse_output(out, version=0)


def test_malformed_outputs_raise():
    out = load("stop_string.json")
    out.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="no logprobs"):
        parse_output(out, version=0)
    out = load("stop_string.json")
    out.outputs[0].logprobs.pop()
    with pytest.raises(ValueError, match="7 tokens but 6 logprob positions"):
        parse_output(out, version=0)
    out = load("stop_string.json")
    del out.outputs[0].logprobs[0][27]
    with pytest.raises(ValueError, match="token 0 \\(27\\) is missing"):
        parse_output(out, version=0)


def test_completions_come_back_in_index_order():
    out = load("n2_top2_length_eos.json")
    out.outputs.reverse()
    assert [s.token_ids[0] for s in parse_output(out, version=0)] == [19, 20]


def test_to_json_round_trips_a_fixture():
    name = "n2_top2_length_eos.json"
    again = to_json(load(name))
    for c in again["outputs"]:
        c.update(routed_experts=None, kv_transfer_params=None)
    assert again == json.loads((DATA / name).read_text())


# ---------------------------------------------------------------------------- versions in flight


def test_token_versions_tag_new_tokens_on_arrival():
    final = load("n2_top2_length_eos.json")
    tags = TokenVersions()

    def partial(lengths):
        return SimpleNamespace(request_id="0", outputs=[SimpleNamespace(index=c.index, token_ids=c.token_ids[:n])
                                                        for c, n in zip(final.outputs, lengths)])

    tags.observe(partial([1, 1]), version=4)
    tags.observe(partial([3, 1]), version=4)
    tags.observe(partial([4, 2]), version=5)  # an update landed between two outputs
    a, b = parse_output(final, version=99, token_versions=tags.pop("0"))
    assert a.token_versions == [4, 4, 4, 5] and a.version == 4
    assert b.token_versions == [4, 5] and b.version == 4
    assert tags.pop("0") == {}
    tags.observe(partial([2, 2]), version=1)
    with pytest.raises(ValueError, match="CUMULATIVE"):
        tags.observe(partial([1, 2]), version=1)
    with pytest.raises(ValueError, match="4 tokens but 2 version tags"):
        parse_output(final, version=0, token_versions={0: [1, 1], 1: [1, 1]})


# ---------------------------------------------------------------------------- the sampler


class FakeLLM:
    """Stands in for vllm.LLM: answers generate with fixtures, records RPCs."""

    def __init__(self, outputs):
        self.outputs, self.calls, self.rpcs, self.resets = outputs, [], [], 0

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        return self.outputs

    def collective_rpc(self, method, args=()):
        self.rpcs.append((method, args))
        return [None]

    def reset_prefix_cache(self):
        self.resets += 1
        return True


def test_sampler_generates_with_the_version_it_holds():
    llm = FakeLLM([load("n2_top2_length_eos.json"), load("stop_string.json")])
    s = VLLMSampler(llm=llm, version=3)
    assert isinstance(s, Sampler)
    params = [SamplingParams(n=2, top_logprobs=2), SamplingParams(stop=("</answer>",))]
    first, second = s.generate([[1, 2], [3]], params)
    prompts, built = llm.calls[0]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3]}]
    assert built[0]["n"] == 2 and built[0]["logprobs"] == 2 and built[1]["stop"] == ["</answer>"]
    assert [x.version for x in first + second] == [3, 3, 3]
    assert [x.prompt_index for x in first + second] == [0, 0, 1]
    assert first[0].top_logprobs is not None and second[0].top_logprobs is None

    s.update_weights({"model.norm.weight": "tensor"}, version=4)
    assert llm.rpcs == [("flywheel_load_weights", ([("model.norm.weight", "tensor")],))] and llm.resets == 1
    assert all(x.version == 4 for row in s.generate([[1, 2], [3]], params) for x in row)


def test_sampler_refuses_before_calling_the_engine():
    llm = FakeLLM([])
    s = VLLMSampler(llm=llm, logprobs_mode="raw")
    with pytest.raises(ValueError, match="prompt 1: logprobs_mode='processed'"):
        s.generate([[1], [2]], [SamplingParams(), SamplingParams(logprobs_mode="processed")])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        s.generate([[]], SamplingParams())
    assert llm.calls == []


def test_a_failed_prefix_cache_reset_is_an_error():
    llm = FakeLLM([])
    llm.reset_prefix_cache = lambda: False
    s = VLLMSampler(llm=llm, version=1)
    with pytest.raises(RuntimeError, match="prefix cache"):
        s.update_weights({}, version=2)
    assert s.version == 1


def test_extension_loads_named_tensors_into_the_model():
    loaded = []
    worker = type("Worker", (WeightUpdateExtension,), {})()
    worker.device = "cpu"
    worker.model_runner = SimpleNamespace(model=SimpleNamespace(load_weights=lambda weights: loaded.extend(weights)))
    t = SimpleNamespace(to=lambda device: f"on {device}")
    worker.flywheel_load_weights([("w", t)])
    assert loaded == [("w", "on cpu")]
    assert EXTENSION.rsplit(".", 1)[1] == WeightUpdateExtension.__name__


class WorkerLLM:
    """Stands in for vllm.LLM with one worker in this process: collective_rpc runs the
    WeightUpdateExtension method on it, as vLLM runs it in each worker. Its model is a
    torch module whose load_weights copies named tensors in (vLLM's loader, by HF name)."""

    def __init__(self, like: dict):
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                for name, t in like.items():
                    self.register_parameter(name, torch.nn.Parameter(torch.zeros_like(t), requires_grad=False))

            def load_weights(self, weights):
                for name, t in weights:
                    getattr(self, name).data.copy_(t)

        self.worker = type("Worker", (WeightUpdateExtension,), {})()
        self.worker.rank, self.worker.device = 0, "cpu"
        self.worker.model_runner = SimpleNamespace(model=Model())
        self.resets = 0

    def collective_rpc(self, method, args=()):
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self):
        self.resets += 1
        return True


def _broadcast_group(sampler, like):
    """(publisher, the sampler's end) of a fresh gloo group: the sampler's worker as rank 1."""
    import threading

    from flywheel.weights.broadcast import BroadcastTransport

    store = BroadcastTransport.host()
    specs = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in like.items()]
    ends = []
    joining = threading.Thread(target=lambda: ends.append(
        sampler.join_broadcast("127.0.0.1", store.port, 1, 2, specs, "gloo")))
    joining.start()
    publisher = BroadcastTransport.publisher(like, store, 2)
    joining.join(30)
    return publisher, ends[0]


def test_vllm_workers_join_the_weight_broadcast_and_load_whole_versions():
    import torch

    like = {"w": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.bfloat16)}
    llm = WorkerLLM(like)
    sampler = VLLMSampler(llm=llm, version=-1)
    model = llm.worker.model_runner.model
    publisher, end = _broadcast_group(sampler, like)
    try:
        assert end.version() == -1 and end.error is None and not sampler.receive(end)
        for v in (1, 2):
            sent = {"w": torch.full((3, 4), float(v)), "b": torch.arange(5, dtype=torch.bfloat16) + v}
            publisher.publish(sent, v)
            assert end.wait_newer(v - 1, timeout_s=10) == v
            assert sampler.receive(end) and sampler.version == v and llm.resets == v
            assert torch.equal(model.w, sent["w"]) and torch.equal(model.b, sent["b"])
            assert not sampler.receive(end)  # nothing newer: no load, no cache reset
            assert llm.resets == v
        with pytest.raises(TimeoutError, match="newer than v2"):
            end.wait_newer(2, timeout_s=0.2)
        # the group formed again (a member died): the old end's close spares the new one
        publisher.close()
        publisher, fresh = _broadcast_group(sampler, like)
        end.close()
        publisher.publish({"w": torch.full((3, 4), 7.0), "b": torch.zeros(5, dtype=torch.bfloat16)}, 7)
        assert fresh.wait_newer(2, timeout_s=10) == 7 and sampler.receive(fresh)
        assert torch.equal(model.w, torch.full((3, 4), 7.0))
        publisher.close()  # the publisher gone: the worker's end ends with the error, and says so
        with pytest.raises(RuntimeError, match="the weight group broke"):
            fresh.wait_newer(7, timeout_s=20)
        assert fresh.error is not None
    finally:
        publisher.close()
        llm.worker.flywheel_leave_broadcast(llm.worker._flywheel_broadcast_end)
    assert end.error == "this vLLM worker has not joined a weight broadcast group"


def test_a_ray_actors_group_weights_drive_a_vllm_sampler():
    pytest.importorskip("ray")
    import torch

    from flywheel.orchestrate.ray_rollouts import GroupWeights
    from flywheel.weights.broadcast import BroadcastTransport

    like = {"w": torch.zeros(2, 2)}
    llm = WorkerLLM(like)
    sampler = VLLMSampler(llm=llm, version=-1)
    weights = GroupWeights(sampler)
    store = BroadcastTransport.host()
    import threading

    joining = threading.Thread(target=weights.join, args=("127.0.0.1", store.port, 1, 2, [("w", "float32", [2, 2])],
                                                            "gloo"))
    joining.start()
    publisher = BroadcastTransport.publisher(like, store, 2)
    joining.join(30)
    try:
        publisher.publish({"w": torch.ones(2, 2)}, 3)
        waited, loaded = weights.take(3)  # waits for v3 through the worker's end, then loads it
        assert sampler.version == 3 and torch.equal(llm.worker.model_runner.model.w, torch.ones(2, 2))
    finally:
        publisher.close()
        weights.transport.close()


# ---------------------------------------------------------------------------- without vLLM


def test_require_vllm_names_the_install_command(monkeypatch):
    real = builtins.__import__

    def no_vllm(name, *a, **kw):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    for make in (require_vllm, lambda: VLLMSampler("/models/tiny")):
        with pytest.raises(VLLMUnavailable) as e:
            make()
        assert isinstance(e.value, ConfigError) and isinstance(e.value, ValueError)
        assert "rollout.engine: vllm" in str(e.value) and "pip install 'flywheel[vllm]'" in str(e.value)
        assert "CUDA GPU" in str(e.value)


def test_a_run_on_the_vllm_engine_fails_before_it_starts_where_vllm_is_absent(tmp_path, monkeypatch):
    """rollout.engine: vllm without vLLM: refused by run_rl before a model loads, naming the install
    command; and the engine is refused outside Ray actors by the config itself."""
    import builtins

    from flywheel.config import ConfigError, RLConfig, validate
    from flywheel.train.rl import run_rl

    real_import = builtins.__import__

    def no_vllm(name, *args, **kwargs):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError("No module named 'vllm'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_vllm)
    raw = dict(model=str(tmp_path / "absent-model"), output_dir=str(tmp_path / "run"), env={"name": "arithmetic"},
               rollout={"backend": "ray", "engine": "vllm"})
    with pytest.raises(ConfigError, match=r"pip install 'flywheel\[vllm\]'"):
        run_rl(validate(raw, RLConfig), log=lambda m: None)
    assert not (tmp_path / "run").exists()  # nothing started
    with pytest.raises(ConfigError, match="rollout.backend=ray"):
        validate({**raw, "rollout": {"engine": "vllm"}}, RLConfig)
