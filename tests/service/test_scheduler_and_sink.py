"""BatchScheduler and TraceStoreSink without a model: batching rules, isolation, switching, flushing."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest

from flywheel.inference import Sample, SamplingParams
from flywheel.inference.scheduler import BatchScheduler
from flywheel.traces import TraceStore
from flywheel.serve.traces import TraceEvent, TraceStoreSink


class FakeEngine:
    """Echoes each prompt; records the batches it was called with; can be held at the gate."""

    def __init__(self, name: str = "a"):
        self.name, self.batches = name, []
        self.gate = threading.Event()
        self.gate.set()

    def generate(self, prompts, params):
        self.batches.append([list(p) for p in prompts])
        assert self.gate.wait(10)
        if any(p == [666] for p in prompts):
            raise ValueError("prompt 666 is cursed")
        return [[Sample(token_ids=list(p), logprobs=[0.0] * len(p), finish_reason="stop", version=0,
                        prompt_index=i, text=f"{self.name}:{j}") for j in range(sp.n)]
                for i, (p, sp) in enumerate(zip(prompts, params))]


def test_jobs_queued_during_a_batch_form_the_next_one_up_to_max_batch():
    engine = FakeEngine()
    engine.gate.clear()
    sched = BatchScheduler(engine, "v1", max_batch=4, window_s=0.0)
    try:
        first = sched.submit([1], SamplingParams())
        while not engine.batches:
            time.sleep(0.001)
        rest = [sched.submit([k], SamplingParams(n=2)) for k in range(2, 5)]  # 6 rows > max_batch 4
        engine.gate.set()
        assert [len(f.result(10).samples) for f in [first, *rest]] == [1, 2, 2, 2]
        assert engine.batches == [[[1]], [[2], [3]], [[4]]]
        assert sched.stats.batches == 3 and sched.stats.rows == 7
    finally:
        sched.close()


def test_a_failing_job_fails_alone_and_seeded_jobs_run_alone():
    engine = FakeEngine()
    engine.gate.clear()
    sched = BatchScheduler(engine, "v1", window_s=0.0)
    try:
        sched.submit([0], SamplingParams())
        while not engine.batches:
            time.sleep(0.001)
        good, cursed = sched.submit([1], SamplingParams()), sched.submit([666], SamplingParams())
        seeded = sched.submit([2], SamplingParams(), seed=3)
        engine.gate.set()
        with pytest.raises(ValueError, match="per-request seeds"):  # FakeEngine has no generator to seed
            seeded.result(10)
        assert good.result(10).samples[0].token_ids == [1]
        with pytest.raises(ValueError, match="cursed"):
            cursed.result(10)
        assert engine.batches[1] == [[1], [666]] and [[2]] not in engine.batches[1:]
    finally:
        sched.close()


def test_switch_takes_effect_between_batches():
    a, b = FakeEngine("a"), FakeEngine("b")
    a.gate.clear()
    sched = BatchScheduler(a, "v1", window_s=0.0)
    try:
        running = sched.submit([1], SamplingParams())
        while not a.batches:
            time.sleep(0.001)
        queued = sched.submit([2], SamplingParams())
        sched.switch(b, "v2")
        assert sched.label == "v2"
        a.gate.set()
        assert (running.result(10).label, running.result(10).samples[0].text) == ("v1", "a:0")
        assert (queued.result(10).label, queued.result(10).samples[0].text) == ("v2", "b:0")
    finally:
        sched.close()


def test_cancelled_jobs_are_skipped():
    engine = FakeEngine()
    engine.gate.clear()
    sched = BatchScheduler(engine, "v1", window_s=0.0)
    try:
        sched.submit([1], SamplingParams())
        while not engine.batches:
            time.sleep(0.001)
        gone, kept = sched.submit([2], SamplingParams()), sched.submit([3], SamplingParams())
        assert gone.cancel()
        engine.gate.set()
        kept.result(10)
        assert engine.batches[1] == [[3]]
    finally:
        sched.close()


def _event(i: int) -> TraceEvent:
    return TraceEvent(trace_id=f"t{i}", model="m", model_version="v1", messages=[{"role": "user", "content": "q"}],
                      tools=None, response={"role": "assistant", "content": "a"},
                      usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, latency_ms=1.0,
                      created_at=datetime.now(timezone.utc), finish_reason="stop")


def test_sink_writes_in_batches_off_the_caller(tmp_path):
    with TraceStore(f"sqlite:///{tmp_path / 't.db'}") as store:
        sink = TraceStoreSink(store, batch_size=10, interval_s=0.05)
        for i in range(25):
            sink(_event(i))
        assert sink.flush(10)
        sink.close()
        assert store.count() == 25 and sink.stats.written == 25 and sink.stats.flushes >= 3
        assert store.get("t7").model_version == "v1" and store.get("t7").metadata["finish_reason"] == "stop"


def test_a_partial_batch_is_written_after_the_interval(tmp_path):
    """Without a flush, a partial batch is written `interval_s` after its first event: a client
    may post feedback on a served trace moments after the response (regression: the flusher
    slept until a full batch of 256 arrived, so feedback on a quiet server got 404s)."""
    with TraceStore(f"sqlite:///{tmp_path / 't.db'}") as store:
        sink = TraceStoreSink(store, batch_size=256, interval_s=0.05)
        try:
            for round_ in range(2):  # also after the flusher went idle again
                for i in range(3):
                    sink(_event(10 * round_ + i))
                deadline = time.monotonic() + 10
                while store.count() < 3 * (round_ + 1) and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert store.count() == 3 * (round_ + 1)
        finally:
            sink.close()


def test_sink_never_blocks_on_a_dead_database():
    """Events keep being taken while a write hangs: all 20 calls return before the hung write
    does (no clock involved: the write waits for the test to release it)."""
    entered, release, returned = threading.Event(), threading.Event(), []

    class Down:
        calls = 0

        def add_traces(self, records, source=None, tenant="default"):
            Down.calls += 1
            entered.set()
            release.wait(10)
            returned.append(Down.calls)
            raise OSError("database is down")

    sink = TraceStoreSink(Down(), batch_size=5, interval_s=0.01, max_pending=8, retries=1)
    sink(_event(0))
    assert entered.wait(10)  # the flusher is inside a write that hangs
    for i in range(1, 20):
        sink(_event(i))
    assert not returned  # every call returned while the write still hung: enqueueing only
    release.set()
    sink.close()
    assert sink.stats.written == 0 and sink.stats.dropped == 20 and Down.calls >= 2


# --------------------------------------------------------------------------- continuous batching


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    import torch

    from flywheel.inference import LocalEngine
    from flywheel.models import TinySpec, build_tiny_model

    torch.set_num_threads(1)
    path = build_tiny_model(tmp_path_factory.mktemp("sched") / "m", TinySpec(hidden=64, layers=2, heads=4, ffn=128))
    return LocalEngine.from_path(str(path))


def _held(engine):
    """Make the engine's next forward wait at a gate; returns (entered, gate, restore)."""
    original, entered, gate = engine.runner.forward, threading.Event(), threading.Event()

    def forward(*args, **kw):
        entered.set()
        assert gate.wait(20)
        return original(*args, **kw)

    engine.runner.forward = forward
    return entered, gate, lambda: delattr(engine.runner, "forward")


