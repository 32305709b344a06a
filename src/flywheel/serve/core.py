"""OpenAIService: the OpenAI-compatible serving core, independent of any web framework.

A request body (a dict, as decoded from JSON) is validated, rendered with the model's chat
template, queued on the `BatchScheduler` (it joins the running batch at the next decode step)
and turned into an OpenAI response dict; every returned choice goes to the trace sink. The
FastAPI app (`flywheel.serve.app`) only moves bytes.

Streaming (`stream: true`) returns an `EventStream`: each choice, under its index, sends its
text as it is sampled (`responses.TextStream`, with its tokens' logprobs when asked; an engine
that cannot step sends it whole at the end), then its tool calls and finish_reason once the
whole job (all n samples) ended; then the usage chunk and `data: [DONE]`. It starts only with
the first tokens, so a refused request still gets a plain JSON error; choices and traces are
built by the non-streamed code; a client that goes away has its job aborted and what was
generated traced ("cancelled" for the rows cut).

Versions: `switch` loads a model off the request path; the scheduler swaps engines once the
running batch has drained, so requests in flight finish on the old version and none fails.
The version serving a request is its `system_fingerprint` and its traces' `model_version`.
Versions must share a tokenizer: a prompt may be rendered just before a switch.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, AsyncIterator, Callable, TypeVar

from pydantic import BaseModel, ValidationError

from flywheel.inference import LocalEngine
from flywheel.inference.sampler import SamplingParams
from flywheel.inference.scheduler import BatchScheduler, JobResult
from flywheel.models import ChatRenderer, ChatTemplateError, ToolsNotRendered
from flywheel.models.gguf_import import read_record
from flywheel.models.token_bytes import token_table
from flywheel.models.tool_calls import HermesParser, ToolCallParser
from flywheel.serve import responses as R
from flywheel.errors import OpenAIError, bad
from flywheel.serve.schemas import ChatCompletionRequest, CompletionRequest
from flywheel.serve.traces import TraceEvent, TraceSink
from flywheel.threads import in_passing_thread
from flywheel.traces.tables import DEFAULT_TENANT
from flywheel.traces.schema import describe

log = logging.getLogger(__name__)
B = TypeVar("B", bound=BaseModel)


@dataclass
class _Chat:
    """A validated chat request, rendered and ready to run."""

    req: ChatCompletionRequest
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt: list[int]
    params: SamplingParams
    t0: float
    tenant: str  # whose request: its traces are the tenant's


@dataclass
class _Completion:
    req: CompletionRequest
    prompts: list[list[int]]
    params: list[SamplingParams]
    t0: float
    tenant: str


class OpenAIService:
    def __init__(self, model, *, version: str = "v0", name: str = "flywheel", max_batch: int = 64,
                 window_s: float = 0.002, default_max_tokens: int = 512, trace_sink: TraceSink | None = None,
                 parser: ToolCallParser | None = None, continuous: bool = True, **load_kw):
        """model: a model folder or a loaded LocalEngine. default_max_tokens: the budget of a
        chat request that sets none (clipped to the context left). max_batch, window_s,
        continuous: the BatchScheduler's (continuous=False: whole batches run to completion)."""
        engine = self._load(model, **load_kw)
        self.model_path = Path(model).resolve() if isinstance(model, (str, Path)) else None
        self.adapter: str | None = None  # a view's LoRA adapter (`with_adapter`)
        self.label: str | None = None  # a view's version label (`with_adapter`, `renamed`); None: the scheduler's
        self.name = name
        self.default_max_tokens = default_max_tokens
        self.trace_sink = trace_sink
        self.parser = parser or HermesParser()
        self.created = int(time.time())
        self.scheduler = BatchScheduler(engine, version, max_batch=max_batch, window_s=window_s,
                                        continuous=continuous)
        self._renderer = _renderer(engine)
        self._wakers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> _Waker

    def template_note(self) -> str:
        """Which chat template this model is served with, and whether requests may carry tools."""
        if self._renderer is None:
            return "chat template: none (chat requests are refused; use /v1/completions)"
        record = read_record(self.model_path) if self.model_path is not None else None
        which = "the model's own" if record is None or record.chat_template.startswith("own") else (
            f"flywheel's {record.chat_template} (the model's own renders no tools)")
        tools = "rendered" if self._renderer.renders_tools else "refused with a 400 (the template renders none)"
        return f"chat template: {which}; tools: {tools}"

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> str:
        return self.scheduler.label

    @property
    def engine(self):
        return self.scheduler.engine

    @staticmethod
    def _load(model, **load_kw):
        """An engine for `model`: a loaded engine as it is; a model folder; a LoRA adapter
        folder (a promoted LoRA candidate) merged into its base, once, beside it."""
        if isinstance(model, (str, Path)):
            from flywheel.train.lora import whole_model

            return LocalEngine.from_path(str(whole_model(model)), **load_kw)
        return model

    def switch(self, model, version: str, **load_kw) -> None:
        """Serve `model` (folder or engine) as `version` from the next batch on. Blocking:
        call it from a thread other than the event loop (see `switch_async`)."""
        engine = self._load(model, **load_kw)
        _check_same_tokenizer(self.engine.tokenizer, engine.tokenizer)
        self.scheduler.switch(engine, version)
        log.info("serving %s version %s from the next batch", self.name, version)

    async def switch_async(self, model, version: str, **load_kw) -> None:
        await in_passing_thread(self.switch, model, version, **load_kw)  # a model merge's torch work dies with it

    def with_adapter(self, name: str, adapter: str, label: str | None = None) -> "OpenAIService":
        """A view of this service answering as model `name` with the LoRA adapter `adapter` of
        its engine (registered in `engine.adapters`), its responses' version `label` (default:
        the base's). It shares this service's scheduler, so its rows decode in the same
        batches as the base model's and other adapters'. Close the service, never a view."""
        view = copy.copy(self)
        view.name, view.adapter, view.label, view.created = name, adapter, label, int(time.time())
        return view

    def renamed(self, name: str, label: str) -> "OpenAIService":
        """A view answering as model `name` (an alias) what this service answers, its version
        `label` (the model the alias serves now), its traces recorded under `name`."""
        view = copy.copy(self)
        view.name, view.label = name, label
        return view

    def _label(self, scheduler_label: str) -> str:
        """The version a response and its traces name: a view's own label, else the scheduler's."""
        return self.label or scheduler_label

    def close(self) -> None:
        self.scheduler.close()
        close = getattr(self.trace_sink, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ endpoints

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "flywheel", "version": self.version}]}

    async def chat(self, body: Any, tenant: str = DEFAULT_TENANT) -> tuple[dict[str, Any] | "EventStream",
                                                                           ChatCompletionRequest]:
        """(chat.completion response, parsed request); with `stream` set, an `EventStream`
        of `chat.completion.chunk` objects instead of the response. Traced as `tenant`'s."""
        c = self._prepare_chat(body, tenant)
        if c.req.stream:
            return await self._stream_chat(c), c.req
        result = await self._run(c.prompt, c.params, c.req.seed)
        choices = self._chat_choices(c, result)
        response = self._chat_response(c, R.new_id("chatcmpl"), int(time.time()), choices, [result])
        self._trace(self._chat_events(c, response, [result]))
        return response, c.req

    async def completions(self, body: Any, tenant: str = DEFAULT_TENANT) -> tuple[dict[str, Any] | "EventStream",
                                                                                  CompletionRequest]:
        """(text_completion response, parsed request); with `stream` set, an `EventStream`.
        Traced as `tenant`'s."""
        c = self._prepare_completion(body, tenant)
        if c.req.stream:
            return await self._stream_completion(c), c.req
        results = await asyncio.gather(*(self._run(p, sp, c.req.seed) for p, sp in zip(c.prompts, c.params)))
        choices = [ch for i, r in enumerate(results) for ch in self._completion_choices(c, i, r)]
        response = self._completion_response(c, R.new_id("cmpl"), int(time.time()), choices, list(results))
        self._trace(self._completion_events(c, response, list(results)))
        return response, c.req

    # ------------------------------------------------------------------ requests and responses

    def _prepare_chat(self, body: Any, tenant: str) -> _Chat:
        t0 = time.perf_counter()
        req = _parse(ChatCompletionRequest, body)
        self._check_model(req.model)
        tools = None if req.tool_choice == "none" else req.tool_dicts()
        messages = req.message_dicts()
        if self._renderer is None:
            raise bad("messages", "this model has no chat template; use /v1/completions")
        try:
            prompt = self._renderer.prompt_ids(_template_messages(messages), tools)
        except ToolsNotRendered as e:
            raise bad("tools", str(e)) from None
        except Exception as e:  # jinja's raise_exception and template errors
            raise bad("messages", f"cannot render the chat template: {e}") from None
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._params(req, len(prompt), req.budget, param, clip_default=True)
        return _Chat(req, messages, tools, prompt, params, t0, tenant)

    def _chat_choices(self, c: _Chat, result: JobResult) -> list[dict[str, Any]]:
        tok = result.engine.tokenizer
        choices = []
        for i, s in enumerate(result.samples):
            message, finish = R.assistant_message(s.text or "", tools_offered=bool(c.tools),
                                                  finish_reason=s.finish_reason, parser=self.parser)
            lp = R.chat_logprobs(token_table(tok), s) if c.req.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
        return choices

    def _chat_response(self, c: _Chat, rid: str, created: int, choices: list[dict[str, Any]],
                       results: list[JobResult]) -> dict[str, Any]:
        [result] = results
        return {"id": rid, "object": "chat.completion", "created": created, "model": self.name,
                "system_fingerprint": self._label(result.label), "choices": choices,
                "usage": R.usage(len(c.prompt), sum(len(s.token_ids) for s in result.samples))}

    def _chat_events(self, c: _Chat, response: dict[str, Any], results: list[JobResult]) -> list[TraceEvent]:
        """One trace per choice."""
        [result] = results
        latency_ms = (time.perf_counter() - c.t0) * 1000
        meta = _request_meta(c.req, "chat.completions", c.params)
        return [TraceEvent(
            trace_id=_trace_id(response["id"], ch["index"]), model=self.name,
            model_version=self._label(result.label),
            messages=c.messages, tools=c.tools, response=ch["message"],
            usage=R.usage(len(c.prompt), len(s.token_ids)), latency_ms=latency_ms,
            created_at=datetime.now(timezone.utc), finish_reason=ch["finish_reason"], metadata=meta, tenant=c.tenant)
            for ch, s in zip(response["choices"], result.samples)]

    def _prepare_completion(self, body: Any, tenant: str) -> _Completion:
        t0 = time.perf_counter()
        req = _parse(CompletionRequest, body)
        self._check_model(req.model)
        engine = self.engine
        prompts = [self._prompt_ids(engine, p, i) for i, p in enumerate(req.prompts())]
        params = [self._params(req, len(p), req.budget, "max_tokens", clip_default=False) for p in prompts]
        return _Completion(req, prompts, params, t0, tenant)

    def _completion_choices(self, c: _Completion, i: int, result: JobResult) -> list[dict[str, Any]]:
        """The choices of prompt i: indices i * n + j."""
        out = []
        for j, s in enumerate(result.samples):
            lp = R.completion_logprobs(token_table(result.engine.tokenizer), s) \
                if c.req.logprobs is not None else None
            out.append({"index": i * c.req.n + j, "text": s.text or "", "logprobs": lp,
                        "finish_reason": s.finish_reason})
        return out

    def _completion_response(self, c: _Completion, rid: str, created: int, choices: list[dict[str, Any]],
                             results: list[JobResult | None]) -> dict[str, Any]:
        """(results: one per prompt; `None` for a job of a stream cut short that never ran)"""
        ran = [(i, r) for i, r in enumerate(results) if r is not None]
        return {"id": rid, "object": "text_completion", "created": created, "model": self.name,
                "system_fingerprint": self._label(ran[0][1].label), "choices": choices,
                "usage": R.usage(sum(len(c.prompts[i]) for i, _ in ran),
                                 sum(len(s.token_ids) for _, r in ran for s in r.samples))}

    def _completion_events(self, c: _Completion, response: dict[str, Any],
                           results: list[JobResult | None]) -> list[TraceEvent]:
        """One trace per choice (none for a prompt whose job never ran)."""
        ran = [(i, r) for i, r in enumerate(results) if r is not None]
        latency_ms = (time.perf_counter() - c.t0) * 1000
        now = datetime.now(timezone.utc)
        by_index = {ch["index"]: ch for ch in response["choices"]}
        events = []
        for i, result in ran:
            prompt = c.prompts[i]
            prompt_text = result.engine.tokenizer.decode(prompt, skip_special_tokens=False)
            for j, s in enumerate(result.samples):
                ch = by_index[i * c.req.n + j]
                events.append(TraceEvent(
                    trace_id=_trace_id(response["id"], ch["index"]), model=self.name,
            model_version=self._label(result.label),
                    messages=None, prompt=prompt_text, tools=None,
                    response={"role": "assistant", "content": ch["text"]},
                    usage=R.usage(len(prompt), len(s.token_ids)), latency_ms=latency_ms, created_at=now,
                    finish_reason=ch["finish_reason"], metadata=_request_meta(c.req, "completions", c.params[i]),
                    tenant=c.tenant))
        return events

    # ------------------------------------------------------------------ streaming

    async def _stream_chat(self, c: _Chat) -> "EventStream":
        decode = R.text_decoder(self.engine.tokenizer)
        open_tag = getattr(self.parser, "open_tag", None)

        def texts(job: int) -> list[R.TextStream]:
            return [R.TextStream(decode, stop=c.params.stop, hold=(open_tag,) if c.tools and open_tag else (),
                                 tools=bool(c.tools), hold_all=bool(c.tools) and not open_tag)
                    for _ in range(c.params.n)]

        def respond(rid, created, choices, results):
            response = self._chat_response(c, rid, created, choices, results)
            return response, self._chat_events(c, response, results)

        stream = EventStream(self, chat=True, rid=R.new_id("chatcmpl"), include_usage=c.req.include_usage,
                             texts=texts, choices=lambda i, r: self._chat_choices(c, r), respond=respond,
                             logprobs=token_table(self.engine.tokenizer) if c.req.logprobs else None)
        await stream.start([(c.prompt, c.params, c.req.seed)])
        return stream

    async def _stream_completion(self, c: _Completion) -> "EventStream":
        decode = R.text_decoder(self.engine.tokenizer)

        def respond(rid, created, choices, results):
            response = self._completion_response(c, rid, created, choices, results)
            return response, self._completion_events(c, response, results)

        stream = EventStream(self, chat=False, rid=R.new_id("cmpl"), include_usage=c.req.include_usage,
                             texts=lambda i: [R.TextStream(decode, stop=sp.stop) for sp in [c.params[i]] * c.req.n],
                             choices=lambda i, r: self._completion_choices(c, i, r), respond=respond)
        await stream.start([(p, sp, c.req.seed) for p, sp in zip(c.prompts, c.params)])
        return stream

    def _waker(self) -> "_Waker":
        loop = asyncio.get_running_loop()
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = _Waker(loop)
        return waker

    # ------------------------------------------------------------------ helpers

    def _check_model(self, model: str) -> None:
        if model != self.name:
            raise bad("model", f"unknown model {model!r} (this server serves {self.name!r})", code="model_not_found")

    def _prompt_ids(self, engine, prompt: str | list[int], index: int) -> list[int]:
        where = "prompt" if index == 0 else f"prompt[{index}]"
        if isinstance(prompt, str):
            ids = engine.encode(prompt)
            if not ids:
                raise bad(where, "the prompt is empty")
            return ids
        vocab = engine.vocab_size
        for t in prompt:
            if not 0 <= t < vocab:
                raise bad(where, f"token id {t} is outside the vocabulary [0, {vocab})")
        if not prompt:
            raise bad(where, "the prompt is empty")
        return list(prompt)

    def _params(self, req, prompt_len: int, budget: int | None, param: str, clip_default: bool) -> SamplingParams:
        ctx = getattr(self.engine, "max_positions", 1 << 30)
        left = ctx - prompt_len
        if left < 1:
            raise bad("messages" if clip_default else "prompt",
                      f"the prompt has {prompt_len} tokens; the model's context is {ctx}")
        if budget is None:
            budget = min(self.default_max_tokens, left)
        elif budget > left:
            raise bad(param, f"{budget} is too large: the prompt has {prompt_len} tokens and the model's "
                             f"context is {ctx}, so at most {left} can be generated")
        greedy = req.temperature == 0 or req.top_p == 0
        # logprobs as OpenAI reports them: under the distribution sampled from ("processed")
        asked = req.logprobs is not None and req.logprobs is not False
        return SamplingParams(n=req.n, temperature=0.0 if greedy else req.temperature,
                              top_p=1.0 if greedy else req.top_p, max_tokens=budget, stop=req.stop_strings,
                              logprobs_mode="processed" if asked else "raw",
                              top_logprobs=getattr(req, "top_logprobs", None) or 0)

    def _submit(self, prompt: list[int], params: SamplingParams, seed: int | None, on_tokens=None,
                report_logprobs: bool = False):
        try:
            return self.scheduler.submit(prompt, params, seed, on_tokens=on_tokens, report_logprobs=report_logprobs,
                                         adapter=self.adapter)
        except RuntimeError as e:  # closed: the server is shutting down
            raise OpenAIError(str(e), status=503, type="server_error") from None

    async def _run(self, prompt: list[int], params: SamplingParams, seed: int | None) -> JobResult:
        future = self._submit(prompt, params, seed)
        try:
            return await asyncio.wrap_future(future)
        except Exception as e:
            raise _generation_error(e) from None

    def _trace(self, events: list[TraceEvent]) -> None:
        if self.trace_sink is None:
            return
        for e in events:
            try:
                self.trace_sink(e)
            except Exception:  # a broken sink must never fail a served request
                log.exception("trace sink failed for %s", e.trace_id)


