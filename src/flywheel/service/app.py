"""The FastAPI face of `OpenAIService`: routes decode JSON, call the core, encode the answer.

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health, and
with a trace store POST /v1/traces and POST /v1/traces/{id}/feedback (service/ingest.py).
Every error, including unknown routes and bodies that are not JSON, has OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`. A streamed request is answered with
server-sent events (`data: {chunk}` lines ending with `data: [DONE]`) once its batch has
finished (see flywheel.service.responses for why); a refused request gets a plain JSON error
before any event.
"""

from __future__ import annotations

import gc
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from flywheel.service import responses as R
from flywheel.service.core import OpenAIService
from flywheel.service.errors import OpenAIError
from flywheel.service.ingest import decode_json


def get_service(request: Request) -> OpenAIService:
    return request.app.state.service


ServiceDep = Annotated[OpenAIService, Depends(get_service)]


async def json_body(request: Request) -> Any:
    return decode_json(await request.body())


BodyDep = Annotated[Any, Depends(json_body)]


def _headers(version: str) -> dict[str, str]:
    return {"x-flywheel-model-version": version}


def create_app(service: OpenAIService, *, close_service_on_shutdown: bool = False, trace_store=None,
               freeze_gc: bool = True) -> FastAPI:
    """`trace_store` (a flywheel.loop.TraceStore) enables POST /v1/traces and feedback
    (flywheel.service.ingest).

    freeze_gc: at startup (the model is loaded by then), collect once and move every live
    object to the garbage collector's permanent generation (`gc.freeze`). A server process
    holds millions of long-lived objects (torch, transformers, the tokenizer, the app); every
    full collection walked them all, ~150 ms during which the GIL is held, triggered by
    ordinary request garbage (a batch of 500 traces allocates ~30,000 containers). Frozen,
    they are skipped; what requests allocate is still collected."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if freeze_gc:
            gc.collect()
            gc.freeze()
        yield
        if close_service_on_shutdown:
            service.close()

    app = FastAPI(title="flywheel", summary="OpenAI-compatible serving with trace capture", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        err = OpenAIError(f"{request.method} {request.url.path}: {exc.detail}", status=exc.status_code, type=kind)
        return JSONResponse(err.body(), status_code=exc.status_code)

    if trace_store is not None:
        from flywheel.service.ingest import ingest_router

        app.include_router(ingest_router(trace_store))

    @app.get("/health")
    async def health(svc: ServiceDep) -> dict[str, str]:
        return {"status": "ok", "model": svc.name, "version": svc.version}

    @app.get("/v1/models")
    async def models(svc: ServiceDep) -> JSONResponse:
        return JSONResponse(svc.models(), headers=_headers(svc.version))

    @app.post("/v1/chat/completions")
    async def chat_completions(svc: ServiceDep, body: BodyDep):
        response, req = await svc.chat(body)
        headers = _headers(response["system_fingerprint"])
        if req.stream:
            events = R.sse(R.chat_chunks(response, include_usage=req.include_usage))
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(response, headers=headers)

    @app.post("/v1/completions")
    async def completions(svc: ServiceDep, body: BodyDep):
        response, req = await svc.completions(body)
        headers = _headers(response["system_fingerprint"])
        if req.stream:
            events = R.sse(R.completion_chunks(response, include_usage=req.include_usage))
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        return JSONResponse(response, headers=headers)

    return app
