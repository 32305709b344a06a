"""POST /otlp/v1/traces: an agent's OpenTelemetry GenAI spans, sent over OTLP/HTTP, as traces.

An OTLP exporter pointed at `http://HOST:PORT/otlp` posts here (the spec's `/v1/traces`
under the base URL). Body: an ExportTraceServiceRequest, `application/x-protobuf` or
`application/json` (OTLP/JSON), gzip or deflate allowed. flywheel.traces.otlp turns the GenAI
spans into traces, one per agent run, stored in the caller's tenant exactly as
POST /v1/traces stores them (validated per record, idempotency key
`otlp:<traceId>:<spanId>`: a re-sent export stores nothing new). A run's
`gen_ai.evaluation.result` evaluations (flywheel.traces.otlp_evaluations) are then stored as
feedback on its trace (source "user", keyed by trace, span and event: nothing new on a
re-send); a verifier (`flywheel.verifier.env` / `.task`) is checked as POST
/v1/traces/{id}/feedback checks one, and a run with one curation could not use is refused
before anything of it is stored.

Answers, as the OTLP spec says, in the request's encoding:
200 ExportTraceServiceResponse, with `partialSuccess {rejectedSpans, errorMessage}` when runs
    were refused (content that cannot be read, a record the store refuses: the message names
    each span's path and the reason) or GenAI spans carried no messages (a warning); spans
    without gen_ai attributes are counted (x-flywheel-spans-ignored) and never an error.
    Headers count what happened (x-flywheel-traces-added, -traces-duplicate, -spans-ignored,
    -spans-rejected, -feedback-stored) and list the stored traces' ids (x-flywheel-trace-ids, up to 64 of them),
    the ids their feedback goes to.
400 a body that is not an ExportTraceServiceRequest, naming the field
    (`resourceSpans[0].scopeSpans[1].spans[3].traceId: expected 32 hex characters`); 413 past
    the body limit (also once inflated); 415 another media type or content encoding; 503 the
    store's writers are busy. Errors carry OpenAI's shape, as every route of this server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response

from flywheel.errors import OpenAIError
from flywheel.serve.deps import Tenant
from flywheel.serve.ingest import IntakeDep, TraceIntake
from flywheel.serve.openapi import route_doc
from flywheel.serve.otlp.codec import (
    PROTOBUF,
    BodyTooLarge,
    Unsupported,
    decode_request,
    encode_response,
    inflate,
    media_type,
)
from flywheel.loop.feedback_check import FeedbackRefused, check_feedback
from flywheel.traces import TraceStoreBusy, TraceStoreError
from flywheel.traces.batch import prepare_traces
from flywheel.traces.otlp import Conversion, OtlpMalformed, OtlpTrace, RunError, convert

MAX_INFLATED_BYTES = 64 * 2 ** 20  # app.py's MAX_BODY_BYTES: what a body may hold once inflated
MAX_IDS_HEADER = 64  # stored ids listed in x-flywheel-trace-ids (~2.4 KB); past it the header is left out
MAX_REASONS = 5  # rejected runs named in errorMessage; the rest counted
ORPHAN_HINT = ("evaluations (gen_ai.evaluation.result) with no run in this export: send them with the "
               "spans of the run they evaluate (add the event before the agent span ends)")
NO_CONTENT_HINT = ("GenAI spans that carried no messages: turn content capture on "
                   "(OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true for the Python instrumentations)")


def _otlp_doc() -> dict:
    doc = route_doc(
        body="OtlpExportTraceServiceRequest", ok="OtlpExportTraceServiceResponse",
        body_text="an OTLP ExportTraceServiceRequest: application/json (OTLP/JSON) or application/x-protobuf, "
                  "gzip or deflate allowed; GenAI spans become traces, other spans are counted and ignored",
        errors={400: "the body is not an ExportTraceServiceRequest (the message names the field)",
                413: "the body (once inflated) is over the server's limit",
                415: "not application/json nor application/x-protobuf, or an unsupported Content-Encoding",
                503: "the store's writers are busy: try again"})
    binary = {"schema": {"type": "string", "format": "binary",
                         "description": "the same message in the OTLP protobuf encoding"}}
    doc["openapi_extra"]["requestBody"]["content"][PROTOBUF] = binary
    doc["responses"][200]["content"][PROTOBUF] = binary
    doc["responses"][200]["description"] = "an ExportTraceServiceResponse, in the request's encoding"
    return doc


router = APIRouter()


@dataclass
class Outcome:
    added: int
    duplicates: int
    ignored: int
    rejected_spans: int
    message: str  # errorMessage: reasons, or a warning
    trace_ids: list[str]  # the stored traces' ids (added or already there), in the export's order
    feedback: int = 0  # evaluations stored as feedback (added, or already there)


def export(intake: TraceIntake, body: object, tenant: str) -> Outcome:
    """Convert and store one export for `tenant` (in a worker thread: pure Python, then SQL):
    the runs' traces, then their evaluations as feedback on them."""
    conversion = convert(body)
    errors = list(conversion.errors)
    traces = _usable(conversion, intake, errors)
    batch = prepare_traces([t.record for t in traces], intake.store.default_source)
    result = intake.store.add_prepared(batch, tenant=tenant)
    stored_feedback = 0
    for trace, stored in zip(traces, result.results):
        if stored.status not in ("added", "duplicate"):  # invalid, conflict
            errors.append(RunError(trace.span_paths, f"{trace.last_call}: {stored.reason}"))
            continue
        for where, feedback in trace.feedback:
            try:
                intake.store.add_feedback(stored.id, feedback, tenant=tenant)
                stored_feedback += 1
            except TraceStoreError as e:  # an idempotency key reused with other content
                errors.append(RunError([where.split(".events[")[0]], f"{where}: {e}"))
    rejected = sum(len(e.span_paths) for e in errors)
    notes = []
    if errors:
        reasons = "; ".join(e.message for e in errors[:MAX_REASONS])
        more = f"; and {len(errors) - MAX_REASONS} more" if len(errors) > MAX_REASONS else ""
        notes.append(f"{rejected} of {conversion.spans} spans rejected: {reasons}{more}")
    if conversion.no_content:
        notes.append(f"{conversion.no_content} {NO_CONTENT_HINT}")
    if conversion.orphan_evaluations:
        notes.append(f"{conversion.orphan_evaluations} {ORPHAN_HINT}")
    ids = [r.id for r in result.results if r.id is not None and r.status in ("added", "duplicate")]
    return Outcome(result.added, result.duplicates, conversion.ignored, rejected, ". ".join(notes), ids,
                   stored_feedback)