def _generation_error(e: BaseException) -> OpenAIError:
    if isinstance(e, ValueError):  # the engine refused the request's values
        return OpenAIError(str(e))
    log.error("generation failed", exc_info=e)
    return OpenAIError(f"generation failed: {type(e).__name__}: {e}", status=500, type="server_error")


class _Waker:
    """Wakes event-loop streams from the scheduler's thread: however many streams a decode
    step reports to, one `call_soon_threadsafe` (a write to the loop's self-pipe)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._due: list[EventStream] = []

    def __call__(self, stream: "EventStream") -> None:
        with self._lock:
            first = not self._due
            self._due.append(stream)
        if first:
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                with self._lock:
                    self._due.clear()

    def _run(self) -> None:
        with self._lock:
            due, self._due = self._due, []
        for stream in dict.fromkeys(due):
            stream._wake()


class _StreamJob:
    """One scheduler job of a stream and the streamed text of its samples."""

    def __init__(self, texts: list[R.TextStream], logprobs: list[R.LogprobStream] | None = None):
        self.texts = texts
        self.logprobs = logprobs  # per sample, when the request asked for logprobs
        self.future = None
        self.reports: deque[tuple[str, dict[int, list[int]], bool, dict | None]] = deque()
        self.started = False  # tokens were reported
        self.result: JobResult | None = None
        self.choices: list[dict[str, Any]] | None = None  # set when the job has ended


class EventStream:
    """A streamed request in flight (see the module doc). `label` is the version serving it;
    iterate `chunks()` for the chunk objects (an error object, then the end, if generation
    fails mid-stream: `failed` is then set); call `close()` when the client is gone (or at the
    end: it is idempotent)."""

    def __init__(self, service: OpenAIService, *, chat: bool, rid: str, include_usage: bool,
                 texts: Callable[[int], list[R.TextStream]],
                 choices: Callable[[int, JobResult], list[dict[str, Any]]],
                 respond: Callable[..., tuple[dict[str, Any], list[TraceEvent]]], logprobs=None):
        """logprobs: the tokenizer's TokenTable when a chat request asked for logprobs (each
        content chunk then carries its tokens' entries)."""
        self.service, self.chat, self.rid = service, chat, rid
        self._table = logprobs
        self.created = int(time.time())
        self.include_usage = include_usage
        self._texts, self._choices, self._respond = texts, choices, respond
        self.label: str | None = None
        self.failed = False
        self.jobs: list[_StreamJob] = []
        self._event = asyncio.Event()
        self._waker = service._waker()
        self._finished = False  # every job ended and the response was built (or the stream failed)
        self._closed = False
        self._traced = False

    # ---------------------------------------------------------------- scheduler side (worker thread)

    def _on_tokens(self, job: _StreamJob):
        def report(label: str, tokens: dict[int, list[int]], whole: bool, logprobs=None) -> None:
            job.reports.append((label, tokens, whole, logprobs))
            self._waker(self)
        return report

    # ---------------------------------------------------------------- event loop side

    def _wake(self) -> None:
        self._event.set()
        if self._closed and not self._traced and all(j.future.done() for j in self.jobs):
            self._trace_what_ran()

    async def start(self, jobs: list[tuple[list[int], SamplingParams, int | None]]) -> None:
        """Submit the jobs; return once the first tokens came (or raise the OpenAIError of a
        job that failed before: the response has not started, so it can still be an error)."""
        for i, (prompt, params, seed) in enumerate(jobs):
            texts = self._texts(i)
            job = _StreamJob(texts, None if self._table is None else [R.LogprobStream(self._table) for _ in texts])
            try:
                job.future = self.service._submit(prompt, params, seed, on_tokens=self._on_tokens(job),
                                                  report_logprobs=job.logprobs is not None)
            except OpenAIError:
                self._abort()
                raise
            job.future.add_done_callback(lambda _f: self._waker(self))
            self.jobs.append(job)
        try:
            while True:
                for job in self.jobs:
                    if job.future.done() and not job.future.cancelled() and job.future.exception() is not None:
                        raise _generation_error(job.future.exception())
                for job in self.jobs:
                    if job.reports and self.label is None:
                        self.label = self.service._label(job.reports[0][0])
                    elif job.future.done() and self.label is None:
                        self.label = self.service._label(job.future.result().label)
                if self.label is not None:
                    return
                await self._event.wait()
                self._event.clear()
        except BaseException:
            self._abort()
            self._traced = True  # a request that failed is not traced (as when not streamed)
            raise

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        mk = R.Chunks("chat.completion.chunk" if self.chat else "text_completion", self.rid, self.created,
                      self.service.name, self.label, self.include_usage)
        try:
            if self.chat:
                for job in self.jobs:
                    for k in range(len(job.texts)):
                        yield mk.chat(self._index(job, k), {"role": "assistant", "content": ""})
            while True:
                try:
                    out = self._pump(mk)
                except Exception as e:  # noqa: BLE001 - the job failed after the stream started
                    self.failed = True
                    self._abort()
                    self._traced = True
                    yield _generation_error(e).body()
                    return
                for chunk in out:
                    yield chunk
                if all(job.choices is not None for job in self.jobs):
                    break
                await self._event.wait()
                self._event.clear()
            response, events = self._respond(self.rid, self.created,
                                             [ch for job in self.jobs for ch in job.choices],
                                             [job.result for job in self.jobs])
            self._finished = self._traced = True
            self.service._trace(events)
            if self.include_usage:
                yield mk.usage(response["usage"])
        finally:
            self.close()

    def _index(self, job: _StreamJob, k: int) -> int:
        return self.jobs.index(job) * len(job.texts) + k

    def _pump(self, mk: R.Chunks) -> list[dict[str, Any]]:
        """The chunks that the jobs' reports since the last call make."""
        out = []
        for i, job in enumerate(self.jobs):
            if job.choices is not None:
                continue
            done = job.future.done()
            reports = []
            while job.reports:
                reports.append(job.reports.popleft())
            # a job that ended sends the rest of its text in its last chunks; so does a job of
            # an engine that only returns whole results (reported whole, right before its end)
            if not done:
                for _, tokens, whole, logprobs in reports:
                    if whole:
                        continue
                    for k, ids in sorted(tokens.items()):
                        piece = job.texts[k].feed(ids)
                        lp = None
                        if job.logprobs is not None:
                            job.logprobs[k].feed(ids, (logprobs or {}).get(k, ()))
                            lp = job.logprobs[k].take(piece) if piece else None
                        if piece:
                            index = self._index(job, k)
                            out.append(mk.chat(index, {"content": piece}, logprobs=lp) if self.chat
                                       else mk.text(index, piece))
                continue
            job.result = job.future.result()  # raises what generation raised
            job.choices = self._choices(i, job.result)
            for k, (choice, text) in enumerate(zip(job.choices, job.texts)):
                if self.chat:
                    sent = job.logprobs[k].sent if job.logprobs is not None else 0
                    out.extend(mk.chat_end(choice, text.finish(choice["message"].get("content") or ""), sent))
                else:
                    out.extend(mk.text_end(choice, text.finish(choice["text"])))
        return out

    def close(self) -> None:
        """The client is gone (or the stream ended): abort the jobs still running; what they
        generated is traced once they have stopped."""
        if self._closed:
            return
        self._closed = True
        if self._finished:
            return
        self._abort()
        if not self._traced and all(j.future.done() for j in self.jobs):
            self._trace_what_ran()

    def _abort(self) -> None:
        for job in self.jobs:
            if job.future is not None and not job.future.done():
                self.service.scheduler.abort(job.future)

    def _trace_what_ran(self) -> None:
        """Trace the jobs of a stream cut short that produced samples (not those cancelled
        before they ran, nor failed ones)."""
        self._traced = True
        results: list[JobResult | None] = []
        for job in self.jobs:
            f = job.future
            results.append(f.result() if not f.cancelled() and f.exception() is None else None)
        if not any(r is not None for r in results):
            return
        try:
            choices = []
            for i, (job, result) in enumerate(zip(self.jobs, results)):
                if result is not None:
                    choices.extend(job.choices if job.choices is not None else self._choices(i, result))
            _, events = self._respond(self.rid, self.created, choices, results)
        except Exception:  # noqa: BLE001 - tracing must never fail the server
            log.exception("cannot trace the stream %s", self.rid)
            return
        self.service._trace(events)


