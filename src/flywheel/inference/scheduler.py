"""BatchScheduler: many concurrent callers, one worker thread that owns the engine.

Callers `submit` one prompt each (own SamplingParams, so own `n`, temperature, stops) and
get a future resolving to a `JobResult`. Guarantees:
- Continuous batching on a LocalEngine: one running `DecodeBatch` (inference/decode.py) is
  stepped a token at a time; jobs that arrive join it at the next step (on the HF fallback
  runner, when it drains), at most `max_batch` sample rows at once, first come first
  served. A job leaves the step its last row finishes.
- Any other Sampler (vLLM, remote, fakes): whole batches, one `generate` each.
- Admission from idle collects jobs until none arrived for `window_s`, `max_wait_s` passed
  or the batch is full, so a burst starts as one batch.
- A seeded job decodes alone with its own generator (same seed, same version: same
  samples), between two steps of the running batch.
- `switch(engine, label)`: the running batch finishes on its engine, queued jobs run on
  the new one; each result names the label that served it.
- Streaming: `on_tokens(label, {sample index: [new ids]}, whole[, logprobs])` on the worker
  thread, once per step before that step's forward (`whole=False`), or once with the whole
  completion in whole-batch mode (`whole=True`); always before the future resolves.
- `abort(future)`: a queued job is cancelled; a running one leaves at the next step with
  what it has (rows still generating: finish_reason "cancelled").
- A job the engine refuses fails alone with its ValueError; a failing batch or joining
  prefill is retried job by job, so only the culprit fails.
- The worker thread ends after `idle_exit_s` with nothing queued and the next `submit` starts
  another: a thread that ran torch's parallel ops keeps an OpenMP team while it lives, and a
  second team in the process (a loop training on its main thread while the server idles)
  makes libgomp stop spin-waiting, slowing every parallel op (flywheel/threads.py; measured by
  bench/openmp_teams.py).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from flywheel.inference.decode import DecodeRequest
from flywheel.inference.engine import LocalEngine
from flywheel.inference.sampler import Sample, Sampler, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobResult:
    """What a job's future resolves to: its `n` samples and the version label that made them."""

    samples: list[Sample]
    label: str
    engine: Sampler


TokenCallback = Callable[..., None]
"""on_tokens(label, {sample index: token ids sampled since the last report}, whole[, logprobs]);
see the module doc."""
TokenLogprobs = dict[int, list[tuple[float, list[tuple[int, float]] | None]]]


class JobFuture(Future):
    """A job's future. `aborted` is set by `BatchScheduler.abort` for a job already running."""

    def __init__(self):
        super().__init__()
        self.aborted = False


@dataclass
class SchedulerStats:
    batches: int = 0  # whole-batch generate calls + continuous batches started (from idle)
    jobs: int = 0  # jobs served
    rows: int = 0  # sample rows generated
    max_batch_jobs: int = 0  # most jobs in one batch (at one step, in continuous mode)
    switches: int = 0
    # continuous batching
    steps: int = 0  # decode steps (one sampled token per live row)
    prefills: int = 0  # prefill forwards (a batch's first group and each group that joined)
    joined: int = 0  # jobs that joined a batch already decoding
    max_rows: int = 0  # most sample rows decoded together
    seeded: int = 0  # seeded jobs run alone
    # aborting (callers that went away)
    cancelled: int = 0  # queued jobs cancelled by abort() before they ran
    aborted: int = 0  # running jobs stopped by abort() (continuous mode), their rows freed
    live_rows: int = 0  # sample rows in the running continuous batch now


@dataclass
class _Job:
    prompt: list[int]
    params: SamplingParams
    seed: int | None
    on_tokens: TokenCallback | None = None
    future: JobFuture = field(default_factory=JobFuture)
    report_logprobs: bool = False  # on_tokens also gets the tokens' logprobs
    adapter: str | None = None  # the LoRA adapter of the engine's AdapterPool to decode with


IDLE_EXIT_S = 1.0  # a worker thread with nothing queued this long ends (see the module doc)


