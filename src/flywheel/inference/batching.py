"""BatchScheduler: many concurrent callers, one engine thread, shared forward passes.

`LocalEngine.generate` runs one batch to completion. To let concurrent requests share
forward passes, callers `submit` one prompt each (with its own SamplingParams, so its own
`n`, temperature, stop strings, ...) and get a `concurrent.futures.Future`. One worker
thread owns the engine and loops:

  1. wait for a job; then gather every job that is already queued or arrives within
     `window_s` (a few ms) until the batch holds `max_batch` sample rows (sum of `n`);
     jobs that arrived while the previous batch ran are therefore all in the next one;
  2. one `engine.generate(prompts, per_row_params)` for the whole batch;
  3. resolve each job's future with its samples and the label of the engine that ran it.

A job with a `seed` runs in a batch of its own with the engine's generator re-seeded, so
the same request with the same seed on the same version gives the same samples (the
engine has one generator per call, so seeded jobs cannot share a batch).

Version switching: `switch(engine, label)` only records the new engine; the worker picks
it up between batches. A batch that is running finishes on the engine it started with,
jobs still queued run on the new one, and no job fails because of the switch. Each
result says which label served it. Loading the new weights is the caller's work (do it
off the request path); the swap itself is one assignment on the worker thread.

If a batch raises (a bad prompt slipped through the caller's checks), every job of it is
retried alone, so only the culprit's future gets the exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

from flywheel.inference.sampler import Sample, Sampler, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchResult:
    """What a job's future resolves to: its `n` samples and the version label that made them."""

    samples: list[Sample]
    label: str
    engine: Sampler


@dataclass
class SchedulerStats:
    batches: int = 0  # generate calls
    jobs: int = 0  # jobs served
    rows: int = 0  # sample rows generated
    max_batch_jobs: int = 0
    switches: int = 0


@dataclass
class _Job:
    prompt: list[int]
    params: SamplingParams
    seed: int | None
    future: Future = field(default_factory=Future)


class BatchScheduler:
    """Runs `engine.generate` on one worker thread for batches of concurrently submitted jobs."""

    def __init__(self, engine: Sampler, label: str, *, max_batch: int = 64, window_s: float = 0.002):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.max_batch = max_batch
        self.window_s = window_s
        self.stats = SchedulerStats()
        self._current: tuple[Sampler, str] = (engine, str(label))
        self._next: tuple[Sampler, str] | None = None
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="flywheel-batch-scheduler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers

    @property
    def engine(self) -> Sampler:
        """The engine of the next batch (the pending one after a `switch`)."""
        with self._cond:
            return (self._next or self._current)[0]

    @property
    def label(self) -> str:
        with self._cond:
            return (self._next or self._current)[1]

    def submit(self, prompt: Sequence[int], params: SamplingParams, seed: int | None = None) -> Future:
        """Queue one prompt; the future resolves to a `BatchResult` (or the engine's exception)."""
        job = _Job(list(prompt), params, seed)
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._queue.append(job)
            self._cond.notify_all()
        return job.future

    def switch(self, engine: Sampler, label: str) -> None:
        """Serve `engine` (already loaded) as `label` from the next batch on."""
        with self._cond:
            self._next = (engine, str(label))
            self._cond.notify_all()

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued jobs, then stop the worker."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            batch = self._gather()
            if batch is None:
                return
            with self._cond:
                if self._next is not None:
                    self._current, self._next = self._next, None
                    self.stats.switches += 1
                engine, label = self._current
            self._execute(engine, label, batch)

    def _gather(self) -> list[_Job] | None:
        """Block for the first job, then collect more for up to `window_s`; None once closed and drained."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            first = self._queue.popleft()
            batch, rows = [first], first.params.n
            if first.seed is not None:
                return batch
            deadline = time.monotonic() + self.window_s
            while rows < self.max_batch:
                if not self._queue:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or self._closed:
                        break
                    self._cond.wait(remaining)
                    continue
                job = self._queue[0]
                if job.seed is not None or rows + job.params.n > self.max_batch:
                    break  # it starts the next batch
                batch.append(self._queue.popleft())
                rows += job.params.n
            return batch

    def _execute(self, engine: Sampler, label: str, batch: list[_Job]) -> None:
        batch = [j for j in batch if j.future.set_running_or_notify_cancel()]  # drop cancelled jobs
        if not batch:
            return
        try:
            if batch[0].seed is not None:
                _reseed(engine, batch[0].seed)
            results = engine.generate([j.prompt for j in batch], [j.params for j in batch])
        except BaseException as e:  # noqa: BLE001 - resolved into the futures
            if len(batch) == 1:
                batch[0].future.set_exception(e)
                return
            log.warning("batch of %d failed (%s); retrying its jobs one by one", len(batch), e)
            for job in batch:
                self._execute_alone(engine, label, job)
            return
        self._count(batch)
        for job, samples in zip(batch, results):
            job.future.set_result(BatchResult(samples, label, engine))

    def _execute_alone(self, engine: Sampler, label: str, job: _Job) -> None:
        try:
            samples = engine.generate([job.prompt], [job.params])[0]
        except BaseException as e:  # noqa: BLE001
            job.future.set_exception(e)
            return
        self._count([job])
        job.future.set_result(BatchResult(samples, label, engine))

    def _count(self, batch: list[_Job]) -> None:
        s = self.stats
        s.batches += 1
        s.jobs += len(batch)
        s.rows += sum(j.params.n for j in batch)
        s.max_batch_jobs = max(s.max_batch_jobs, len(batch))


def _reseed(engine: Sampler, seed: int) -> None:
    generator = getattr(engine, "generator", None)
    if generator is None:
        raise ValueError("this engine does not support per-request seeds")
    generator.manual_seed(int(seed))