PROMPTS = [[(7 * i + k) % 250 + 3 for k in range(4 + 3 * i)] for i in range(8)]  # 8 prompts of 4..25 tokens


def test_jobs_arriving_during_decoding_join_the_running_batch(tiny_engine):
    greedy = SamplingParams(temperature=0, max_tokens=10)
    alone = [tiny_engine.generate([p], greedy)[0][0] for p in PROMPTS]
    sched = BatchScheduler(tiny_engine, "v1", window_s=0.0)
    entered, gate, restore = _held(tiny_engine)
    try:
        first = sched.submit(PROMPTS[0], greedy)
        assert entered.wait(20)  # the batch of the first job is prefilling
        rest = [sched.submit(p, greedy if i % 2 else SamplingParams(n=2, temperature=0, max_tokens=6))
                for i, p in enumerate(PROMPTS[1:], 1)]
        gate.set()
        results = [f.result(20) for f in [first, *rest]]
    finally:
        restore()
        sched.close()
    s = sched.stats
    # one running batch; the 7 late jobs joined it at once, in one prefill, and 11 rows decoded together
    assert (s.batches, s.prefills, s.joined, s.jobs, s.rows, s.max_rows) == (1, 2, 7, 8, 11, 11)
    assert s.steps <= 11  # one step alone, then the joiners' budget of 10 alongside the first job
    # joining a batch (other prompt lengths, a shifted cache) changes no greedy answer
    for i, (r, ref) in enumerate(zip(results, alone)):
        want = ref if i % 2 or i == 0 else tiny_engine.generate([PROMPTS[i]], SamplingParams(
            n=2, temperature=0, max_tokens=6))[0][0]
        for sample in r.samples:
            assert (sample.token_ids, sample.text, sample.finish_reason) == (want.token_ids, want.text,
                                                                              want.finish_reason)
            assert sample.logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert r.label == "v1" and len(r.samples) == (2 if i % 2 == 0 and i else 1)