def _usable(conversion: Conversion, intake: TraceIntake, errors: list[RunError]) -> list[OtlpTrace]:
    """The runs whose evaluations curation can use as sent: a verifier's environment must be
    trusted and its task must carry an answer (loop/feedback_check.py, as POST
    /v1/traces/{id}/feedback checks). A run with one that is not is refused whole, before
    anything is stored. An evaluator's own labels are kept as they are (a score, when there is
    one, is what curation reads)."""
    out = []
    for trace in conversion.traces:
        refused = None
        for where, feedback in trace.feedback:
            try:
                check_feedback({k: v for k, v in feedback.items() if k != "label"}, intake.curation)
            except FeedbackRefused as e:
                refused = f"{where}: flywheel.{e}"  # verifier.env -> the attribute flywheel.verifier.env
                break
        if refused is not None:
            errors.append(RunError(trace.span_paths, refused))
            continue
        out.append(trace)
    return out


@router.post("/otlp/v1/traces", **_otlp_doc())
async def otlp_traces(request: Request, tenant: Tenant, intake: IntakeDep) -> Response:
    """Store an agent's OpenTelemetry GenAI spans (OTLP/HTTP, protobuf or JSON) as traces of
    your tenant, one per agent run; re-sending an export stores nothing new."""
    try:
        kind = media_type(request.headers.get("content-type"))
        raw = inflate(await request.body(), request.headers.get("content-encoding"), MAX_INFLATED_BYTES)
        body = await asyncio.to_thread(decode_request, raw, kind)
        outcome = await asyncio.to_thread(export, intake, body, tenant)
    except Unsupported as e:
        raise OpenAIError(str(e), status=415, param=e.header) from None
    except BodyTooLarge as e:
        raise OpenAIError(str(e), status=413) from None
    except OtlpMalformed as e:
        raise OpenAIError(str(e), param=e.field or "body") from None
    except TraceStoreBusy as e:
        raise OpenAIError(str(e), status=503, type="server_busy") from None
    headers = {"x-flywheel-traces-added": str(outcome.added), "x-flywheel-traces-duplicate": str(outcome.duplicates),
               "x-flywheel-spans-ignored": str(outcome.ignored),
               "x-flywheel-spans-rejected": str(outcome.rejected_spans),
               "x-flywheel-feedback-stored": str(outcome.feedback)}
    if len(outcome.trace_ids) <= MAX_IDS_HEADER:  # where feedback goes (POST /v1/traces/{id}/feedback)
        headers["x-flywheel-trace-ids"] = ",".join(outcome.trace_ids)
    return Response(encode_response(kind, outcome.rejected_spans, outcome.message), media_type=kind,
                    headers=headers)

