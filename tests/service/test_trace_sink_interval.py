"""A trace sink writes a partial batch `interval_s` after its first event, without a flush:
a client may post feedback on a served trace moments after the response (regression: the
flusher slept until a full batch of 256 arrived, so feedback on a quiet server got 404s)."""

import time
from datetime import datetime, timezone

from flywheel.loop import TraceStore
from flywheel.service.traces import TraceEvent, TraceStoreSink


def _event(i: int) -> TraceEvent:
    return TraceEvent(trace_id=f"t{i}", model="m", model_version="v1", messages=[{"role": "user", "content": "q"}],
                      tools=None, response={"role": "assistant", "content": "a"},
                      usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, latency_ms=1.0,
                      created_at=datetime.now(timezone.utc), finish_reason="stop")


def test_a_partial_batch_is_written_after_the_interval(tmp_path):
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
