"""The FastAPI face of `OpenAIService`: routes decode JSON, call the core, encode the answer.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health, and
with a trace store POST /v1/traces and POST /v1/traces/{id}/feedback (serve/ingest.py);
with the fine-tuning API /v1/files and /v1/fine_tuning/jobs (serve/finetune_routes.py), and
with both managed flywheels, /v1/flywheels (serve/flywheel_routes.py);
GET /openapi.json describes each one's body and answers (serve/openapi.py).
Every error, including unknown routes and bodies that are not JSON, has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`. A streamed request is answered with
server-sent events as it is generated: `data: {chunk}` lines (a content delta per decode
step or so, each choice's final chunk with its finish_reason, the usage chunk if asked
for) ending with `data: [DONE]` (see flywheel.serve.core and .responses). A refused
request gets a plain JSON error before any event; a generation that fails mid-stream ends
with a `data: {"error": ...}` event and no `[DONE]`. When the client disconnects, its
stream is closed: the job stops generating (its batch rows are freed) and what it
generated is traced.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tarfile
import threading
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel.loop.curation_rules import CurationConfig
from flywheel.serve import responses as R
from flywheel.serve.body_limit import BodyLimit
from flywheel.serve.core import EventStream, OpenAIService
from flywheel.errors import OpenAIError
from flywheel.finetuning.fine_tuning import FineTuning
from flywheel.jobs.webhooks import Webhooks
from flywheel.serve import finetune_routes, flywheel_routes, ingest
from flywheel.serve.otlp import routes as otlp_routes
from flywheel.serve.dashboard import routes as dashboard_routes
from flywheel.serve.aliases import ProductionAliases
from flywheel.serve.deps import FineTuningDep, ServiceDep, Tenant
from flywheel.finetuning.flywheel_trigger import FlywheelTrigger
from flywheel.finetuning.managed_flywheels import ManagedFlywheels
from flywheel.serve.ingest import TraceIntake, read_json
from flywheel.serve.ingest_pool import IngestPool
from flywheel.serve.openapi import install as install_openapi, route_doc
from flywheel.serve.served_models import ServedModels
from flywheel.threads import in_passing_thread
from flywheel.train.lora import whole_model


MAX_BODY_BYTES = 64 * 2 ** 20  # a JSON request: a batch of 500 ~2 KB traces is ~1 MB




async def json_body(request: Request) -> Any:
    return read_json(await request.body())


BodyDep = Annotated[Any, Depends(json_body)]


GENERATION_ERRORS = {400: "an invalid request (the message names the field; unsupported OpenAI options are "
                          "refused, never ignored)", 500: "generation failed",
                     503: "the server is shutting down"}


def _headers(version: str) -> dict[str, str]:
    return {"x-flywheel-model-version": version}


class EventStreamResponse(StreamingResponse):
    """Server-sent events of an `EventStream`; the stream is closed however the response
    ends (finished, client gone, server stopping), so an abandoned job stops generating."""

    def __init__(self, stream: EventStream):
        headers = {**_headers(stream.label), "cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(self._events(stream), media_type="text/event-stream", headers=headers)
        self.stream = stream

    @staticmethod
    async def _events(stream: EventStream):
        async for chunk in stream.chunks():
            yield R.sse_event(chunk)
        if not stream.failed:
            yield R.SSE_DONE

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.stream.close()


def _answer(response, req) -> JSONResponse | EventStreamResponse:
    """The HTTP answer to a generation request: its events when it streams, else its JSON."""
    if req.stream:
        return EventStreamResponse(response)
    return JSONResponse(response, headers=_headers(response["system_fingerprint"]))


def single_tenant(request: Request) -> str:
    """Every request's tenant when the server has no API keys."""
    return "default"


