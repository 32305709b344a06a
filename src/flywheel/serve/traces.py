"""Trace capture: every served response becomes a `TraceEvent` handed to a `TraceSink`.

A sink is any callable taking one event. It is called on the server's event loop after the
response is ready, so it must not block: `TraceStoreSink` only appends to a bounded queue,
and a background thread writes batches with `TraceStore.add_traces` (one transaction per
batch). If the database is slow or down, requests are never held up: events wait in the
queue (up to `max_pending`; beyond that they are dropped and counted in `stats`).

One event per returned choice: with `n=3` a request gives three traces that share the
prompt, which is what curation needs to pair good and bad answers. Trace ids: the response
id for choice 0 (`chatcmpl-...`, so a client can send feedback for what it received),
`<response id>-<i>` for choice i > 0.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from flywheel.traces import TraceStore
from flywheel.traces.tables import DEFAULT_TENANT
from flywheel.traces.schema import ToolDef, TraceIn, Usage
from flywheel.types import Message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TraceEvent:
    trace_id: str
    model: str  # the served name
    model_version: str  # the version label that produced the response
    messages: list[Message] | None  # a chat request's; None for a raw completion
    tools: list[ToolDef] | None
    response: Message  # the assistant message as returned (content, tool_calls)
    usage: Usage  # prompt_tokens, completion_tokens, total_tokens of this choice
    latency_ms: float
    created_at: datetime
    finish_reason: str
    metadata: dict[str, Any] = field(default_factory=dict)
    prompt: str | None = None  # a raw completion's prompt text, as served
    tenant: str = DEFAULT_TENANT  # whose request (the API key's tenant)

    def to_record(self) -> TraceIn:
        """The trace store's `TraceIn` shape."""
        record: TraceIn = {
            "id": self.trace_id, "created_at": self.created_at.isoformat(), "source": "serve", "model": self.model,
            "model_version": self.model_version, "response": self.response,
            "usage": self.usage, "latency_ms": self.latency_ms,
            "metadata": {**self.metadata, "finish_reason": self.finish_reason},
        }
        if self.prompt is not None:
            record["prompt"] = self.prompt
        else:
            record["messages"] = self.messages
        if self.tools:
            record["tools"] = self.tools
        return record


TraceSink = Callable[[TraceEvent], None]


@dataclass
class SinkStats:
    queued: int = 0
    written: int = 0  # stored or already stored (a retry)
    rejected: int = 0  # refused by the store's validation (logged)
    dropped: int = 0  # queue full, or the database failed for good
    flushes: int = 0


class TraceStoreSink:
    """A `TraceSink` that writes to a `flywheel.traces.TraceStore` from a background thread.

    Flushes when `batch_size` events are waiting or `interval_s` after the oldest arrived.
    A failed write is retried (`retries` times, with back-off) before its batch is dropped.
    `close()` flushes what is left.
    """

    def __init__(self, store, *, batch_size: int = 256, interval_s: float = 0.2, max_pending: int = 100_000,
                 retries: int = 3, close_store: bool = False):
        self.store = store
        self.batch_size = batch_size
        self.interval_s = interval_s
        self.max_pending = max_pending
        self.retries = retries
        self.close_store = close_store
        self.stats = SinkStats()
        self._queue: deque[TraceEvent] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._processed = 0  # queued events whose write finished (written, rejected or dropped)
        self._progress = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="flywheel-trace-flusher", daemon=True)
        self._thread.start()

    def __call__(self, event: TraceEvent) -> None:
        with self._cond:
            if self._closed or len(self._queue) >= self.max_pending:
                self.stats.dropped += 1
                return
            self._queue.append(event)
            self.stats.queued += 1
            self._idle.clear()
            if len(self._queue) in (1, self.batch_size):  # the first starts the flusher's interval; a full batch goes now
                self._cond.notify()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far is written; False on timeout."""
        with self._cond:
            self._cond.notify()
        return self._idle.wait(timeout)

    def wait_written(self, timeout: float) -> bool:
        """Wait until every event queued before this call has been through its write (stored,
        refused or dropped), at most `timeout` seconds; True if it has. The flusher writes at
        once instead of waiting out its interval. Read-your-writes for feedback on a trace
        this server has just answered."""
        with self._cond:
            target = self.stats.queued
            self._cond.notify()
        with self._progress:
            return self._progress.wait_for(lambda: self._processed >= target, timeout)

    def close(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout)
        if self.close_store:
            self.store.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._idle.set()
                    if self._closed:
                        return
                    self._cond.wait()
                    continue
                if len(self._queue) < self.batch_size and not self._closed:
                    self._cond.wait(self.interval_s)  # let a batch build up
                batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
            if batch:
                self._write(batch)
                with self._progress:
                    self._processed += len(batch)
                    self._progress.notify_all()

    def _write(self, batch: list[TraceEvent]) -> None:
        by_tenant: dict[str, list[TraceEvent]] = {}
        for e in batch:
            by_tenant.setdefault(e.tenant, []).append(e)
        for tenant, events in by_tenant.items():
            self._write_tenant(tenant, events)
        self.stats.flushes += 1

    def _write_tenant(self, tenant: str, batch: list[TraceEvent]) -> None:
        records = [e.to_record() for e in batch]
        for attempt in range(self.retries + 1):
            try:
                result = self.store.add_traces(records, source="serve", tenant=tenant)
                break
            except Exception as e:  # noqa: BLE001 - the database is down or locked: retry, then drop
                if attempt == self.retries:
                    log.error("dropping %d traces after %d failed writes: %s", len(batch), attempt + 1, e)
                    self.stats.dropped += len(batch)
                    return
                time.sleep(0.05 * 2 ** attempt)
        for r in result.rejected:
            log.warning("trace %s refused by the store: %s", batch[r.index].trace_id, r.reason)
        self.stats.rejected += len(result.rejected)
        self.stats.written += len(batch) - len(result.rejected)


def open_trace_sink(url: str | None, **kw) -> TraceStoreSink:
    """A sink over a new TraceStore at `url` (None: the default SQLite file); closes it on close()."""
    return TraceStoreSink(TraceStore(url, default_source="serve"), close_store=True, **kw)