def _parse(model: type[B], body: Any) -> B:
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise OpenAIError(describe(e), param=_field_path(e.errors(include_url=False)[0]["loc"])) from None


def _field_path(loc: tuple) -> str | None:
    """`('messages', 1, 'role')` -> `messages[1].role` (pydantic's union tags, `@...`, dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not str(part).startswith("@"):
            out += f".{part}" if out else str(part)
    return out or None


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: text content, developer -> system."""
    out = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text":
                    raise bad(f"messages[{i}].content[{j}]", f"only text parts are supported, got {part.get('type')!r}")
                texts.append(part["text"])
            m["content"] = "".join(texts)
        out.append(m)
    return out


def _request_meta(req, endpoint: str, params: SamplingParams) -> dict[str, Any]:
    meta: dict[str, Any] = {"endpoint": endpoint, "n": req.n, "temperature": params.temperature,
                            "top_p": params.top_p, "max_tokens": params.max_tokens}
    if params.stop:
        meta["stop"] = list(params.stop)
    if req.seed is not None:
        meta["seed"] = req.seed
    if req.user:
        meta["user"] = req.user
    if getattr(req, "metadata", None):
        meta["request_metadata"] = req.metadata
    return meta


def _trace_id(response_id: str, index: int) -> str:
    return response_id if index == 0 else f"{response_id}-{index}"


def _renderer(engine):
    try:
        return ChatRenderer(engine.tokenizer)
    except ChatTemplateError:
        return None


def _check_same_tokenizer(old, new) -> None:
    same = (len(old) == len(new) and old.eos_token == new.eos_token
            and getattr(old, "chat_template", None) == getattr(new, "chat_template", None))
    if not same:
        raise ValueError("the new version has another tokenizer or chat template than the served one; "
                         "versions served under one name must share them")
