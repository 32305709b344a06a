"""The OpenAI-compatible server through a real HTTP server on loopback and the official client."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from flywheel.inference import LocalEngine, Sample, SamplingParams
from flywheel.registry import Registry
from flywheel.traces import TraceStore
from flywheel.models import ChatRenderer, TinySpec, build_tiny_model
from flywheel.serve import OpenAIService, ProductionFollower, TraceStoreSink, registry_lookup
from flywheel.serve.responses import assistant_message
from live_server import serve_openai

SPEC = TinySpec(hidden=64, layers=2, heads=4, ffn=128)
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+34="}]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    return (build_tiny_model(root / "v1", SPEC),
            build_tiny_model(root / "v2", TinySpec(**{**SPEC.__dict__, "seed": 1})))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = TraceStore(f"sqlite:///{tmp_path_factory.mktemp('traces') / 'traces.db'}")
    yield s
    s.close()


@pytest.fixture(scope="module")
def live(model_dirs, store):
    sink = TraceStoreSink(store, interval_s=0.02)
    service = OpenAIService(model_dirs[0], version="v1", trace_sink=sink, default_max_tokens=12, window_s=0.005)
    srv, client = serve_openai(service)
    yield service, srv, client, sink
    srv.close()
    service.close()


def greedy(engine, prompt_ids, max_tokens, n=1):
    return [s.text for s in engine.generate([prompt_ids], SamplingParams(n=n, temperature=0, max_tokens=max_tokens))[0]]


# --------------------------------------------------------------------------- endpoints


def test_models_lists_the_served_name_and_version(live):
    service, srv, client, _ = live
    assert [m.id for m in client.models.list()] == ["flywheel"]
    assert httpx.get(srv.url + "/models").json()["data"][0]["version"] == "v1"


def test_chat_completion_matches_the_engine(live):
    service, _, client, _ = live
    r = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=8, temperature=0)
    prompt = ChatRenderer(service.engine.tokenizer).prompt_ids(HELLO)
    assert r.object == "chat.completion" and r.model == "flywheel" and r.system_fingerprint == "v1"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy(service.engine, prompt, 8)[0]
    assert r.usage.prompt_tokens == len(prompt)
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason in ("stop", "length")


def test_n_samples_and_usage(live):
    _, _, client, _ = live
    r = client.chat.completions.create(model="flywheel", messages=HELLO, n=3, max_completion_tokens=6,
                                       temperature=1.0, top_p=0.9)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens <= 18 and r.usage.completion_tokens >= 3


def test_seed_repeats_the_samples(live):
    _, _, client, _ = live
    texts = [client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=8, seed=7,
                                            n=2).choices for _ in range(2)]
    assert [c.message.content for c in texts[0]] == [c.message.content for c in texts[1]]


def test_streaming_reassembles_to_the_full_text(live):
    _, srv, client, _ = live
    full = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=12, temperature=0, n=2)
    stream = client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=12, temperature=0, n=2,
                                            stream=True, stream_options={"include_usage": True})
    text, finish, usage, chunks = {0: "", 1: ""}, {}, None, 0
    for chunk in stream:
        chunks += 1
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert chunks > 4
    assert text == {c.index: c.message.content for c in full.choices}
    assert finish == {c.index: c.finish_reason for c in full.choices}
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    raw = httpx.post(srv.url + "/chat/completions", json={"model": "flywheel", "messages": HELLO, "max_tokens": 4,
                                                             "stream": True}).text
    assert raw.startswith("data: {") and raw.endswith("data: [DONE]\n\n")


def test_completions_endpoint(live):
    service, _, client, _ = live
    r = client.completions.create(model="flywheel", prompt=["12+34=", "ab"], n=2, max_tokens=5, temperature=0)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    for i, p in enumerate(["12+34=", "ab"]):
        expected = greedy(service.engine, service.engine.encode(p), 5)[0]
        assert r.choices[2 * i].text == r.choices[2 * i + 1].text == expected
    assert r.usage.prompt_tokens == len("12+34=") + len("ab")  # one byte-level token per character
    one = client.completions.create(model="flywheel", prompt="12+34=", max_tokens=5, temperature=0, stop=["\n"])
    assert one.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="flywheel", prompt="12+34=", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == one.choices[0].text == greedy(service.engine, service.engine.encode("12+34="), 5)[0]


# --------------------------------------------------------------------------- tools


def test_tool_history_and_tools_are_rendered(live):
    service, _, client, _ = live
    messages = [*HELLO,
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "12+34"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "46"}]
    r = client.chat.completions.create(model="flywheel", messages=messages, tools=[CALC], max_tokens=4)
    prompt = ChatRenderer(service.engine.tokenizer).prompt_ids(messages, [CALC])
    assert r.usage.prompt_tokens == len(prompt)
    text = service.engine.tokenizer.decode(prompt)
    assert '"name": "calc"' in text and "<tool_response>\n46\n</tool_response>" in text


def test_response_builder_parses_tool_calls():
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>'
    message, finish = assistant_message(text, tools_offered=True, finish_reason="stop")
    assert finish == "tool_calls" and message["content"] == "Let me compute."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {"expr": "2*3"}
    # no tools offered: the text stays text; a malformed call stays text; a cut-off turn says "length"
    assert assistant_message(text, tools_offered=False, finish_reason="stop") == (
        {"role": "assistant", "content": text}, "stop")
    bad = "<tool_call>{not json}</tool_call>"
    assert assistant_message(bad, tools_offered=True, finish_reason="stop")[0]["content"] == bad
    assert assistant_message(text, tools_offered=True, finish_reason="length")[1] == "length"


class ScriptedEngine:
    """Answers every prompt with a fixed text (the tiny random model never writes a tool call)."""

    def __init__(self, tokenizer, text: str):
        self.tokenizer, self.text, self.version = tokenizer, text, 0
        self.max_positions, self.vocab_size = 4096, len(tokenizer)
        self.generator = torch.Generator()

    def encode(self, text):
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, prompts, params):
        eos = self.tokenizer.eos_token_id
        ids = self.encode(self.text) + [eos]
        return [[Sample(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", version=0, prompt_index=i,
                        stop_reason=eos, text=self.text, prompt_len=len(p)) for _ in range(sp.n)]
                for i, (p, sp) in enumerate(zip(prompts, params))]


def test_tool_calls_over_the_wire_and_into_traces(model_dirs, store):
    engine = LocalEngine.from_path(str(model_dirs[0]))
    text = 'Using the calculator.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "7*6"}}\n</tool_call>'
    sink = TraceStoreSink(store, interval_s=0.02)
    service = OpenAIService(ScriptedEngine(engine.tokenizer, text), version="scripted", trace_sink=sink)
    srv, client = serve_openai(service)
    try:
        r = client.chat.completions.create(model="flywheel", messages=HELLO, tools=[CALC])
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Using the calculator."
        [call] = choice.message.tool_calls
        assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expr": "7*6"}
        # streamed: the client's deltas rebuild the same call
        name, args = "", ""
        for chunk in client.chat.completions.create(model="flywheel", messages=HELLO, tools=[CALC], stream=True):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    name += (tc.function.name or "") if tc.function else ""
                    args += (tc.function.arguments or "") if tc.function else ""
        assert name == "calc" and json.loads(args) == {"expr": "7*6"}
        # tool_choice="none": no tools rendered, no parsing
        plain = client.chat.completions.create(model="flywheel", messages=HELLO, tools=[CALC], tool_choice="none")
        assert plain.choices[0].finish_reason == "stop" and plain.choices[0].message.tool_calls is None
        assert sink.flush()
        trace = store.get(r.id)
        assert trace.model_version == "scripted" and trace.tools == [CALC]
        assert trace.response["tool_calls"][0]["function"]["name"] == "calc"
    finally:
        srv.close()
        service.close()


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("change, param, words", [
    ({"model": "gpt-4"}, "model", "unknown model 'gpt-4'"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "unknown role 'robot'"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"max_tokens": 100_000}, "max_tokens", "context"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}, "messages",
     "system message may only come first"),
    ({"messages": []}, "messages", "at least 1"),
    ({"presence_penalty": 0.5}, None, "presence_penalty is not supported"),
    ({"bogus": 1}, "bogus", "unknown field"),
])
def test_errors_have_the_openai_shape(live, change, param, words):
    _, _, client, _ = live
    body = {"model": "flywheel", "messages": HELLO, "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{k: v for k, v in body.items() if k != "bogus"},
                                       extra_body={"bogus": 1} if "bogus" in change else None)
    error = info.value.response.json()["error"]
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error


def test_raw_http_errors(live):
    _, srv, _, _ = live
    r = httpx.post(srv.url + "/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(srv.url + "/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(srv.url + "/completions", json={"model": "flywheel", "prompt": [[5, 99999]]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "vocabulary" in r.json()["error"]["message"]


# --------------------------------------------------------------------------- batching


def _hold_first_forward(engine, until):
    """Patch `engine.runner.forward`: its first call waits until `until()` is true (20 s at most)."""
    original = engine.runner.forward
    calls = []

    def held(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            deadline = time.monotonic() + 20
            while not until() and time.monotonic() < deadline:
                time.sleep(0.005)
        return original(*args, **kw)

    engine.runner.forward = held
    return lambda: delattr(engine.runner, "forward")


def test_a_burst_joins_the_running_batch(model_dirs):
    """Continuous batching: the first prefill is held until all 8 requests of a burst were
    submitted; those not in the first group join the running batch at its next step, in
    one prefill, and all 8 decode together."""
    service = OpenAIService(model_dirs[0], version="v1", window_s=0.005)
    srv, _ = serve_openai(service)
    sched = service.scheduler
    submitted = []
    submit = sched.submit
    sched.submit = lambda *a, **kw: submitted.append(1) or submit(*a, **kw)
    restore = _hold_first_forward(service.engine, lambda: len(submitted) >= 8)
    try:
        async def burst():
            client = openai.AsyncOpenAI(base_url=srv.url, api_key="unused", max_retries=0)
            return await asyncio.gather(*(client.chat.completions.create(
                model="flywheel", messages=[{"role": "user", "content": f"question {i}"}], max_tokens=6,
                temperature=0) for i in range(8)))
        results = asyncio.run(burst())
    finally:
        restore()
        srv.close()
        service.close()
    stats = sched.stats
    assert len(results) == 8 and all(r.choices[0].message.role == "assistant" for r in results)
    assert stats.jobs == 8 and stats.batches == 1  # one running batch ...
    assert stats.prefills == 1 + (stats.joined > 0) and stats.max_rows == 8  # ... the rest joined at once
    # joining changes nothing for a request: greedy answers are what the engine gives each alone
    renderer = ChatRenderer(service.engine.tokenizer)
    for i, r in enumerate(results):
        prompt = renderer.prompt_ids([{"role": "user", "content": f"question {i}"}])
        assert r.choices[0].message.content == greedy(service.engine, prompt, 6)[0]


# --------------------------------------------------------------------------- versions


def test_switch_with_requests_in_flight(model_dirs, store, tmp_path):
    sink = TraceStoreSink(store, interval_s=0.02)
    service = OpenAIService(model_dirs[0], version="v1", trace_sink=sink, window_s=0.005)
    srv, client = serve_openai(service)
    old = service.engine
    started, release = threading.Event(), threading.Event()
    original = old.runner.forward

    def held(*args, **kw):  # the v1 batch stops at its first forward until released
        started.set()
        assert release.wait(30)
        return original(*args, **kw)

    old.runner.forward = held
    messages = [{"role": "user", "content": "hello"}]
    ask = lambda: client.chat.completions.create(model="flywheel", messages=messages, max_tokens=6,  # noqa: E731
                                                 temperature=0, logprobs=True)
    try:
        with ThreadPoolExecutor(8) as pool:
            first = [pool.submit(ask) for _ in range(3)]
            assert started.wait(30)  # the first batch is running on v1
            service.switch(model_dirs[1], "v2")  # loads here, off the request path
            later = [pool.submit(ask) for _ in range(3)]
            time.sleep(0.2)
            release.set()
            responses = [f.result(timeout=60) for f in first + later]
        versions = [r.system_fingerprint for r in responses]
        assert "v1" in versions and versions[3:] == ["v2"] * 3
        prompt = ChatRenderer(old.tokenizer).prompt_ids(messages)
        # the versions are told apart by their logprobs (tied embeddings make both echo greedily)
        params = SamplingParams(temperature=0, max_tokens=1)
        expected = {v: e.generate([prompt], params)[0][0].logprobs[0] for v, e in (("v1", old), ("v2", service.engine))}
        assert abs(expected["v1"] - expected["v2"]) > 1e-3
        for r in responses:
            assert r.choices[0].logprobs.content[0].logprob == pytest.approx(expected[r.system_fingerprint], abs=1e-5)
        assert sink.flush()
        assert [store.get(r.id).model_version for r in responses] == versions
        assert client.models.list().data[0].model_extra["version"] == "v2"
        # the registry hook: promoting a version in the registry switches the server to it
        with Registry(tmp_path / "registry") as registry:
            follower = ProductionFollower(service, registry_lookup(registry))
            assert not follower.check_now()  # no production version yet
            v = registry.register(model_dirs[0])
            registry.promote(v.id)
            assert follower.check_now() and service.version == v.id and not follower.check_now()
            r = client.chat.completions.create(model="flywheel", messages=messages, max_tokens=2)
            assert r.system_fingerprint == v.id
    finally:
        release.set()
        srv.close()
        service.close()


def test_traces_are_recorded(live, store):
    service, _, client, sink = live
    r = client.chat.completions.create(model="flywheel", messages=HELLO, tools=[CALC], n=2, max_tokens=5,
                                       user="alice", metadata={"ticket": "42"})
    assert sink.flush()
    traces = [store.get(r.id), store.get(f"{r.id}-1")]
    for trace, choice in zip(traces, r.choices):
        assert trace.source == "serve" and trace.model == "flywheel" and trace.model_version == "v1"
        assert trace.messages == HELLO and trace.tools == [CALC]
        assert trace.response["content"] == choice.message.content
        assert trace.usage["prompt_tokens"] == r.usage.prompt_tokens and trace.latency_ms > 0
        assert trace.metadata["user"] == "alice" and trace.metadata["request_metadata"] == {"ticket": "42"}
    assert sum(t.usage["completion_tokens"] for t in traces) == r.usage.completion_tokens
    assert sink.stats.rejected == 0 and sink.stats.dropped == 0


def test_completion_traces_are_stored_as_completions(live, store):
    """/v1/completions is traced as a raw completion (its prompt text, no messages), so
    curation keeps it a raw completion end to end."""
    service, _, client, sink = live
    r = client.completions.create(model="flywheel", prompt="12+34=", max_tokens=4, temperature=0)
    assert sink.flush()
    trace = store.get(r.id)
    assert trace.prompt == "12+34=" and trace.messages == [] and trace.tools is None
    assert trace.response == {"role": "assistant", "content": r.choices[0].text}
    assert trace.metadata["endpoint"] == "completions"


def test_cli_registers_serve():
    from typer.testing import CliRunner

    from flywheel.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--help"])
    assert result.exit_code == 0 and "--traces-db" in result.output and "--max-batch" in result.output
    result = CliRunner().invoke(app, ["serve", "--model", "x", "--no-traces", "--traces-db", "sqlite://"])
    assert result.exit_code == 2
