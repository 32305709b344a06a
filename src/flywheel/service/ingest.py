"""Trace ingestion routes: traces from any agent stack, and their outcomes arriving later.

POST /v1/traces                    body: a list of trace records, or {"traces": [...]}
    -> 200 {"added", "duplicates", "rejected", "results": [{"index", "status", "id", "reason"}]}
    Each record is judged alone: the valid ones are stored (committed before the answer) and
    the bad ones come back with their reason; a retry with the same idempotency keys is a no-op.
POST /v1/traces/{trace_id}/feedback body: one feedback record (score, label, correction, text,
    verifier) -> 200 {"id"}; unknown trace 404, invalid feedback or key conflict 400.
The store (flywheel.loop.TraceStore) is synchronous; calls run in a worker thread so the
event loop keeps serving completions meanwhile.

The batch route is the ingestion hot path (batches of hundreds of ~2 KB traces): the raw
body is handed to the worker thread, which decodes it (orjson), stores the records and
encodes the answer (orjson), so the event loop only moves bytes. The records go to the store
as decoded dicts: each is validated there once, on its own (no request model that would
validate the whole batch a second time and refuse it for one bad record).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from flywheel.service.errors import OpenAIError


def decode_json(raw: bytes) -> Any:
    """The request body as JSON: orjson, and the stdlib's decoder for what orjson refuses or
    would change (NaN and infinities, lone surrogates, integers beyond 64 bits, which orjson
    turns into floats), so every body decodes to what `json.loads` gives and each record is
    then judged on what it really holds. Raises OpenAIError if the body is not JSON."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = _stdlib_loads(raw)
    else:
        if _may_hold_big_ints(raw):
            value = _stdlib_loads(raw)
    return value


def _stdlib_loads(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise OpenAIError(f"the request body is not valid JSON ({e})") from None


_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))


def _may_hold_big_ints(raw: bytes) -> bool:
    """True if the body has a run of 20 digits (in a string or not): the only way to write an
    integer beyond 64 bits (2**64 has 20 digits), which orjson would read as a float. A
    translate and a find: ~0.5 ms a MB, where a regex takes ~10 ms."""
    return raw.translate(_DIGITS_ONLY).find(b"0" * 20) >= 0


def _json_response(content: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


def ingest_router(store) -> APIRouter:
    from flywheel.loop import TraceNotFound, TraceStoreError

    router = APIRouter()

    def ingest(raw: bytes) -> Response:
        body = decode_json(raw)
        records = body.get("traces") if isinstance(body, dict) else body
        if not isinstance(records, list):
            raise OpenAIError("expected a JSON list of traces or {\"traces\": [...]}", param="traces")
        result = store.add_traces(records)
        rows = [{"index": r.index, "status": r.status, "id": r.id, "reason": r.reason} for r in result.results]
        return _json_response({"added": result.added, "duplicates": result.duplicates,
                               "rejected": len(result.rejected), "results": rows})

    @router.post("/v1/traces")
    async def add_traces(request: Request) -> Response:
        return await asyncio.to_thread(ingest, await request.body())

    @router.post("/v1/traces/{trace_id}/feedback")
    async def add_feedback(trace_id: str, request: Request) -> JSONResponse:
        body = decode_json(await request.body())
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
