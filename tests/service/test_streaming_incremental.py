"""Incremental streaming: chunks leave as tokens are sampled, through a live server and the official client.

The tiny model writes random bytes, so most tests make its greedy continuation a chosen text:
`Script` patches the lean decoder's forward so that each row's logits point at the next byte
of the script (by the row's position). Everything else (the continuous batch, the scheduler,
stop strings, detokenisation, the server) is the real thing. No assertion depends on timing:
where a test needs "while the job is still running" it holds the engine at a forward until
the client has seen what it waits for.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch

from flywheel.inference import LocalEngine, Sample, SamplingParams
from flywheel.inference.scheduler import BatchScheduler
from flywheel.traces import TraceStore
from flywheel.models import ChatRenderer, TinySpec, build_tiny_model
from flywheel.serve import OpenAIService, TraceStoreSink
from flywheel.serve.responses import TextStream, text_decoder
from live_server import serve_openai

SPEC = TinySpec(hidden=64, layers=2, heads=4, ffn=128)
CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate arithmetic.",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}
HELLO = [{"role": "user", "content": "Say something."}]
WAIT_S = 30  # liveness bound of the holds below (never reached when the behaviour is right)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("stream") / "m", SPEC)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    s = TraceStore(f"sqlite:///{tmp_path_factory.mktemp('traces') / 'traces.db'}")
    yield s
    s.close()


class Script:
    """The engine's greedy continuation of prompts of `prompt_len` tokens is `text`, then EOS.
    `hold(k, until)`: the k-th forward from now (the prefill is the first, the forward after
    decode step s the (s+1)-th; a step's tokens are reported before it) waits until
    `until()` (WAIT_S at most)."""

    def __init__(self, engine: LocalEngine):
        self.engine, self.original = engine, engine.runner.forward
        self.prompt_len, self.ids = -1, []
        self.calls, self.holds, self.fail_at = 0, {}, None
        self.eos = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")
        engine.runner.forward = self.forward

    def set(self, prompt_len: int, text: str) -> None:
        self.prompt_len, self.ids = prompt_len, self.engine.encode(text)

    def hold(self, k: int, until) -> None:
        self.holds[self.calls + k] = until

    def fail(self, k: int) -> None:
        """The k-th forward from now raises."""
        self.fail_at = self.calls + k

    def restore(self) -> None:
        del self.engine.runner.forward

    def forward(self, tokens, positions, cache, key_valid, causal, cache_rows=None):
        self.calls += 1
        until = self.holds.pop(self.calls, None)
        if until is not None:
            deadline = time.monotonic() + WAIT_S
            while not until() and time.monotonic() < deadline:
                time.sleep(0.002)
        if self.calls == self.fail_at:
            raise RuntimeError("the accelerator caught fire")
        logits = self.original(tokens, positions, cache, key_valid, causal, cache_rows=cache_rows)
        out = torch.full_like(logits, -30.0)  # a new tensor: the engine's may be an inference tensor
        for b, pos in enumerate(positions[:, -1].tolist()):
            g = pos - self.prompt_len + 1  # the index, in the generated text, of the token these logits pick
            if g >= 0:
                out[b, self.ids[g] if g < len(self.ids) else self.eos] = 30.0
            else:
                out[b] = logits[b]
        return out


@pytest.fixture(scope="module")
def live(model_dir, store):
    sink = TraceStoreSink(store, interval_s=0.02)
    service = OpenAIService(model_dir, version="v1", trace_sink=sink, default_max_tokens=64, window_s=0.002)
    script = Script(service.engine)
    srv, client = serve_openai(service)
    yield service, srv, client, sink, script
    srv.close()
    service.close()
    script.restore()


def prompt_len(service, messages, tools=None) -> int:
    return len(ChatRenderer(service.engine.tokenizer).prompt_ids(messages, tools))


def collect(stream, on_chunk=None):
    """(text per choice index, finish per index, tool-call deltas per index, usage, content chunks per index)."""
    text, finish, calls, usage, pieces = {}, {}, {}, None, {}
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text.setdefault(c.index, "")
            if c.delta.content:
                text[c.index] += c.delta.content
                pieces.setdefault(c.index, []).append(c.delta.content)
            for tc in c.delta.tool_calls or []:
                calls.setdefault(c.index, []).append(tc)
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        if on_chunk is not None:
            on_chunk(chunk)
    return text, finish, calls, usage, pieces


def record(store, trace_id) -> dict:
    t = store.get(trace_id)
    return {"model": t.model, "model_version": t.model_version, "messages": t.messages, "tools": t.tools,
            "response": t.response, "usage": t.usage, "metadata": t.metadata}


# --------------------------------------------------------------------------- text pieces (no server)


def test_text_stream_holds_partial_characters_and_stop_strings(model_dir):
    decode = text_decoder(LocalEngine.from_path(str(model_dir)).tokenizer)
    ts = TextStream(decode, stop=("STOP",))
    pieces = [ts.feed([b]) for b in "a€ST b".encode()]
    assert pieces == ["a", "", "", "€", "", "", "ST ", "b"]  # € is 3 bytes; "ST" might have begun "STOP"
    assert "".join(pieces) + ts.finish("a€ST bx") == "a€ST bx"
    tools = TextStream(decode, hold=("<tool_call>",), tools=True)
    assert [tools.feed([b]) for b in b"Hi \n<tool"] == ["H", "i", "", "", "", "", "", "", ""]
    assert tools.finish("Hi") == ""
    lead = TextStream(decode, tools=True)
    assert "".join(lead.feed([b]) for b in b" lead") == "" and lead.finish(" lead") == " lead"  # held to the end


# --------------------------------------------------------------------------- the scheduler's reports (no server)


def test_the_scheduler_reports_each_step_and_aborts(model_dir):
    engine = LocalEngine.from_path(str(model_dir))
    sched = BatchScheduler(engine, "v1", window_s=0.0)
    reports, box, ready = [], {}, threading.Event()  # box: the futures, once submit returned

    def report(*r):
        assert ready.wait(WAIT_S)
        reports.append((r, box["future"].done()))

    try:
        params = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True)
        box["future"] = future = sched.submit([5, 6, 7], params, on_tokens=report)
        ready.set()
        result = future.result(WAIT_S)
        assert len(reports) == 8 and all(label == "v1" and not whole and not done
                                         for (label, _, whole), done in reports)
        for i, sample in enumerate(result.samples):  # one token per step and row, in order
            assert [t for (_, tokens, _), _ in reports for t in tokens[i]] == sample.token_ids
        # abort: a running job leaves at its next step with what it generated
        gate, steps = threading.Event(), []
        ready.clear()

        def on_tokens(label, tokens, whole):
            steps.append(tokens)
            if len(steps) == 2:
                assert ready.wait(WAIT_S)
                sched.abort(box["running"])
                gate.set()

        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        box["running"] = running = sched.submit([5, 6, 7], long, on_tokens=on_tokens)
        ready.set()
        cut = running.result(WAIT_S).samples[0]
        assert gate.is_set() and cut.finish_reason == "cancelled" and len(cut.token_ids) == 2
        assert sched.stats.aborted == 1 and sched.stats.live_rows == 0
    finally:
        sched.close()


def test_a_seeded_job_streams_step_by_step_the_samples_of_its_seed_and_can_be_aborted(model_dir):
    engine = LocalEngine.from_path(str(model_dir))
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=10, ignore_eos=True)
    engine.generator.manual_seed(4)
    want = [s.token_ids for s in engine.generate([[5, 6, 7]], sampled)[0]]
    sched = BatchScheduler(engine, "v1", window_s=0.0)
    try:
        reports = []
        result = sched.submit([5, 6, 7], sampled, seed=4, on_tokens=lambda *r: reports.append(r)).result(WAIT_S)
        assert [s.token_ids for s in result.samples] == want  # the seed's samples, as generate gives them
        assert len(reports) == 10 and not any(whole for _, _, whole in reports)  # one report per step
        for i in range(2):
            assert [t for _, tokens, _ in reports for t in tokens[i]] == want[i]
        box, ready = {}, threading.Event()

        def on_tokens(label, tokens, whole):
            if len(box.setdefault("steps", [])) == 1:
                assert ready.wait(WAIT_S)
                sched.abort(box["job"])
            box["steps"].append(tokens)

        box["job"] = job = sched.submit([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), seed=4,
                                        on_tokens=on_tokens)
        ready.set()
        cut = job.result(WAIT_S).samples[0]
        assert cut.finish_reason == "cancelled" and len(cut.token_ids) == 2
        assert sched.stats.seeded == 2 and sched.stats.aborted == 1
        # 3 rows ending at different steps (a quarter of the bytes stop them): still the seed's samples
        ragged = SamplingParams(n=3, temperature=1.0, max_tokens=24, stop_token_ids=list(range(0, 256, 4)))
        runs = [[s.token_ids for s in sched.submit([5, 6, 7], ragged, seed=8).result(WAIT_S).samples]
                for _ in range(2)]
        assert runs[0] == runs[1] and len({len(t) for t in runs[0]}) > 1
        with pytest.raises(ValueError, match="seed 1180591620717411303424"):  # torch refuses it: the job fails ...
            sched.submit([5, 6, 7], sampled, seed=2**70).result(WAIT_S)
        assert len(sched.submit([5, 6, 7], sampled, seed=4).result(WAIT_S).samples) == 2  # ... not the worker
    finally:
        sched.close()


def test_whole_batch_jobs_report_once_and_queued_jobs_can_be_cancelled():
    class Engine:
        def __init__(self):
            self.gate, self.entered = threading.Event(), threading.Event()

        def generate(self, prompts, params):
            self.entered.set()
            assert self.gate.wait(WAIT_S)
            return [[Sample(token_ids=list(p), logprobs=[0.0] * len(p), finish_reason="stop", version=0,
                            prompt_index=i, text="x") for _ in range(sp.n)] for i, (p, sp) in enumerate(zip(prompts, params))]

    engine = Engine()
    sched = BatchScheduler(engine, "v1", window_s=0.0)
    try:
        reports = []
        first = sched.submit([1, 2], SamplingParams(n=2), on_tokens=lambda *r: reports.append((r, first.done())))
        assert engine.entered.wait(WAIT_S)  # the first batch is running: the next job waits in the queue
        queued = sched.submit([3], SamplingParams())
        sched.abort(queued)  # still queued (the engine is held): cancelled, never run
        engine.gate.set()
        assert first.result(WAIT_S).samples[0].token_ids == [1, 2]
        assert reports == [(("v1", {0: [1, 2], 1: [1, 2]}, True), False)]
        assert queued.cancelled() and sched.stats.cancelled == 1
    finally:
        sched.close()


# --------------------------------------------------------------------------- through the server


def test_a_stream_is_incremental_and_matches_the_non_streamed_request(live, store):
    service, _, client, sink, script = live
    text = "Hello wörld, ünïcode € ok."
    script.set(prompt_len(service, HELLO), text)
    sched = service.scheduler
    full = client.chat.completions.create(model="flywheel", messages=HELLO, temperature=0, max_tokens=64)
    assert full.choices[0].message.content == text and full.choices[0].finish_reason == "stop"

    jobs_before, seen, received = sched.stats.jobs, [], []

    def on_chunk(chunk):
        if any(c.delta.content for c in chunk.choices):
            received.append(chunk)
            seen.append((sched.stats.jobs, sched.stats.live_rows))

    # decode step 2's forward waits for the client's first content chunk, step 5's for a
    # second one, ...: every hold proves that a chunk left while the job was generating
    for k, forward in enumerate([3, 6, 9, 12, 15, 18], 1):
        script.hold(forward, lambda k=k: len(received) >= k)
    stream = client.chat.completions.create(model="flywheel", messages=HELLO, temperature=0, max_tokens=64,
                                            stream=True, stream_options={"include_usage": True})
    streamed, finish, _, usage, pieces = collect(stream, on_chunk)
    assert seen[0] == (jobs_before, 1)  # the job was still running when the first content arrived
    assert streamed == {0: text} and finish == {0: "stop"}
    assert len(pieces[0]) >= 7 and "\ufffd" not in "".join(pieces[0])  # whole characters only
    assert usage is not None and usage.model_dump() == full.usage.model_dump()
    # the trace of the streamed request has the non-streamed one's content
    assert sink.flush()
    ids = [c.id for c in client.chat.completions.create(model="flywheel", messages=HELLO, temperature=0,
                                                         max_tokens=64, stream=True)]
    assert sink.flush()
    assert record(store, ids[0]) == record(store, full.id)


def test_a_seeded_stream_is_incremental_and_repeats_its_seed(live):
    service, _, client, _, script = live
    text = "seeded, and streamed"
    script.set(prompt_len(service, HELLO), text)
    received = []
    for k, forward in enumerate([3, 6, 9], 1):  # as above: each hold proves a chunk left mid-job
        script.hold(forward, lambda k=k: len(received) >= k)
    seeded_before = service.scheduler.stats.seeded
    streamed, finish, _, _, pieces = collect(
        client.chat.completions.create(model="flywheel", messages=HELLO, temperature=1.0, max_tokens=64, seed=3,
                                       stream=True),
        lambda chunk: received.extend(c for c in chunk.choices if c.delta.content))
    assert streamed == {0: text} and finish == {0: "stop"} and len(pieces[0]) >= 4
    assert service.scheduler.stats.seeded == seeded_before + 1
    # unscripted (the tiny model's own random logits): the stream is the seed's non-streamed sample
    other = [{"role": "user", "content": "Another question."}]
    ask = dict(model="flywheel", messages=other, temperature=1.0, max_tokens=12, seed=9)
    full = client.chat.completions.create(**ask).choices[0].message.content
    assert collect(client.chat.completions.create(**ask, stream=True))[0] == {0: full}
    r = httpx.post(str(client.base_url) + "chat/completions", json={**ask, "seed": 2**64})
    assert r.status_code == 400 and "seed" in r.text


def test_stop_strings_split_across_tokens_never_leak(live):
    service, _, client, _, script = live
    script.set(prompt_len(service, HELLO), "aST bSTO cü! dSTOP tail ü!")
    ask = dict(model="flywheel", messages=HELLO, temperature=0, max_tokens=64, stop=["STOP", "ü!!", "ü!"])
    full = client.chat.completions.create(**ask)
    assert full.choices[0].message.content == "aST bSTO c" and full.choices[0].finish_reason == "stop"
    streamed, finish, _, _, pieces = collect(client.chat.completions.create(**ask, stream=True))
    assert streamed == {0: "aST bSTO c"} and finish == {0: "stop"}
    assert not any("STOP" in p or "ü!" in p for p in pieces[0])
    # a stop string that is never completed is released: the text is the whole script
    script.set(prompt_len(service, HELLO), "xSTO yST")
    streamed, finish, _, _, _ = collect(client.chat.completions.create(**ask, stream=True))
    assert streamed == {0: "xSTO yST"} and finish == {0: "stop"}


def test_a_streamed_tool_call_arrives_as_tool_call_deltas(live):
    service, _, client, _, script = live
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "7*6"}}\n</tool_call>'
    script.set(prompt_len(service, HELLO, [CALC]), text)
    ask = dict(model="flywheel", messages=HELLO, tools=[CALC], temperature=0, max_tokens=128)
    full = client.chat.completions.create(**ask).choices[0]
    assert full.finish_reason == "tool_calls" and full.message.content == "Let me compute."
    order = []
    script.hold(8, lambda: "content" in order)  # the content streams before the turn ends
    streamed, finish, calls, _, pieces = collect(client.chat.completions.create(**ask, stream=True), lambda ch: order.extend(
        "tool" if c.delta.tool_calls else "content" for c in ch.choices if c.delta.tool_calls or c.delta.content))
    assert streamed == {0: full.message.content} and finish == {0: "tool_calls"}
    assert order[0] == "content" and order[-2:] == ["tool", "tool"]
    assert "<" not in "".join(pieces[0])
    head, *rest = calls[0]
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == full.message.tool_calls[0].function.name == "calc"
    args = "".join(tc.function.arguments or "" for tc in [head, *rest])
    assert json.loads(args) == json.loads(full.message.tool_calls[0].function.arguments) == {"expr": "7*6"}


def test_n_2_streams_each_choice_under_its_index(live, store):
    service, _, client, sink, script = live
    script.set(prompt_len(service, HELLO), "two of us")
    chunks = []
    script.hold(4, lambda: {c.index for ch in chunks for c in ch.choices if c.delta.content} == {0, 1})
    for chunk in client.chat.completions.create(model="flywheel", messages=HELLO, n=2, temperature=0,
                                                max_tokens=64, stream=True, stream_options={"include_usage": True}):
        chunks.append(chunk)
    streamed, finish, _, usage, pieces = collect(chunks)
    assert streamed == {0: "two of us", 1: "two of us"} and finish == {0: "stop", 1: "stop"}
    assert len(pieces[0]) >= 2 and len(pieces[1]) >= 2  # both streamed before the end (the hold)
    assert usage.completion_tokens == 2 * (len("two of us") + 1)
    assert sink.flush()
    for i, tid in enumerate([chunks[0].id, f"{chunks[0].id}-1"]):
        t = store.get(tid)
        assert t.response["content"] == streamed[i] and t.metadata["finish_reason"] == "stop"


def test_a_client_that_goes_away_frees_its_row_and_is_traced(live, store):
    service, srv, client, sink, script = live
    text = "abcdefghij" * 10
    script.set(prompt_len(service, HELLO), text)
    sched = service.scheduler
    aborted_before, queued_before = sched.stats.aborted, sink.stats.queued
    aborts = []
    abort = sched.abort
    sched.abort = lambda f: aborts.append(f) or abort(f)
    script.hold(4, lambda: bool(aborts))  # the job cannot end before the server saw the client leave
    try:
        stream = client.chat.completions.create(model="flywheel", messages=HELLO, temperature=0, max_tokens=100,
                                                stream=True)
        got = ""
        for chunk in stream:
            got += "".join(c.delta.content or "" for c in chunk.choices)
            if got:
                break
        rid = chunk.id
        stream.close()
        deadline = time.monotonic() + WAIT_S
        while sched.stats.aborted == aborted_before and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        del sched.abort
    assert aborts and sched.stats.aborted == aborted_before + 1 and sched.stats.live_rows == 0
    deadline = time.monotonic() + WAIT_S  # the trace is queued on the event loop once the job stopped
    while sink.stats.queued == queued_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sink.flush()
    trace = store.get(rid)
    assert trace.metadata["finish_reason"] == "cancelled"
    content = trace.response["content"]
    assert content.startswith(got) and text.startswith(content) and len(content) < len(text)
    assert trace.usage["completion_tokens"] == len(content) < 100
    # the server is fine afterwards
    assert client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=3,
                                          temperature=0).choices[0].message.content == text[:3]


def test_a_failure_mid_stream_ends_it_with_an_error_event(live):
    service, srv, client, _, script = live
    script.set(prompt_len(service, HELLO), "doomed from the start")
    events = []
    script.hold(4, lambda: any('"content": "d' in e for e in events))  # some content went out ...
    script.fail(4)  # ... then the forward fails
    body = {"model": "flywheel", "messages": HELLO, "temperature": 0, "max_tokens": 64, "stream": True}
    with httpx.stream("POST", srv.url + "/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["x-flywheel-model-version"] == "v1"
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert "[DONE]" not in events
    last = json.loads(events[-1])
    assert last["error"]["type"] == "server_error" and "caught fire" in last["error"]["message"]
    assert any('"content": "d' in e for e in events[:-1])
    assert client.chat.completions.create(model="flywheel", messages=HELLO, max_tokens=4,
                                          temperature=0).choices[0].message.content == "doom"


def test_streamed_completions_are_incremental(live):
    service, _, client, _, script = live
    prompt = "12+34="
    script.set(len(service.engine.encode(prompt)), "46 and 2, surely.")
    ask = dict(model="flywheel", prompt=prompt, temperature=0, max_tokens=32, stop=[", s"])
    full = client.completions.create(**ask)
    pieces = []
    script.hold(3, lambda: bool(pieces))
    chunks = []
    for c in client.completions.create(**ask, stream=True):
        chunks.append(c)
        pieces.extend(ch.text for ch in c.choices if ch.text)
    assert "".join(pieces) == full.choices[0].text == "46 and 2" and len(pieces) >= 2
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "stop"


def test_whole_batch_mode_streams_the_result_as_one_piece(model_dir):
    service = OpenAIService(model_dir, version="v1", continuous=False, window_s=0.0)
    script = Script(service.engine)
    script.set(prompt_len(service, HELLO), "all at once")
    srv, client = serve_openai(service)
    try:
        streamed, finish, _, _, pieces = collect(client.chat.completions.create(
            model="flywheel", messages=HELLO, temperature=0, max_tokens=32, stream=True))
        assert streamed == {0: "all at once"} and pieces == {0: ["all at once"]} and finish == {0: "stop"}
        raw = httpx.post(srv.url + "/chat/completions", json={"model": "flywheel", "messages": HELLO,
                                                                 "max_tokens": 4, "stream": True}).text
        assert raw.startswith("data: {") and raw.endswith("data: [DONE]\n\n")
    finally:
        srv.close()
        service.close()
        script.restore()
