"""Worker processes for POST /v1/traces, so trace ingestion is not held to one core by the GIL.

Nearly all of a batch's cost is decoding, validating, encoding and hashing its records
(`flywheel.traces.batch.prepare_body`), pure Python work under the GIL. An `IngestPool`
sends each large request body, as bytes, to one of `workers` processes and gets back a
`PreparedBatch`; the server's own process only moves bytes and writes the rows to the
database (in one transaction, as before). Several bodies in flight are prepared in parallel.

Workers are forked from flywheel's forkserver (flywheel.process.worker_context: a clean
interpreter that has imported flywheel.traces, not the server, which holds torch, the model
and their threads), and run functions of flywheel.traces and flywheel.process only, so
they never import torch. A body under `inline_bytes`
is prepared in a thread of the server instead: its round trip to a worker costs more than
it saves. If a worker dies, nothing is lost (nothing of that body was written): the pool
is rebuilt and the body tried once more on a fresh worker; a body that kills two workers
is refused (a 500), never tried in the server, which would go down with it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from datetime import datetime, timezone

from flywheel.process import start_pool_worker, worker_context
from flywheel.threads import usable_cpus
from flywheel.traces.batch import NotABatch, PreparedBatch, prepare_body, prepare_body_in_worker
from flywheel.traces.encoding import NotJSON

log = logging.getLogger(__name__)

class IngestWorkerDied(RuntimeError):
    """A body's worker died on each try."""


def default_ingest_workers() -> int:
    """The CPU count this process may use, at most 4: a worker spends about three times as
    long preparing a trace as the server's single writer spends writing it, so past ~3
    workers the writer is the limit (docs/benchmarks.md, "Measurements behind choices in the
    code")."""
    return max(1, min(4, usable_cpus()))


class IngestPool:
    """Prepares POST /v1/traces bodies in `workers` processes (0: in a thread of the server)."""

    def __init__(self, workers: int = 0, *, inline_bytes: int = 32_768):
        if workers < 0:
            raise ValueError(f"workers must be >= 0, got {workers}")
        self.workers = workers
        self.inline_bytes = inline_bytes
        self._executor: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self.offloaded = 0  # bodies prepared (or refused) by a worker
        self.inline = 0  # bodies prepared in the server's process
        self.restarts = 0  # pools rebuilt after a worker died

    def start(self) -> None:
        """Start the workers now rather than with the first large body: the forkserver imports
        flywheel.traces (most of a second) before it forks them, time a server would rather spend before its
        first request."""
        if self.workers:
            executor = self._pool()
            for _ in range(self.workers):
                executor.submit(prepare_body, b"[]", "warm-up", datetime.now(timezone.utc))

    async def prepare(self, raw: bytes, default_source: str, now: datetime) -> PreparedBatch:
        """The body's PreparedBatch; raises NotJSON or NotABatch (from wherever it ran), or
        IngestWorkerDied if the body's worker died twice (nothing was written)."""
        if not self.workers or len(raw) < self.inline_bytes:
            self.inline += 1
            return await asyncio.to_thread(prepare_body, raw, default_source, now)
        for attempt in (1, 2):
            executor = self._pool()
            try:
                batch = await asyncio.wrap_future(executor.submit(prepare_body_in_worker, raw, default_source, now))
            except BrokenProcessPool:
                self._discard(executor)
                log.warning("an ingestion worker died (attempt %d of 2 for a body of %d bytes); pool rebuilt",
                            attempt, len(raw))
                continue
            except (NotJSON, NotABatch):  # the body's refusal, decided by the worker
                self.offloaded += 1
                raise
            self.offloaded += 1
            return batch
        # Twice is not chance: the body itself may crash the decoder. It is not tried in the
        # server, which would go down with it.
        raise IngestWorkerDied(f"a body of {len(raw)} bytes killed an ingestion worker twice; nothing was stored")

    def close(self) -> None:
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)

    def _pool(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ProcessPoolExecutor(self.workers, mp_context=worker_context(),
                                                     initializer=start_pool_worker)
            return self._executor

    def _discard(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._executor is broken:
                self._executor = None
                self.restarts += 1
        broken.shutdown(wait=False, cancel_futures=True)