def test_continuous_batch_rules_max_rows_seeds_and_refusals(tiny_engine):
    sampled = SamplingParams(temperature=1.0, max_tokens=8)
    seeded_alone = []
    for _ in range(2):
        tiny_engine.generator.manual_seed(11)
        seeded_alone.append(tiny_engine.generate([PROMPTS[2]], sampled)[0][0].token_ids)
    assert seeded_alone[0] == seeded_alone[1]
    sched = BatchScheduler(tiny_engine, "v1", max_batch=4, window_s=0.0)
    entered, gate, restore = _held(tiny_engine)
    try:
        first = sched.submit(PROMPTS[0], SamplingParams(n=2, temperature=0, max_tokens=12))
        assert entered.wait(20)
        bad = sched.submit([10**6], sampled)  # outside the vocabulary: refused alone
        fits = sched.submit(PROMPTS[1], SamplingParams(n=2, max_tokens=4))  # 2 + 2 rows = max_batch
        waits = sched.submit(PROMPTS[3], sampled)  # a fifth row: waits for rows to leave
        seeded = sched.submit(PROMPTS[2], sampled, seed=11)  # runs alone between two steps
        gate.set()
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            bad.result(20)
        assert seeded.result(20).samples[0].token_ids == seeded_alone[0]
        assert len(first.result(20).samples) == 2 and len(fits.result(20).samples) == 2
        assert len(waits.result(20).samples[0].token_ids) <= 8
    finally:
        restore()
        sched.close()
    s = sched.stats
    assert s.max_rows <= 4 and s.seeded == 1 and s.jobs == 4  # the refused job is not served


def test_a_switch_drains_the_running_batch_first(tiny_engine, tmp_path):
    from flywheel.inference import LocalEngine
    from flywheel.models import TinySpec, build_tiny_model

    new = LocalEngine.from_path(str(build_tiny_model(tmp_path / "v2", TinySpec(hidden=64, layers=2, heads=4,
                                                                                 ffn=128, seed=1))))
    greedy = SamplingParams(temperature=0, max_tokens=6)
    sched = BatchScheduler(tiny_engine, "v1", window_s=0.0)
    entered, gate, restore = _held(tiny_engine)
    try:
        running = sched.submit(PROMPTS[0], greedy)
        assert entered.wait(20)
        sched.switch(new, "v2")
        queued = sched.submit(PROMPTS[1], greedy)  # must not join the v1 batch
        gate.set()
        assert running.result(20).label == "v1" and running.result(20).engine is tiny_engine
        assert queued.result(20).label == "v2" and queued.result(20).engine is new
        assert queued.result(20).samples[0].token_ids == new.generate([PROMPTS[1]], greedy)[0][0].token_ids
    finally:
        restore()
        sched.close()
    assert sched.stats.joined == 0 and sched.stats.switches == 1 and sched.stats.batches == 2


def test_an_idle_scheduler_keeps_collecting_while_jobs_keep_arriving():
    """Whole-batch admission: a burst spread over more than one window still starts as one batch."""
    engine = FakeEngine()
    sched = BatchScheduler(engine, "v1", window_s=1.0, max_wait_s=30.0)
    try:
        futures = []
        for k in range(6):  # 6 jobs 20 ms apart: 100 ms in all, each gap far below the 1 s window
            futures.append(sched.submit([k], SamplingParams()))
            time.sleep(0.02)
        assert [f.result(20).samples[0].token_ids for f in futures] == [[k] for k in range(6)]
        assert engine.batches == [[[k] for k in range(6)]] and sched.stats.batches == 1
    finally:
        sched.close()


def test_an_idle_worker_thread_ends_and_the_next_job_starts_another():
    """A thread that ran torch's parallel ops keeps an OpenMP team while it lives: an idle
    scheduler lets its thread go (flywheel/threads.py)."""
    ran_on = []

    class Recording(FakeEngine):
        def generate(self, prompts, params):
            ran_on.append(threading.current_thread())
            return super().generate(prompts, params)

    sched = BatchScheduler(Recording(), "v1", window_s=0.0, idle_exit_s=0.05)
    try:
        assert sched.submit([1], SamplingParams()).result(10).samples[0].token_ids == [1]
        ran_on[0].join(5)
        assert not ran_on[0].is_alive()  # idle for idle_exit_s: gone
        assert sched.submit([2], SamplingParams()).result(10).samples[0].token_ids == [2]
        assert ran_on[1] is not ran_on[0]
    finally:
        sched.close()
    with pytest.raises(ValueError, match="idle_exit_s"):
        BatchScheduler(FakeEngine(), "v1", idle_exit_s=0)
