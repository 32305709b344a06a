"""Trace ingestion routes: traces from any agent stack, and their outcomes arriving later.

POST /v1/traces                    body: a list of trace records, or {"traces": [...]}
    -> 200 {"added", "duplicates", "rejected", "results": [{"index", "status", "id", "reason"}]}
    Each record is judged alone: the valid ones are stored (committed before the answer) and
    the bad ones come back with their reason; a retry with the same idempotency keys is a no-op.
POST /v1/traces/{trace_id}/feedback body: one feedback record (score, label, correction, text,
    verifier) -> 200 {"id"}; unknown trace 404, invalid feedback or key conflict 400.
The store (flywheel.loop.TraceStore) is synchronous; calls run in a worker thread so the
event loop keeps serving completions meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from flywheel.service.errors import OpenAIError


def ingest_router(store) -> APIRouter:
    from flywheel.loop import TraceNotFound, TraceStoreError

    router = APIRouter()

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise OpenAIError(f"the request body is not valid JSON ({e})") from None

    @router.post("/v1/traces")
    async def add_traces(request: Request) -> JSONResponse:
        body = await body_of(request)
        records = body.get("traces") if isinstance(body, dict) else body
        if not isinstance(records, list):
            raise OpenAIError("expected a JSON list of traces or {\"traces\": [...]}", param="traces")
        result = await asyncio.to_thread(store.add_traces, records)
        rows = [{"index": r.index, "status": r.status, "id": r.id, "reason": r.reason} for r in result.results]
        return JSONResponse({"added": result.added, "duplicates": result.duplicates,
                             "rejected": len(result.rejected), "results": rows})

    @router.post("/v1/traces/{trace_id}/feedback")
    async def add_feedback(trace_id: str, request: Request) -> JSONResponse:
        body = await body_of(request)
        if not isinstance(body, dict):
            raise OpenAIError("expected a JSON object with the feedback", param="body")
        try:
            feedback_id = await asyncio.to_thread(store.add_feedback, trace_id, body)
        except TraceNotFound as e:
            raise OpenAIError(str(e), status=404, type="not_found_error", param="trace_id") from None
        except TraceStoreError as e:
            raise OpenAIError(str(e), param="body") from None
        return JSONResponse({"id": feedback_id})

    return router
