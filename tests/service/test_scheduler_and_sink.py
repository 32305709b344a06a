"""BatchScheduler and TraceStoreSink without a model: batching rules, isolation, switching, flushing."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest

from flywheel.inference import Sample, SamplingParams
from flywheel.inference.batching import BatchScheduler
from flywheel.loop import TraceStore
from flywheel.service.traces import TraceEvent, TraceStoreSink


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


def test_sink_never_blocks_on_a_dead_database():
    class Down:
        calls = 0

        def add_traces(self, records, source=None):
            Down.calls += 1
            time.sleep(0.05)
            raise OSError("database is down")

    sink = TraceStoreSink(Down(), batch_size=5, interval_s=0.01, max_pending=8, retries=1)
    t0 = time.perf_counter()
    for i in range(20):
        sink(_event(i))
    assert time.perf_counter() - t0 < 0.05  # enqueueing only
    sink.close()
    assert sink.stats.written == 0 and sink.stats.dropped == 20 and Down.calls >= 2
