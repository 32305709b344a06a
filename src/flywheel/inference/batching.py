"""BatchScheduler: many concurrent callers, one engine thread, shared forward passes.

Callers `submit` one prompt each (with its own SamplingParams, so its own `n`, temperature,
stop strings, ...) and get a `concurrent.futures.Future`. One worker thread owns the engine.

Continuous batching (a `LocalEngine` on the lean decoder, the serving case). The worker
keeps one running batch and steps it one token at a time, like `LocalEngine.generate`'s
own decode loop, except that its membership changes between steps:

  - a row that hits a stop token, a stop string or its budget leaves at once (its cache row
    is dropped), and a job's future resolves as soon as its last row is done;
  - jobs that arrived meanwhile join at the next step: their distinct prompts are prefilled
    together (one forward, `n` rows fanned out from one prefill, as in `generate`), and their
    keys/values are merged into the running batch's KV cache, right-aligned on the batch's
    current column so every row's next token is written to the same column; each row keeps
    its own positions, and a row's columns before its prompt are masked out;
  - the batch never holds more than `max_batch` sample rows (sum of `n`); a job that does
    not fit waits at the head of the queue (first come, first served).

So a burst is never split into groups that then alternate: whatever part of it arrives
after the batch started decoding joins it one step later. A batch's column count is
compacted at each merge (columns that no live row can see are dropped), so a batch that
never drains does not grow without bound.

Whole-batch mode (any other `Sampler`: vLLM, a remote server, the HF fallback runner, test
fakes): one `engine.generate(prompts, per_row_params)` per batch, run to completion.

Admission. When the worker is idle, it takes the first job, then keeps collecting while
jobs keep arriving: until no new job came for `window_s` (a few ms), `max_wait_s` passed
since the first, or the batch holds `max_batch` rows. A burst whose requests the event
loop takes a while to parse therefore starts as one batch instead of two.

A job with a `seed` runs alone with the engine's generator re-seeded, so the same request
with the same seed on the same version gives the same samples (the engine has one
generator, so seeded jobs cannot share a batch). In continuous mode it is a batch of its
own, stepped like any other (it streams token by token and can be aborted; nobody joins
it), run between two steps of the running batch, which then resumes. In whole-batch mode
it is one `engine.generate` call.

Version switching: `switch(engine, label)` only records the new engine; the worker picks
it up once the running batch has drained (no job joins a batch after a switch was asked
for). A batch that is running finishes on the engine it started with, jobs still queued
run on the new one, and no job fails because of the switch. Each result says which label
served it. Loading the new weights is the caller's work (do it off the request path); the
swap itself is one assignment on the worker thread.

Streaming: `submit(..., on_tokens=callback)` reports a job's tokens as they are sampled:
`callback(label, {sample index: [new token ids]}, whole)`, called on the worker thread
(keep it cheap and non-blocking; an exception in it is logged and ignored), always before
the job's future resolves. In continuous mode that is once per decode step, right after
sampling and before the step's forward, one token per sample row still generating (a
row's last report holds its stop token, if any), `whole=False`. In whole-batch mode the
engine only returns whole results, so the whole completion is reported once, with
`whole=True`, right before the future resolves. The text, stop strings included, is the
caller's to derive (the final text is the resolved `Sample.text`). Submitted with
`report_logprobs=True`, the callback gets a fourth argument, `{sample index: [(logprob,
alternatives) of each reported token]}` (alternatives: the token's `Sample.top_logprobs`
entry, None without `top_logprobs`).

Aborting: `abort(future)` stops a job whose caller went away (a client that closed its
stream). A job still queued is cancelled (it never runs; the future is cancelled). A job
in a continuous batch leaves it at the next step (its rows are freed; the token sampled
at that step is dropped) and its future resolves with what was generated, rows that were
still generating having finish_reason "cancelled". A job inside a whole-batch
`engine.generate` cannot be interrupted: it runs to completion and resolves as usual.

Errors: a job whose prompt the engine would refuse (empty, token ids outside the
vocabulary, prompt + max_tokens beyond the context) fails alone with the engine's
ValueError. If a whole batch raises in whole-batch mode, or a joining group's prefill
raises, every job of it is retried alone, so only the culprit's future gets the exception.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from flywheel.inference.sampler import Sample, Sampler, SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchResult:
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


class BatchScheduler:
    """Runs an engine on one worker thread for the jobs submitted concurrently (see the module doc)."""

    def __init__(self, engine: Sampler, label: str, *, max_batch: int = 64, window_s: float = 0.002,
                 max_wait_s: float | None = None, continuous: bool = True):
        """window_s: when idle, keep collecting jobs until none arrived for this long.
        max_wait_s: ... but no longer than this after the first (default 10 * window_s).
        continuous: step engines that support it (LocalEngine on the lean decoder) one
        token at a time, with jobs joining between steps; False: whole batches always."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        max_wait_s = 10 * window_s if max_wait_s is None else max_wait_s
        if max_wait_s < window_s:
            raise ValueError(f"max_wait_s ({max_wait_s}) must be >= window_s ({window_s})")
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

    def submit(self, prompt: Sequence[int], params: SamplingParams, seed: int | None = None,
               on_tokens: TokenCallback | None = None, report_logprobs: bool = False) -> JobFuture:
        """Queue one prompt; the future resolves to a `BatchResult` (or the engine's exception).
        on_tokens: called with the job's new tokens as they are sampled (see the module doc);
        report_logprobs: with their logprobs too."""
        job = _Job(list(prompt), params, seed, on_tokens, report_logprobs=report_logprobs)
        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._queue.append(job)
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
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        return
                    self._cond.wait()
                if self._next is not None:
                    self._current, self._next = self._next, None
                    self.stats.switches += 1
                engine, label = self._current
                stepped = self.continuous and _steppable(engine)
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
            _report_whole(job, label, samples)
            job.future.set_result(BatchResult(samples, label, engine))

    def _execute_alone(self, engine: Sampler, label: str, job: _Job) -> None:
        try:
            samples = engine.generate([job.prompt], [job.params])[0]
        except BaseException as e:  # noqa: BLE001
            job.future.set_exception(e)
            return
        self._count([job])
        _report_whole(job, label, samples)
        job.future.set_result(BatchResult(samples, label, engine))

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
        running = _RunningBatch(engine, label, self.stats, self.max_batch)
        self.stats.batches += 1
        jobs = self._gather()  # the head is unseeded: a group of unseeded jobs
        running.admit([j for j in jobs if j.future.set_running_or_notify_cancel()])
        while running.rows:
            running.step()
            if not running.rows:
                return  # drained: the outer loop takes what is queued (a new gather window)
            seeded, group = self._admissions(len(running.rows))
            if seeded is not None:
                self._run_seeded(engine, label, seeded)  # alone, between two steps
            group = [j for j in group if j.future.set_running_or_notify_cancel()]
            if group:
                self.stats.joined += running.admit(group)

    def _run_seeded(self, engine, label: str, job: _Job) -> None:
        """A seeded job as a continuous batch of its own, from a re-seeded generator: nobody
        joins it, so its samples depend on the seed and the job alone (for n <= 2 they are
        those of `engine.generate` after the same seeding; see _RunningBatch on row order)."""
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            _reseed(engine, job.seed)
        except Exception as e:  # noqa: BLE001 - e.g. a seed torch refuses: this job fails, not the worker
            job.future.set_exception(ValueError(f"seed {job.seed}: {e}"))
            return
        self.stats.seeded += 1
        self.stats.batches += 1
        interrupted = self.stats.live_rows  # the running batch's, which the solo batch's steps overwrite
        solo = _RunningBatch(engine, label, self.stats, job.params.n)
        solo.admit([job])
        while solo.rows:
            solo.step()
        self.stats.live_rows = interrupted

    def _admissions(self, rows: int) -> tuple[_Job | None, list[_Job]]:
        """What joins the running batch before its next step: a seeded job at the head of
        the queue (run alone), else every queued job that fits, in order, up to the next
        seeded one. Nothing while a switch is pending: the batch drains on its engine."""
        with self._cond:
            if self._next is not None or not self._queue:
                return None, []
            if self._queue[0].seed is not None:
                return self._queue.popleft(), []
            group = []
            while self._queue and self._queue[0].seed is None:
                if rows + self._queue[0].params.n > self.max_batch:
                    break  # the head waits for rows to leave
                job = self._queue.popleft()
                group.append(job)
                rows += job.params.n
            return None, group


