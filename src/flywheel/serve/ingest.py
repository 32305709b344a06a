"""Trace ingestion routes: traces from any agent stack, and their outcomes arriving later.

POST /v1/traces                    body: a list of trace records, or {"traces": [...]}
    -> 200 {"added", "duplicates", "rejected", "results": [{"index", "status", "id", "reason"}]}
    Each record is judged alone: the valid ones are stored (committed before the answer) and
    the bad ones come back with their reason; a retry with the same idempotency keys is a no-op.
POST /v1/traces/{trace_id}/feedback body: one feedback record (score, label, correction, text,
    verifier) -> 200 {"id"}; unknown trace 404, invalid feedback or key conflict 400 (so is
    `source: "judge"`: only flywheel's judge writes judge feedback, through the store). The trace
    of a response this server has returned is accepted at once: its feedback waits for the
    trace to be stored (read-your-writes).
The store (flywheel.loop.TraceStore) is synchronous; calls run in a worker thread so the
event loop keeps serving completions meanwhile.

The batch route is the ingestion hot path (batches of hundreds of traces of a few KB): the raw
body goes to an `IngestPool` (serve/ingest_pool.py), which decodes it (orjson) and
validates, encodes and hashes each record on its own (flywheel.traces.batch), in a
worker process or in a thread; a thread then writes the rows and encodes the answer
(orjson), so the event loop only moves bytes. There is no request model: it would validate
the whole batch a second time and refuse it for one bad record.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from dataclasses import dataclass
from typing import Annotated, Any, Callable

import orjson
from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response

from flywheel.loop.curation_rules import CurationConfig
from flywheel.loop.feedback_check import FeedbackRefused, check_feedback
from flywheel.traces import TraceNotFound, TraceStoreBusy, TraceStoreError
from flywheel.traces.batch import NotABatch, PreparedBatch
from flywheel.traces.encoding import NotJSON, decode_json
from flywheel.errors import OpenAIError
from flywheel.serve.ingest_pool import IngestPool, IngestWorkerDied
from flywheel.serve.deps import Tenant
from flywheel.serve.openapi import route_doc


def read_json(raw: bytes) -> Any:
    """A request body as the stdlib would decode it (fast: see `decode_json`), else a 400."""
    try:
        return decode_json(raw)
    except NotJSON as e:
        raise OpenAIError(str(e)) from None


def _json_response(content: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


FEEDBACK_WAIT_S = 10.0  # how long feedback waits for a trace this server answered to be stored

TRACES_DOC = route_doc(
    body="TraceBatch", ok="TraceIngestResult",
    body_text="a list of trace records, or {\"traces\": [...]}; a record that is not a valid TraceIn comes back "
              "as `invalid` with its reason, and the others are stored",
    errors={400: 'the body is not JSON, or neither a list nor {"traces": [...]}', 500: "an ingestion worker died",
            503: "the store's writers are busy: try again"})
FEEDBACK_DOC = route_doc(
    body="FeedbackIn", ok="FeedbackResult",
    body_text="one outcome: at least one of score, label, correction, text, verifier",
    errors={400: "invalid feedback (the message names the field: an unknown label lists the valid ones; source "
                 "\"judge\" is refused), or its idempotency_key already used by other feedback",
            404: "no trace with this id"})
TRACE_ID = ("the trace's id: for a response this server returned, the response's `id` (choice 0) or `<id>-<i>` "
            "(choice i > 0); for a trace sent to POST /v1/traces, the `id` in its result")


@dataclass
class TraceIntake:
    """What the ingestion routes write to (create_app puts one on `app.state.intake`): the trace
    `store`; `pool`, which prepares batch bodies (IngestPool(0): in a thread of the server);
    wait_written(timeout), which waits until the traces of the responses served so far are
    stored (the service's sink), so feedback sent right after its response finds its trace
    (read-your-writes); `curation`, whose rules refuse feedback it could not use (an unknown
    label, an untrusted verifier env, a task without an answer) with a 400 naming the field
    (loop/feedback_check.py). Traces are stored as the caller's tenant's, and feedback goes
    only to the tenant's own traces (another tenant's trace id is a 404)."""

    store: Any
    pool: IngestPool
    wait_written: Callable[[float], bool] | None
    curation: CurationConfig

    def write(self, batch: PreparedBatch, tenant: str) -> Response:
        try:
            result = self.store.add_prepared(batch, tenant=tenant)
        except TraceStoreBusy as e:
            raise OpenAIError(str(e), status=503, type="server_busy") from None
        rows = [{"index": r.index, "status": r.status, "id": r.id, "reason": r.reason} for r in result.results]
        return _json_response({"added": result.added, "duplicates": result.duplicates,
                               "rejected": len(result.rejected), "results": rows})

    def add_feedback(self, trace_id: str, body: dict, tenant: str) -> str:
        try:
            return self.store.add_feedback(trace_id, body, tenant=tenant)
        except TraceNotFound:
            if self.wait_written is None or not self.wait_written(FEEDBACK_WAIT_S):
                raise
            return self.store.add_feedback(trace_id, body, tenant=tenant)  # its response's trace may be stored now


def intake_of_app(request: Request) -> TraceIntake:
    return request.app.state.intake


IntakeDep = Annotated[TraceIntake, Depends(intake_of_app)]
router = APIRouter()


@router.post("/v1/traces", **TRACES_DOC)
async def add_traces(request: Request, tenant: Tenant, intake: IntakeDep) -> Response:
    """Store traces from any agent stack, each record judged alone; a retry with the same
    idempotency keys (or ids) is a no-op."""
    raw = await request.body()
    try:
        batch = await intake.pool.prepare(raw, intake.store.default_source, datetime.now(timezone.utc))
    except NotJSON as e:
        raise OpenAIError(str(e)) from None
    except NotABatch as e:
        raise OpenAIError(str(e), param="traces") from None
    except IngestWorkerDied as e:
        raise OpenAIError(str(e), status=500, type="server_error") from None
    return await asyncio.to_thread(intake.write, batch, tenant)


@router.post("/v1/traces/{trace_id}/feedback", **FEEDBACK_DOC)
async def add_feedback(trace_id: Annotated[str, Path(description=TRACE_ID)], request: Request, tenant: Tenant,
                       intake: IntakeDep) -> JSONResponse:
    """Report how a trace went, at any time after it (a trace may get many). Curation reads
    the newest: a failed trace (a low score, a failure label) with a verifier becomes an RL
    task its environment replays and grades; a correction becomes an SFT example. Feedback
    for a response this server just returned waits for its trace to be stored."""
    body = read_json(await request.body())
    if not isinstance(body, dict):
        raise OpenAIError("expected a JSON object with the feedback", param="body")
    if body.get("source") == "judge":  # the judge writes through the store, never over HTTP
        raise OpenAIError("source: 'judge' is written only by flywheel's judge (flywheel traces judge); a client's "
                          "feedback is source 'user'", param="source")
    try:
        check_feedback(body, intake.curation)
    except FeedbackRefused as e:
        raise OpenAIError(str(e), param=e.field) from None
    try:
        feedback_id = await asyncio.to_thread(intake.add_feedback, trace_id, body, tenant)
    except TraceNotFound as e:
        raise OpenAIError(str(e), status=404, type="not_found_error", param="trace_id") from None
    except TraceStoreError as e:
        raise OpenAIError(str(e), param="body") from None
    return JSONResponse({"id": feedback_id})