class BatchScheduler:
    """Runs an engine on one worker thread for the jobs submitted concurrently (see the module doc)."""

    def __init__(self, engine: Sampler, label: str, *, max_batch: int = 64, window_s: float = 0.002,
                 max_wait_s: float | None = None, continuous: bool = True, idle_exit_s: float = IDLE_EXIT_S):
        """window_s: when idle, keep collecting jobs until none arrived for this long.
        max_wait_s: ... but no longer than this after the first (default 10 * window_s).
        continuous: step a LocalEngine one
        token at a time, with jobs joining between steps; False: whole batches always.
        idle_exit_s: the worker thread ends after this long with nothing queued (the next
        submit starts another)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        max_wait_s = 10 * window_s if max_wait_s is None else max_wait_s
        if max_wait_s < window_s:
            raise ValueError(f"max_wait_s ({max_wait_s}) must be >= window_s ({window_s})")
        if idle_exit_s <= 0:
            raise ValueError(f"idle_exit_s must be > 0, got {idle_exit_s}")
        self.idle_exit_s = idle_exit_s
        self.max_batch = max_batch
        self.window_s = window_s
        self.max_wait_s = max_wait_s
        self.continuous = continuous
        self.stats = SchedulerStats()
        self._current: tuple[Sampler, str] = (engine, str(label))
        self._next: tuple[Sampler, str] | None = None
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None  # the worker, while it lives (guarded by _cond)
        with self._cond:
            self._start_worker()

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

    def submit(self, prompt: Sequence[int], params: SamplingParams, seed: int | None = None,
               on_tokens: TokenCallback | None = None, report_logprobs: bool = False,
               adapter: str | None = None) -> JobFuture:
        """Queue one prompt; the future resolves to a `JobResult` (or the engine's exception).
        on_tokens: called with the job's new tokens as they are sampled (see the module doc);
        report_logprobs: with their logprobs too. adapter: decode with this LoRA adapter of
        the engine's (a LocalEngine's AdapterPool); its rows batch with everyone else's."""
        job = _Job(list(prompt), params, seed, on_tokens, report_logprobs=report_logprobs, adapter=adapter)
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._queue.append(job)
            if self._thread is None:
                self._start_worker()
            self._cond.notify_all()
        return job.future

    def abort(self, future: Future) -> None:
        """Stop the job of `future` (from `submit`): cancelled if still queued, else it leaves
        a continuous batch at its next step with what it generated (see the module doc).
        A finished job, or one inside a whole-batch generate, is left alone."""
        if future.done():
            return
        if future.cancel():
            with self._cond:
                self.stats.cancelled += 1
            return
        if isinstance(future, JobFuture):
            future.aborted = True

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
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    # ------------------------------------------------------------------ worker

    def _start_worker(self) -> None:
        """Held: _cond."""
        self._thread = threading.Thread(target=self._run, name="flywheel-batch-scheduler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        return
                    if not self._cond.wait(self.idle_exit_s) and not self._queue and not self._closed:
                        self._thread = None  # idle: end, and this thread's OpenMP team with it
                        return
                if self._next is not None:
                    self._current, self._next = self._next, None
                    self.stats.switches += 1
                engine, label = self._current
                stepped = self.continuous and isinstance(engine, LocalEngine)
                seeded = self._queue.popleft() if stepped and self._queue[0].seed is not None else None
            if seeded is not None:
                self._run_seeded(engine, label, seeded)
            elif stepped:
                self._run_continuous(engine, label)
            else:
                batch = self._gather()
                if batch:
                    self._execute(engine, label, batch)

    def _gather(self) -> list[_Job]:
        """The first queued job, then more while they keep coming (see the module doc)."""
        with self._cond:
            first = self._queue.popleft()
            batch, rows = [first], first.params.n
            if first.seed is not None:
                return batch
            start = last = time.monotonic()
            while rows < self.max_batch:
                if not self._queue:
                    now = time.monotonic()
                    remaining = min(last + self.window_s, start + self.max_wait_s) - now
                    if remaining <= 0 or self._closed:
                        break
                    self._cond.wait(remaining)
                    if self._queue:
                        last = time.monotonic()
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
                self.stats.seeded += 1
                _reseed(engine, batch[0].seed)
            results = _generate(engine, batch)
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
            _report_whole(job, label, samples)
            job.future.set_result(JobResult(samples, label, engine))

    def _execute_alone(self, engine: Sampler, label: str, job: _Job) -> None:
        try:
            samples = _generate(engine, [job])[0]
        except BaseException as e:  # noqa: BLE001
            job.future.set_exception(e)
            return
        self._count([job])
        _report_whole(job, label, samples)
        job.future.set_result(JobResult(samples, label, engine))

    def _count(self, batch: list[_Job]) -> None:
        s = self.stats
        s.batches += 1
        s.jobs += len(batch)
        s.rows += sum(j.params.n for j in batch)
        s.max_batch_jobs = max(s.max_batch_jobs, len(batch))
        s.max_rows = max(s.max_rows, sum(j.params.n for j in batch))

    # ------------------------------------------------------------------ continuous batching

    def _run_continuous(self, engine, label: str) -> None:
        """One running batch on `engine`, from the first job until it drains with nothing
        left to admit (or a switch is pending)."""
        running = _Running(engine.batch(max_rows=self.max_batch), engine, label)
        self.stats.batches += 1
        jobs = self._gather()  # the head is unseeded: a group of unseeded jobs
        self._admit(running, [j for j in jobs if j.future.set_running_or_notify_cancel()])
        while running.batch.live:
            self._step(running)
            if not running.batch.live:
                return  # drained: the outer loop takes what is queued (a new gather window)
            seeded, group = self._admissions(running.batch)
            if seeded is not None:
                self._run_seeded(engine, label, seeded)  # alone, between two steps
            group = [j for j in group if j.future.set_running_or_notify_cancel()]
            if group:
                self.stats.joined += self._admit(running, group)

    def _run_seeded(self, engine, label: str, job: _Job) -> None:
        """A seeded job as a batch of its own, with its own generator: nobody joins it."""
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            batch = engine.batch(seed=job.seed, max_rows=job.params.n)
        except Exception as e:  # noqa: BLE001 - e.g. a seed torch refuses: this job fails, not the worker
            job.future.set_exception(ValueError(f"seed {job.seed}: {e}"))
            return
        self.stats.seeded += 1
        self.stats.batches += 1
        interrupted = self.stats.live_rows  # the running batch's, which the solo batch's steps overwrite
        solo = _Running(batch, engine, label)
        self._admit(solo, [job])
        while solo.batch.live:
            self._step(solo)
        self.stats.live_rows = interrupted

    def _admissions(self, batch) -> tuple[_Job | None, list[_Job]]:
        """What joins the running batch before its next step: a seeded job at the head of
        the queue (run alone), else every queued job that fits, in order, up to the next
        seeded one. Nothing while a switch is pending: the batch drains on its engine."""
        with self._cond:
            if self._next is not None or not self._queue:
                return None, []
            if self._queue[0].seed is not None:
                return self._queue.popleft(), []
            if not batch.can_join:
                return None, []
            rows, group = batch.live, []
            while self._queue and self._queue[0].seed is None:
                if rows + self._queue[0].params.n > self.max_batch:
                    break  # the head waits for rows to leave
                job = self._queue.popleft()
                group.append(job)
                rows += job.params.n
            return None, group

    def _admit(self, running: "_Running", jobs: list[_Job]) -> int:
        """Prefill `jobs` (one forward) into the running batch; a job the engine refuses, or
        a group whose prefill raises, is failed or retried alone. Returns how many joined."""
        engine = running.engine
        ok = []
        for job in jobs:
            problem = engine.refusal(job.prompt, job.params)
            if problem is None:
                ok.append(job)
            else:
                job.future.set_exception(ValueError(f"prompt 0{problem}"))
        if not ok:
            return 0
        keys = [running.add(job) for job in ok]
        try:
            running.batch.admit([DecodeRequest(k, j.prompt, j.params, adapter=j.adapter) for k, j in zip(keys, ok)])
        except BaseException as e:  # noqa: BLE001 - resolved into the futures
            for k in keys:
                running.jobs.pop(k)
            if len(ok) == 1:
                ok[0].future.set_exception(e)
                return 0
            log.warning("prefill of %d joining jobs failed (%s); admitting them one by one", len(ok), e)
            return sum(self._admit(running, [job]) for job in ok)
        s, live = self.stats, running.batch.live
        s.prefills += 1
        s.live_rows = live
        s.max_rows = max(s.max_rows, live)
        s.max_batch_jobs = max(s.max_batch_jobs, len(running.jobs))
        return len(ok)

    def _step(self, running: "_Running") -> None:
        """One step of the running batch: tokens reported before its forward, finished jobs
        resolved after it. A failing step fails every job of the batch."""
        for key, job in running.jobs.items():
            if job.future.aborted:
                running.batch.abort(key)
        try:
            out = running.batch.step(on_sampled=lambda out: self._report_step(running, out))
        except BaseException as e:  # noqa: BLE001
            log.exception("a continuous batch step failed; failing its %d rows", running.batch.live)
            for job in running.jobs.values():
                if not job.future.done():
                    job.future.set_exception(e)
            running.jobs.clear()
            running.batch.close()
            self.stats.live_rows = 0
            return
        s = self.stats
        s.steps += 1
        s.live_rows = running.batch.live
        for key, samples in out.finished:
            job = running.jobs.pop(key)
            s.jobs += 1
            s.rows += len(samples)
            if any(x.finish_reason == "cancelled" for x in samples):
                s.aborted += 1
            if not job.future.done():
                job.future.set_result(JobResult(samples, running.label, running.engine))

    def _report_step(self, running: "_Running", out) -> None:
        """Hand each streaming job the tokens this step sampled for it."""
        if not running.streaming:
            return
        reports: dict[int, tuple[dict[int, list[int]], TokenLogprobs]] = {}
        for key, index, token, lp, tops in zip(out.keys, out.indices, out.tokens, out.logprobs, out.tops):
            job = running.jobs[key]
            if job.on_tokens is not None:
                ids, lps = reports.setdefault(key, ({}, {}))
                ids[index] = [token]
                if job.report_logprobs:
                    lps[index] = [(lp, tops)]
        for key, (ids, lps) in reports.items():
            _report(running.jobs[key], running.label, ids, logprobs=lps)


class _Running:
    """A DecodeBatch being served: the jobs in it by request key."""

    def __init__(self, batch, engine, label: str):
        self.batch, self.engine, self.label = batch, engine, label
        self.jobs: dict[int, _Job] = {}
        self._keys = itertools.count()

    @property
    def streaming(self) -> bool:
        return any(j.on_tokens is not None for j in self.jobs.values())

    def add(self, job: _Job) -> int:
        key = next(self._keys)
        self.jobs[key] = job
        return key


def _report(job: _Job, label: str, tokens: dict[int, list[int]], whole: bool = False,
            logprobs: TokenLogprobs | None = None) -> None:
    """Hand a job's new tokens (and their logprobs, if it asked) to its on_tokens callback;
    a failing callback fails nothing."""
    if job.on_tokens is None:
        return
    try:
        if job.report_logprobs:
            job.on_tokens(label, tokens, whole, logprobs or {})
        else:
            job.on_tokens(label, tokens, whole)
    except Exception:  # noqa: BLE001
        log.exception("the on_tokens callback of a job failed")


def _report_whole(job: _Job, label: str, samples: list[Sample]) -> None:
    """Report a whole-batch job's samples at once."""
    lps = {i: list(zip(s.logprobs, s.top_logprobs or [None] * len(s.token_ids))) for i, s in enumerate(samples)} \
        if job.report_logprobs else None
    _report(job, label, {i: list(s.token_ids) for i, s in enumerate(samples)}, whole=True, logprobs=lps)


def _reseed(engine: Sampler, seed: int) -> None:
    generator = getattr(engine, "generator", None)
    if generator is None:
        raise ValueError("this engine does not support per-request seeds")
    generator.manual_seed(int(seed))


def _generate(engine: Sampler, jobs: list[_Job]) -> list[list[Sample]]:
    """Whole-batch generation of `jobs`; adapters only where the engine has them."""
    adapters = [j.adapter for j in jobs]
    if any(adapters):
        if not isinstance(engine, LocalEngine):
            raise ValueError(f"adapter {next(a for a in adapters if a)!r}: this engine serves no LoRA adapters")
        return engine.generate([j.prompt for j in jobs], [j.params for j in jobs], adapters=adapters)
    return engine.generate([j.prompt for j in jobs], [j.params for j in jobs])
