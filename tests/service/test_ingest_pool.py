"""IngestPool: request bodies prepared in worker processes, what stays in the server, a worker's death."""

import asyncio
import os
import signal
import sys
import time
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timezone

import orjson
import pytest

from flywheel.traces.batch import NotABatch, prepare_body
from flywheel.serve.ingest_pool import IngestPool, IngestWorkerDied, default_ingest_workers

NOW = datetime(2025, 6, 1, 12, 0, tzinfo=timezone.utc)


def body(n: int) -> bytes:
    records = [{"id": f"t{i}", "idempotency_key": f"k{i}", "created_at": "2025-05-01T00:00:00Z",
                "messages": [{"role": "user", "content": f"{i}+1="}],
                "response": {"role": "assistant", "content": str(i + 1)}} for i in range(n)]
    records[3] = {"messages": [{"role": "robot", "content": "x"}]}
    return orjson.dumps(records)


def workers_of(pool: IngestPool) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        procs = dict(pool._executor._processes) if pool._executor else {}
        if len(procs) == pool.workers and all(p.pid for p in procs.values()):
            return list(procs)
        time.sleep(0.05)
    raise AssertionError("the workers did not start")


def test_a_body_prepared_in_a_worker_is_what_the_server_would_prepare():
    pool = IngestPool(2, inline_bytes=0)
    try:
        raw = body(40)
        batch = asyncio.run(pool.prepare(raw, "agent", NOW))
        assert batch == prepare_body(raw, "agent", NOW)
        assert (batch.size, [r.index for r in batch.invalid], len(batch.rows)) == (40, [3], 39)
        assert (pool.offloaded, pool.inline) == (1, 0)
        with pytest.raises(NotABatch):  # a worker's refusal reaches the caller as itself
            asyncio.run(pool.prepare(b'{"records": []}', "agent", NOW))
    finally:
        pool.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_hold_neither_torch_nor_the_model():
    import torch  # noqa: F401  # the server's process has it

    pool = IngestPool(1, inline_bytes=0)
    try:
        pool.start()
        asyncio.run(pool.prepare(body(5), "agent", NOW))  # the worker has run its initializer and a body
        (pid,) = workers_of(pool)
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
        assert "libtorch" not in maps and "_pydantic_core" in maps
    finally:
        pool.close()


def test_small_bodies_stay_in_the_server_and_zero_workers_start_none():
    pool = IngestPool(2)  # default threshold: a 2-record body is prepared in the server
    none = IngestPool(0)
    try:
        raw = body(5)
        assert asyncio.run(pool.prepare(raw, "agent", NOW)) == asyncio.run(none.prepare(raw, "agent", NOW))
        assert (pool.offloaded, pool.inline, none.inline) == (0, 1, 1)
        assert pool._executor is None and none._executor is None
    finally:
        pool.close()
        none.close()
    with pytest.raises(ValueError, match="workers"):
        IngestPool(-1)
    assert 1 <= default_ingest_workers() <= 4


def test_a_dead_worker_loses_no_body_and_the_pool_comes_back():
    pool = IngestPool(1, inline_bytes=0)
    try:
        pool.start()
        (pid,) = workers_of(pool)
        os.kill(pid, signal.SIGKILL)
        raw = body(20)
        assert asyncio.run(pool.prepare(raw, "agent", NOW)) == prepare_body(raw, "agent", NOW)
        assert (pool.restarts, pool.offloaded, pool.inline) == (1, 1, 0)  # tried again on a fresh worker
        assert workers_of(pool) != [pid]
    finally:
        pool.close()


class _AlwaysBroken:
    def submit(self, *args):
        raise BrokenProcessPool("a worker died")

    def shutdown(self, **kw):
        pass


def test_a_body_that_kills_two_workers_is_refused_not_tried_in_the_server(monkeypatch):
    pool = IngestPool(1, inline_bytes=0)

    def broken_pool():  # every pool it builds has a worker that dies on the body
        pool._executor = _AlwaysBroken()
        return pool._executor

    monkeypatch.setattr(pool, "_pool", broken_pool)
    with pytest.raises(IngestWorkerDied, match="twice; nothing was stored"):
        asyncio.run(pool.prepare(body(20), "agent", NOW))
    assert (pool.restarts, pool.offloaded, pool.inline) == (2, 0, 0)