def create_app(service: OpenAIService, *, close_service_on_shutdown: bool = False, trace_store=None,
               curation: CurationConfig | None = None,
               ingest_pool: IngestPool | None = None, freeze_gc: bool = True,
               fine_tuning: FineTuning | None = None,
               tenant_of: Callable[[Request], str] = single_tenant,
               max_body_bytes: int = MAX_BODY_BYTES, flywheel_poll_s: float = 2.0) -> FastAPI:
    """`trace_store` (the loop's TraceStore) enables POST /v1/traces and feedback
    (flywheel.serve.ingest), feedback judged by `curation`'s rules (default: the defaults);
    `ingest_pool` prepares its batches (default: a thread of the server does; `IngestPool(n)`:
    n worker processes). The app starts and closes the pool.

    `fine_tuning` enables the fine-tuning API (serve/finetune_routes.py): files and jobs of
    the caller's tenant, and its fine-tuned models in /v1/models and in generation requests,
    each loaded on first use (serve/served_models.py). `tenant_of(request)` names the
    caller's tenant, or raises the refusal (serve/auth.py's KeyAuth: API keys, rate limits);
    every route but /health asks it. A body over `max_body_bytes` (an upload: over the
    fine-tuning limits' max_file_bytes) is a 413 before it is read (serve/body_limit.py).
    With both the fine-tuning API and a trace store, managed flywheels too
    (serve/flywheel_routes.py): the app polls their triggers every `flywheel_poll_s` and
    their production aliases every quarter of it.

    freeze_gc: at startup (the model is loaded by then), collect once and move every live
    object to the garbage collector's permanent generation (`gc.freeze`). A server process
    holds millions of long-lived objects (torch, transformers, the tokenizer, the app); every
    full collection walks them all, for a tenth of a second or more with the GIL held, and
    ordinary request garbage (a batch of traces makes tens of thousands of containers) sets
    one off. Frozen, they are skipped; what requests allocate is still collected.

    The routes are module-level routers (this module's `generation_routes` and
    `fine_tuned_model_routes`, finetune_routes.py, flywheel_routes.py, ingest.py); what they
    use is on `app.state` (serve/deps.py)."""
    pool = (ingest_pool or IngestPool(0)) if trace_store is not None else None
    managed = aliases = trigger = None
    if fine_tuning is not None and trace_store is not None:
        managed = ManagedFlywheels(fine_tuning, trace_store)
        aliases = ProductionAliases(managed.store, lambda tenant, model: served.get(tenant, model),
                                    poll_s=flywheel_poll_s / 4)
        trigger = FlywheelTrigger(managed.store, trace_store, poll_s=flywheel_poll_s)
    served = ServedModels(service, None if fine_tuning is None else fine_tuning.servable_path, aliases=aliases,
                          default_max_tokens=service.default_max_tokens)
    background = _Background(pool, fine_tuning, [p for p in (aliases, trigger) if p is not None], served,
                             service if close_service_on_shutdown else None, freeze_gc)
    app = FastAPI(title="flywheel", summary="OpenAI-compatible serving with trace capture",
                  lifespan=background.lifespan)
    app.state.service, app.state.served, app.state.tenant_of = service, served, tenant_of
    app.state.fine_tuning, app.state.flywheels = fine_tuning, managed
    app.state.webhooks = None if fine_tuning is None else Webhooks(fine_tuning.jobs.engine)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes,  # an upload: its file plus the multipart framing
                       upload_max_bytes=fine_tuning.max_file_bytes + 2 ** 16 if fine_tuning is not None else None)
    curation = (curation or CurationConfig()) if trace_store is not None else None
    install_openapi(app, curation)
    _install_error_handlers(app)
    if trace_store is not None:
        app.state.intake = TraceIntake(trace_store, pool, getattr(service.trace_sink, "wait_written", None), curation)
        app.include_router(ingest.router)
        app.include_router(otlp_routes.router)  # POST /otlp/v1/traces: OpenTelemetry GenAI spans
    if fine_tuning is not None:
        app.include_router(finetune_routes.router)
        app.include_router(fine_tuned_model_routes)
        app.include_router(dashboard_routes.router)  # /dashboard: docs/dashboard.md
    if managed is not None:
        app.include_router(flywheel_routes.router)
    app.include_router(generation_routes)
    return app


class _Background:
    """What a server runs beside its routes, started and stopped with it: the ingestion pool,
    the fine-tuning core, the managed flywheels' pollers, the loaded fine-tuned models."""

    def __init__(self, pool: IngestPool | None, fine_tuning: FineTuning | None, pollers: list,
                 served: ServedModels, service_to_close: OpenAIService | None, freeze_gc: bool):
        self.pool, self.fine_tuning, self.pollers, self.served = pool, fine_tuning, pollers, served
        self.service_to_close, self.freeze_gc = service_to_close, freeze_gc

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        if self.pool is not None:
            self.pool.start()
        if self.fine_tuning is not None:
            self.fine_tuning.start()
        for poller in self.pollers:
            poller.start()
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        yield
        for poller in reversed(self.pollers):
            poller.close()
        if self.pool is not None:
            self.pool.close()
        if self.fine_tuning is not None:
            self.fine_tuning.close()
        self.served.close()
        if self.service_to_close is not None:
            self.service_to_close.close()