class _Row:
    """Host-side state of one sample row of the running batch."""

    __slots__ = ("job", "index", "stops", "max_new", "strings", "top", "tokens", "logprobs", "tops", "finish")

    def __init__(self, job: "_Active", index: int, stops: frozenset[int], max_new: int, strings: tuple[str, ...],
                 top: int = 0):
        self.job, self.index, self.stops, self.max_new, self.strings = job, index, stops, max_new, strings
        self.top = top  # alternatives per token (SamplingParams.top_logprobs)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.tops: list[list[tuple[int, float]]] = []  # each token's alternatives, when top > 0
        self.finish: tuple[str, int | str | None] | None = None  # (finish_reason, stop_reason)


class _Active:
    """A job in the running batch: its rows, and how many are still generating."""

    __slots__ = ("job", "rows", "left", "version")

    def __init__(self, job: _Job, version: int):
        self.job, self.rows, self.left, self.version = job, [], job.params.n, version


def _steppable(engine) -> bool:
    from flywheel.inference.decoder import LeanDecoder
    from flywheel.inference.engine import LocalEngine

    return isinstance(engine, LocalEngine) and isinstance(engine.runner, LeanDecoder)


class _RunningBatch:
    """The continuous batch over a LocalEngine's lean decoder: per-row sampling settings and
    positions as tensors aligned with the KV cache rows, the rest on the host.

    The KV cache lives in a buffer with room for more rows and columns than in use; the
    batch's cache is the view of its first B rows (the decoder writes through it). Columns
    are shared: every live row writes its next token at column `cache.length`, and row b
    sees columns `start[b]` and after (its prompt, right-aligned, then what it generated).
    A joining group is prefilled straight into free rows of the buffer, right-aligned on
    the current column; a row that leaves is replaced by one from the end (one row copied, not
    the whole cache). The buffer is reallocated only when rows or columns run out, and
    then compacted (columns no live row sees are dropped). Numerically, a batch that
    nobody joins is `LocalEngine.generate`, up to the order of its rows: sampling noise is
    drawn per batch position, and a leaving row's place goes to the last row where generate
    keeps the order, so with 3 or more rows ending at different steps the samples differ."""

    def __init__(self, engine, label: str, stats: SchedulerStats, max_rows: int):
        import torch

        self.torch = torch
        self.engine, self.label, self.stats = engine, label, stats
        self.runner = engine.runner
        self.dev = engine.device
        self.max_rows = max_rows  # row room to reserve when the buffer grows
        self.rows: list[_Row] = []
        self.buf = None  # (layers, 2, row room, kv heads, column room, head dim)
        self.cache = None  # KVCache over buf[:, :, :len(rows)]
        self.logits = None  # (B, V): the next token of each row is sampled from these
        self.temperature = self.top_k = self.top_p = self.processed = self.pos_next = self.start = None
        self.needs = None
        self.any_processed = False
        self.k_max = 0  # most alternatives per token any row asks for
        self.padded = False  # some row cannot see column 0: attention needs a mask

    # ---------------------------------------------------------------- joining

    def admit(self, jobs: list[_Job]) -> int:
        """Prefill `jobs` (one forward) into the batch; a job the engine refuses, or a group
        whose prefill raises, is failed or retried alone. Returns how many joined."""
        ok = [j for j in jobs if self._check(j)]
        if not ok:
            return 0
        try:
            self._admit(ok)
        except BaseException as e:  # noqa: BLE001 - resolved into the futures
            if len(ok) == 1:
                ok[0].future.set_exception(e)
                return 0
            log.warning("prefill of %d joining jobs failed (%s); admitting them one by one", len(ok), e)
            return sum(self.admit([job]) for job in ok)
        return len(ok)

    def _check(self, job: _Job) -> bool:
        """The engine's own checks of `generate`, for one job; False (future failed) if refused."""
        e, p, sp = self.engine, job.prompt, job.params
        problem = None
        if len(p) == 0:
            problem = "prompt 0 is empty"
        else:
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= e.vocab_size:
                problem = (f"prompt 0 has token id {lo if lo < 0 else hi}, outside the model's "
                           f"vocabulary [0, {e.vocab_size})")
            elif len(p) + sp.max_tokens > e.max_positions:
                problem = (f"prompt 0: {len(p)} tokens + max_tokens {sp.max_tokens} exceeds the model's "
                           f"{e.max_positions} positions")
        if problem is not None:
            job.future.set_exception(ValueError(problem))
            return False
        return True

    def _admit(self, jobs: list[_Job]) -> None:
        torch, dev, engine = self.torch, self.dev, self.engine
        from flywheel.inference.decoder import KVCache

        unique: dict[tuple[int, ...], int] = {}
        for j in jobs:
            unique.setdefault(tuple(j.prompt), len(unique))
        uniq = list(unique)
        lens = [len(u) for u in uniq]
        P = max(lens)
        pad = 0 if engine.tokenizer.pad_token_id is None else engine.tokenizer.pad_token_id
        rows_uniq, new_rows, settings = [], [], []
        for j in jobs:
            a = _Active(j, engine.version)
            sp = j.params
            stops = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(engine.eos_ids))
            for i in range(sp.n):
                row = _Row(a, i, stops, sp.max_tokens, tuple(sp.stop), sp.top_logprobs)
                a.rows.append(row)
                new_rows.append(row)
                rows_uniq.append(unique[tuple(j.prompt)])
                settings.append(sp)
        R, B = len(new_rows), len(self.rows)
        with engine._lock, torch.inference_mode():
            tokens_U_P = torch.tensor([[pad] * (P - len(u)) + list(u) for u in uniq], device=dev)
            lens_U = torch.tensor(lens, device=dev)
            offset_U = P - lens_U
            positions_U_P = (torch.arange(P, device=dev)[None] - offset_U[:, None]).clamp_min(0)
            key_valid_U_P = (positions_U_P > 0) | (torch.arange(P, device=dev)[None] == offset_U[:, None]) \
                if min(lens) < P else None
            row_uniq = torch.tensor(rows_uniq, device=dev)
            budget = max(sp.max_tokens for sp in settings)
            if B == 0:  # a fresh batch: the cache generate would allocate
                c = P
                self.buf = self.runner.new_cache(R, P + budget).kv
            else:
                c = self._make_room(R, P, budget)
            # prefill straight into rows [B, B + R) of the buffer, columns [c - P, c); the
            # columns before are masked for these rows, but must hold numbers, not leftover
            # garbage (a NaN there times an attention weight of 0 would still leak)
            if c > P:
                self.buf[:, :, B:B + R, :, :c - P].zero_()
            target = KVCache(self.buf[:, :, B:B + R, :, c - P:], 0)
            logits = self.runner.forward(tokens_U_P, positions_U_P, target, key_valid_U_P, causal=True,
                                         cache_rows=row_uniq).index_select(0, row_uniq)
            f32 = torch.float32
            parts = dict(
                temperature=torch.tensor([sp.temperature for sp in settings], device=dev, dtype=f32),
                top_k=torch.tensor([sp.top_k for sp in settings], device=dev),
                top_p=torch.tensor([sp.top_p for sp in settings], device=dev, dtype=f32),
                processed=torch.tensor([sp.logprobs_mode == "processed" for sp in settings], device=dev),
                pos_next=lens_U.index_select(0, row_uniq),
                start=offset_U.index_select(0, row_uniq) + (c - P),
                logits=logits)
            for name, value in parts.items():
                old = getattr(self, name)
                setattr(self, name, value if B == 0 else torch.cat([old, value]))
            self.rows = self.rows + new_rows
            self.cache = KVCache(self.buf[:, :, :B + R], c)
            self._settings_changed()
        s = self.stats
        s.prefills += 1
        s.live_rows = len(self.rows)
        s.max_rows = max(s.max_rows, len(self.rows))
        s.max_batch_jobs = max(s.max_batch_jobs, len({id(r.job) for r in self.rows}))

    def _make_room(self, R: int, P: int, budget: int) -> int:
        """Ensure the buffer has R free rows and the columns a group of prompts up to P
        tokens and `budget` new tokens needs; returns the current column (where the group's
        prompts end). Reallocates (compacting the columns) only when it must."""
        from flywheel.inference.decoder import KVCache

        buf, B, c = self.buf, len(self.rows), self.cache.length
        left = max(max(r.max_new - len(r.tokens) for r in self.rows), budget)
        rows_ok = B + R <= buf.shape[2]
        if rows_ok and P <= c and c + left <= buf.shape[4]:
            return c
        origin = int(self.start.min())  # columns before it are seen by no live row: dropped
        c_new = max(c - origin, P)
        shift = c_new - c  # old column x -> x + shift
        columns = c_new + left
        columns += max(64, columns // 2)  # room for the next groups before the next reallocation
        rows = max(B + R, min(self.max_rows, 2 * (B + R)))
        shape = list(buf.shape)
        shape[2], shape[4] = rows, columns
        # uninitialised: every column a row can attend to is written or zeroed first (here for
        # the rows kept, in _admit for a joining group); masked columns must hold numbers, as
        # a NaN times an attention weight of 0 is still NaN
        grown = buf.new_empty(shape)
        grown[:, :, :B, :, :origin + shift].zero_()
        grown[:, :, :B, :, origin + shift:c_new] = buf[:, :, :B, :, origin:c]
        self.buf = grown
        self.start = self.start + shift
        self.cache = KVCache(grown[:, :, :B], c_new)
        return c_new

    def _settings_changed(self) -> None:
        from flywheel.inference.sampling import Needs

        self.needs = Needs.of(self.temperature, self.top_k, self.top_p)
        self.any_processed = bool(self.processed.any())
        self.k_max = max((r.top for r in self.rows), default=0)
        self.padded = bool((self.start > 0).any())

    # ---------------------------------------------------------------- stepping

    def step(self) -> None:
        """Sample one token for every row and report it (on_tokens); finished rows leave
        (their jobs resolve); one decode forward for the rest. A failure fails every job of
        the batch."""
        try:
            done = self._step()
        except BaseException as e:  # noqa: BLE001
            log.exception("a continuous batch step failed; failing its %d rows", len(self.rows))
            for a in {id(r.job): r.job for r in self.rows}.values():
                if not a.job.future.done():
                    a.job.future.set_exception(e)
            self.rows, self.cache, self.logits, self.buf = [], None, None, None
            self.stats.live_rows = 0
            return
        for a in done:
            self._resolve(a)

    def _step(self) -> list[_Active]:
        torch, engine = self.torch, self.engine
        from flywheel.inference.decoder import KVCache
        from flywheel.inference.engine import _processed_logprobs
        from flywheel.inference.sampling import reported_logprobs, sample_tokens, top_logprobs, top_pairs

        with engine._lock, torch.inference_mode():
            logits = self.logits
            tok, lp = sample_tokens(logits, self.temperature, self.top_k, self.top_p, engine.generator,
                                    needs=self.needs)
            tops = None
            if self.k_max:  # the token's logprob and its alternatives from one (B, V) table
                lp_B_V = reported_logprobs(logits, self.temperature, self.top_k, self.top_p, self.processed, self.needs)
                lp = lp_B_V.gather(-1, tok[:, None]).squeeze(-1)
                known = engine.known_tokens
                ids_B_K, lps_B_K = top_logprobs(lp_B_V, self.k_max, known)
                tops = (ids_B_K.tolist(), lps_B_K.tolist())
            elif self.any_processed:
                lp = torch.where(self.processed, _processed_logprobs(logits, tok, self, self.needs), lp)
            toks, lps = tok.tolist(), lp.tolist()
            keep: list[int] = []
            finished: list[_Active] = []
            reports: dict[int, tuple[_Job, dict[int, list[int]], TokenLogprobs]] = {}
            for b, row in enumerate(self.rows):
                t = toks[b]
                if row.job.job.future.aborted:  # the caller went away: the row leaves, the token is dropped
                    row.finish = ("cancelled", None)
                    row.job.left -= 1
                    if row.job.left == 0:
                        finished.append(row.job)
                    continue
                row.tokens.append(t)
                row.logprobs.append(lps[b])
                pairs = top_pairs(tops[0][b], tops[1][b], row.top) if row.top else None
                if pairs is not None:
                    row.tops.append(pairs)
                if row.job.job.on_tokens is not None:
                    _, ids, lp_report = reports.setdefault(id(row.job), (row.job.job, {}, {}))
                    ids[row.index] = [t]
                    if row.job.job.report_logprobs:
                        lp_report[row.index] = [(lps[b], pairs)]
                if t in row.stops:
                    row.finish = ("stop", t)
                elif len(row.tokens) >= row.max_new:
                    row.finish = ("length", None)
                elif row.strings and (hit := engine._stop_string_hit(row.tokens, row.strings)) is not None:
                    row.finish = ("string", hit)
                else:
                    keep.append(b)
                    continue
                row.job.left -= 1
                if row.job.left == 0:
                    finished.append(row.job)
            self.stats.steps += 1
            self.stats.live_rows = len(keep)
            # reported before the next forward (a client gets its token one forward sooner);
            # finished jobs resolve after it, while an accelerator runs it
            for job, tokens, lp_report in reports.values():
                _report(job, self.label, tokens, logprobs=lp_report)
            if not keep:
                self.rows, self.cache, self.logits, self.buf = [], None, None, None
                return finished
            if len(keep) < len(self.rows):
                # the rows that stay; a row past the new end fills a hole left by a finished one
                B = len(keep)
                order = list(range(B))
                holes = [b for b in range(B) if self.rows[b].finish is not None]
                movers = [b for b in keep if b >= B]
                for h, m in zip(holes, movers):
                    order[h] = m
                if holes:
                    self.buf[:, :, holes] = self.buf[:, :, movers]
                idx = torch.tensor(order, device=self.dev)
                self.rows = [self.rows[b] for b in order]
                self.cache = KVCache(self.buf[:, :, :B], self.cache.length)
                tok = tok.index_select(0, idx)
                for name in ("temperature", "top_k", "top_p", "processed", "pos_next", "start"):
                    setattr(self, name, getattr(self, name).index_select(0, idx))
                self._settings_changed()
            c = self.cache.length
            key_valid = None
            if self.padded:
                key_valid = torch.arange(c + 1, device=self.dev)[None, :] >= self.start[:, None]
            self.logits = self.runner.forward(tok[:, None], self.pos_next[:, None], self.cache, key_valid,
                                              causal=False)
            self.pos_next = self.pos_next + 1
        return finished

    def _resolve(self, a: _Active) -> None:
        engine, job = self.engine, a.job
        texts = engine._decode_batch([r.tokens for r in a.rows])
        samples = []
        for row, text in zip(a.rows, texts):
            reason, stop_reason = row.finish
            if reason == "string":
                reason = "stop"
                cut = text.find(stop_reason)
                text = text[:cut] if cut >= 0 else text
            samples.append(Sample(token_ids=row.tokens, logprobs=row.logprobs, finish_reason=reason,
                                  version=a.version, prompt_index=0, stop_reason=stop_reason, text=text,
                                  prompt_len=len(job.prompt), top_logprobs=row.tops if row.top else None))
        s = self.stats
        s.jobs += 1
        s.rows += len(a.rows)
        if any(r.finish[0] == "cancelled" for r in a.rows):
            s.aborted += 1
        if not job.future.done():
            job.future.set_result(BatchResult(samples, self.label, engine))


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
