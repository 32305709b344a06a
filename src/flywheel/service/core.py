"""OpenAIService: the OpenAI-compatible serving core, independent of any web framework.

A request body (a dict, as decoded from JSON) is validated, rendered to prompt ids with
the model's chat template, queued on the `BatchScheduler` (continuous batching: a request
joins the running batch at its next decode step, so concurrent requests share forward
passes) and turned into an OpenAI response dict; every returned choice is handed to the
trace sink. The FastAPI app (`flywheel.service.app`) only moves bytes.

Versions: the service serves one model under a stable name (`name`, what clients put in
`model`) and a version label (the registry's version), reported in every response as
`system_fingerprint` and in the traces as `model_version`. `switch(model_dir_or_engine,
label)` loads the new model in the calling thread (never on the request path), then the
scheduler swaps engines once the running batch has drained (nothing joins it meanwhile):
requests in flight finish on the old version and none fails. Versions must share a tokenizer (a fine-tuned descendant does), because a
request's prompt may be rendered just before a switch and generated just after.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from flywheel.envs.parsing import HermesParser, ToolCallParser
from flywheel.inference.batching import BatchResult, BatchScheduler
from flywheel.inference.sampler import SamplingParams
from flywheel.loop.trace_schema import describe
from flywheel.service import responses as R
from flywheel.service.errors import OpenAIError, bad
from flywheel.service.schemas import ChatCompletionRequest, CompletionRequest
from flywheel.service.traces import TraceEvent, TraceSink

log = logging.getLogger(__name__)
B = TypeVar("B", bound=BaseModel)


class OpenAIService:
    def __init__(self, model, *, version: str = "v0", name: str = "flywheel", max_batch: int = 64,
                 window_s: float = 0.002, default_max_tokens: int = 512, trace_sink: TraceSink | None = None,
                 parser: ToolCallParser | None = None, continuous: bool = True, **load_kw):
        """model: a model folder or a loaded LocalEngine. default_max_tokens: the budget of a
        chat request that sets none (clipped to the context left). max_batch, window_s,
        continuous: the BatchScheduler's (continuous=False: whole batches run to completion)."""
        engine = self._load(model, **load_kw)
        self.name = name
        self.default_max_tokens = default_max_tokens
        self.trace_sink = trace_sink
        self.parser = parser or HermesParser()
        self.created = int(time.time())
        self.scheduler = BatchScheduler(engine, version, max_batch=max_batch, window_s=window_s,
                                        continuous=continuous)
        self._renderer = _renderer(engine)

    # ------------------------------------------------------------------ versions

    @property
    def version(self) -> str:
        return self.scheduler.label

    @property
    def engine(self):
        return self.scheduler.engine

    @staticmethod
    def _load(model, **load_kw):
        if isinstance(model, (str, Path)):
            from flywheel.inference import LocalEngine

            return LocalEngine.from_path(str(model), **load_kw)
        return model

    def switch(self, model, version: str, **load_kw) -> None:
        """Serve `model` (folder or engine) as `version` from the next batch on. Blocking:
        call it from a thread other than the event loop (see `switch_async`)."""
        engine = self._load(model, **load_kw)
        _check_same_tokenizer(self.engine.tokenizer, engine.tokenizer)
        self.scheduler.switch(engine, version)
        log.info("serving %s version %s from the next batch", self.name, version)

    async def switch_async(self, model, version: str, **load_kw) -> None:
        await asyncio.to_thread(self.switch, model, version, **load_kw)

    def close(self) -> None:
        self.scheduler.close()
        close = getattr(self.trace_sink, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ endpoints

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "flywheel", "version": self.version}]}

    async def chat(self, body: Any) -> tuple[dict[str, Any], ChatCompletionRequest]:
        """(chat.completion response, parsed request)."""
        t0 = time.perf_counter()
        req = _parse(ChatCompletionRequest, body)
        self._check_model(req.model)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if req.tool_choice == "none":
            tools = None
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        if self._renderer is None:
            raise bad("messages", "this model has no chat template; use /v1/completions")
        try:
            prompt = self._renderer.prompt_ids(_template_messages(messages), tools)
        except Exception as e:  # jinja's raise_exception and template errors
            raise bad("messages", f"cannot render the chat template: {e}") from None
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        params = self._params(req, len(prompt), req.budget, param, clip_default=True)
        result = await self._run(prompt, params, req.seed)
        tok = result.engine.tokenizer
        choices, completion_tokens = [], 0
        for i, s in enumerate(result.samples):
            message, finish = R.assistant_message(s.text or "", tools_offered=bool(tools),
                                                  finish_reason=s.finish_reason, parser=self.parser)
            lp = R.chat_logprobs(R.token_logprobs(tok, s)) if req.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            completion_tokens += len(s.token_ids)
        response = {"id": R.new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
                    "model": self.name, "system_fingerprint": result.label, "choices": choices,
                    "usage": R.usage(len(prompt), completion_tokens)}
        latency_ms = (time.perf_counter() - t0) * 1000
        meta = _request_meta(req, "chat.completions", params)
        self._trace([TraceEvent(
            trace_id=_trace_id(response["id"], c["index"]), model=self.name, model_version=result.label,
            messages=messages, tools=tools, response=c["message"],
            usage=R.usage(len(prompt), len(s.token_ids)), latency_ms=latency_ms,
            created_at=datetime.now(timezone.utc), finish_reason=c["finish_reason"], metadata=meta)
            for c, s in zip(choices, result.samples)])
        return response, req

    async def completions(self, body: Any) -> tuple[dict[str, Any], CompletionRequest]:
        """(text_completion response, parsed request)."""
        t0 = time.perf_counter()
        req = _parse(CompletionRequest, body)
        self._check_model(req.model)
        engine = self.engine
        prompts = [self._prompt_ids(engine, p, i) for i, p in enumerate(req.prompts())]
        params = [self._params(req, len(p), req.budget, "max_tokens", clip_default=False) for p in prompts]
        results = await asyncio.gather(*(self._run(p, sp, req.seed) for p, sp in zip(prompts, params)))
        choices, events, completion_tokens = [], [], 0
        rid, now = R.new_id("cmpl"), datetime.now(timezone.utc)
        latency_ms = (time.perf_counter() - t0) * 1000
        for i, (prompt, result) in enumerate(zip(prompts, results)):
            prompt_text = result.engine.tokenizer.decode(prompt, skip_special_tokens=False)
            for j, s in enumerate(result.samples):
                index = i * req.n + j
                lp = R.completion_logprobs(R.token_logprobs(result.engine.tokenizer, s)) \
                    if req.logprobs is not None else None
                choices.append({"index": index, "text": s.text or "", "logprobs": lp, "finish_reason": s.finish_reason})
                completion_tokens += len(s.token_ids)
                events.append(TraceEvent(
                    trace_id=_trace_id(rid, index), model=self.name, model_version=result.label,
                    messages=[{"role": "user", "content": prompt_text}], tools=None,
                    response={"role": "assistant", "content": s.text or ""},
                    usage=R.usage(len(prompt), len(s.token_ids)), latency_ms=latency_ms, created_at=now,
                    finish_reason=s.finish_reason, metadata=_request_meta(req, "completions", params[i])))
        response = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.name,
                    "system_fingerprint": results[0].label, "choices": choices,
                    "usage": R.usage(sum(len(p) for p in prompts), completion_tokens)}
        self._trace(events)
        return response, req

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
        return SamplingParams(n=req.n, temperature=0.0 if greedy else req.temperature,
                              top_p=1.0 if greedy else req.top_p, max_tokens=budget, stop=req.stop_strings)

    async def _run(self, prompt: list[int], params: SamplingParams, seed: int | None) -> BatchResult:
        try:
            future = self.scheduler.submit(prompt, params, seed)
        except RuntimeError as e:  # closed: the server is shutting down
            raise OpenAIError(str(e), status=503, type="server_error") from None
        try:
            return await asyncio.wrap_future(future)
        except ValueError as e:  # the engine refused the request's values
            raise OpenAIError(str(e)) from None
        except Exception as e:
            log.exception("generation failed")
            raise OpenAIError(f"generation failed: {type(e).__name__}: {e}", status=500, type="server_error") from None

    def _trace(self, events: list[TraceEvent]) -> None:
        if self.trace_sink is None:
            return
        for e in events:
            try:
                self.trace_sink(e)
            except Exception:  # a broken sink must never fail a served request
                log.exception("trace sink failed for %s", e.trace_id)


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
    from flywheel.models import ChatRenderer, ChatTemplateError

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