def _install_error_handlers(app: FastAPI) -> None:
    """Every refusal in OpenAI's shape: the core's, FastAPI's parameter checks, unknown routes."""
    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        retry = getattr(exc, "retry_after_s", None)
        return JSONResponse(exc.body(), status_code=exc.status,
                            headers={"retry-after": str(retry)} if retry is not None else None)

    @app.exception_handler(RequestValidationError)
    async def invalid_parameter(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A query or path parameter FastAPI checked (bodies are read raw and checked by the core)."""
        first = exc.errors()[0]
        param = ".".join(str(x) for x in first["loc"][1:]) or None
        err = OpenAIError(f"{param}: {first['msg']}, got {first.get('input')!r}", param=param)
        return JSONResponse(err.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = OpenAIError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code, type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)


# ---------------------------------------------------------------- generation and the model list

generation_routes = APIRouter()


async def model_for(request: Request, tenant: str, body: Any) -> OpenAIService:
    """The service that answers a generation request: the served model, or (with the fine-tuning
    API) one of the tenant's fine-tuned models, loaded on first use."""
    service, fine_tuning = request.app.state.service, request.app.state.fine_tuning
    name = body.get("model") if isinstance(body, dict) else None
    if fine_tuning is None or name == service.name:
        return service  # the served model: no lookup, no thread hop on the serving path
    return await asyncio.to_thread(request.app.state.served.get, tenant, name)


@generation_routes.get("/health", **route_doc(ok="Health", errors={}))
async def health(svc: ServiceDep) -> dict[str, str]:
    """The served model and the version serving now."""
    return {"status": "ok", "model": svc.name, "version": svc.version}


@generation_routes.get("/v1/models", **route_doc(ok="ModelList", errors={}))
async def models(svc: ServiceDep, request: Request, tenant: Tenant) -> JSONResponse:
    """The served model, and with the fine-tuning API the caller's fine-tuned models."""
    listing = svc.models()
    fine_tuning = request.app.state.fine_tuning
    if fine_tuning is not None:
        own = await asyncio.to_thread(fine_tuning.models, tenant)
        listing["data"] += [{**card, "version": card["id"]} for card in own if card["id"] != svc.name]
    return JSONResponse(listing, headers=_headers(svc.version))


@generation_routes.post("/v1/chat/completions", **route_doc(body="ChatCompletionRequest", ok="ChatCompletion",
                                                            stream="ChatCompletionChunk", errors=GENERATION_ERRORS))
async def chat_completions(request: Request, body: BodyDep, tenant: Tenant):
    """OpenAI's chat completions: the model's chat template, tool calls in the Hermes format."""
    return _answer(*await (await model_for(request, tenant, body)).chat(body, tenant))


@generation_routes.post("/v1/completions", **route_doc(body="CompletionRequest", ok="TextCompletion",
                                                       stream="TextCompletionChunk", errors=GENERATION_ERRORS))
async def completions(request: Request, body: BodyDep, tenant: Tenant):
    """OpenAI's legacy completions: raw prompts (texts or token ids), no chat template."""
    return _answer(*await (await model_for(request, tenant, body)).completions(body, tenant))


# ---------------------------------------------------------------- a tenant's fine-tuned models (fine-tuning API)

fine_tuned_model_routes = APIRouter()


@fine_tuned_model_routes.delete("/v1/models/{model:path}", **route_doc(ok="ModelDeleted", errors={
    403: "a base model", 404: "no fine-tuned model of this name for this API key's tenant"}))
async def delete_model(model: str, request: Request, tenant: Tenant, ft: FineTuningDep) -> JSONResponse:
    """Delete one of your fine-tuned models (its job and checkpoints stay)."""
    request.app.state.served.forget(tenant, model)
    await asyncio.to_thread(ft.delete_model, tenant, model)
    return JSONResponse({"id": model, "object": "model", "deleted": True})


@fine_tuned_model_routes.get("/v1/models/{model:path}/content", responses={200: {
    "description": "the model's folder as a tar", "content": {"application/x-tar": {}}}})
async def model_content(model: str, tenant: Tenant, ft: FineTuningDep,
                        format: Literal["adapter", "merged"] = "adapter") -> StreamingResponse:
    """Download one of your fine-tuned models or checkpoints as a tar of its folder: a LoRA
    fine-tune's peft adapter folder, or with `format=merged` its base with the adapter merged
    in (a plain Hugging Face folder); a full fine-tune's Hugging Face folder either way."""
    path = await asyncio.to_thread(ft.jobs.fine_tuned_model_path, tenant, model)
    if path is None:
        raise OpenAIError(f"no fine-tuned model or checkpoint {model!r}", param="model", status=404,
                          type="not_found_error")
    if format == "merged":
        path = await in_passing_thread(whole_model, Path(path))  # a merge's torch work, off the serving thread
    name = model.replace(":", "_").replace("/", "_")
    return StreamingResponse(tar_stream(Path(path), name), media_type="application/x-tar",
                             headers={"content-disposition": f'attachment; filename="{name}.tar"'})


def tar_stream(folder: Path, name: str, chunk: int = 1 << 20):
    """The files of `folder` as a tar stream under `name/`, a chunk at a time: a thread writes
    the tar into a pipe that this generator reads, so a model's weights are never held in
    memory whole; a client that goes away breaks the pipe and ends the thread."""
    read_fd, write_fd = os.pipe()

    def write() -> None:
        try:
            with os.fdopen(write_fd, "wb") as out, tarfile.open(fileobj=out, mode="w|") as tar:
                for path in sorted(p for p in folder.iterdir() if p.is_file()):
                    tar.add(str(path), arcname=f"{name}/{path.name}")
        except (BrokenPipeError, ValueError):
            pass

    writer = threading.Thread(target=write, name="flywheel-tar", daemon=True)
    writer.start()
    with os.fdopen(read_fd, "rb") as source:
        while data := source.read(chunk):
            yield data
    writer.join()
