"""The OpenAPI description of POST /otlp/v1/traces: OTLP/JSON's ExportTraceServiceRequest and
ExportTraceServiceResponse, as far as flywheel reads them (flywheel.traces.otlp is what
checks a body; these shapes only describe it). Keys the OTLP spec may add are allowed, as a
receiver must ignore unknown fields. serve/openapi.py lists `COMPONENTS`."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, with_config
from typing_extensions import NotRequired, TypedDict

_OPEN = ConfigDict(extra="allow")
U64 = Annotated[int | Annotated[str, Field(pattern=r"^[0-9]+$")], Field(
    description="nanoseconds since the Unix epoch: a number or a decimal string (64 bits)")]
TraceId = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{32}$", description="16 bytes as 32 hex characters")]
SpanId = Annotated[str, Field(pattern=r"^[0-9a-fA-F]{16}$", description="8 bytes as 16 hex characters")]
AnyValue = Annotated[dict[str, Any], Field(description=(
    "exactly one of stringValue, boolValue, intValue (a number or a decimal string), doubleValue, "
    "arrayValue {values: [AnyValue]}, kvlistValue {values: [KeyValue]}, bytesValue (base64); {} is empty"))]


@with_config(_OPEN)
class OtlpKeyValue(TypedDict):
    key: str
    value: NotRequired[AnyValue]


@with_config(_OPEN)
class OtlpSpanEvent(TypedDict):
    """An event; the older GenAI conventions' message events (gen_ai.user.message, gen_ai.choice, ...)."""

    name: NotRequired[str]
    timeUnixNano: NotRequired[U64]
    attributes: NotRequired[list[OtlpKeyValue]]


@with_config(_OPEN)
class OtlpSpan(TypedDict):
    """One span. A span with an attribute or event named gen_ai.* is read as a chat call, an agent
    run, a tool execution or an evaluation (gen_ai.evaluation.result, as an event or a span: its
    trace's feedback); other spans are counted and ignored."""

    traceId: TraceId
    spanId: SpanId
    parentSpanId: NotRequired[Annotated[str, Field(pattern=r"^([0-9a-fA-F]{16})?$")]]
    name: NotRequired[str]
    kind: NotRequired[int]
    startTimeUnixNano: NotRequired[U64]
    endTimeUnixNano: NotRequired[U64]
    attributes: NotRequired[list[OtlpKeyValue]]
    events: NotRequired[list[OtlpSpanEvent]]


@with_config(_OPEN)
class OtlpScope(TypedDict):
    name: NotRequired[str]
    version: NotRequired[str]


@with_config(_OPEN)
class OtlpScopeSpans(TypedDict):
    scope: NotRequired[OtlpScope]
    spans: NotRequired[list[OtlpSpan]]


@with_config(_OPEN)
class OtlpResource(TypedDict):
    attributes: NotRequired[Annotated[list[OtlpKeyValue], Field(
        description="service.name names the trace's source: otlp:<service.name>")]]


@with_config(_OPEN)
class OtlpResourceSpans(TypedDict):
    resource: NotRequired[OtlpResource]
    scopeSpans: NotRequired[list[OtlpScopeSpans]]


@with_config(_OPEN)
class OtlpExportTraceServiceRequest(TypedDict):
    """OTLP/JSON: lowerCamelCase keys, ids as hex, 64-bit integers as numbers or decimal strings."""

    resourceSpans: NotRequired[list[OtlpResourceSpans]]


class OtlpPartialSuccess(TypedDict):
    rejectedSpans: Annotated[int, Field(ge=0, description="spans of runs that could not be stored")]
    errorMessage: Annotated[str, Field(description=(
        "why: each rejected run's span path and reason; or, with rejectedSpans 0, a warning (GenAI spans "
        "that carried no messages: is content capture on?)"))]


class OtlpExportTraceServiceResponse(TypedDict):
    """The OTLP answer; `partialSuccess` only when spans were rejected or something is worth a warning.
    Headers: x-flywheel-traces-added, x-flywheel-traces-duplicate, x-flywheel-spans-ignored,
    x-flywheel-spans-rejected, x-flywheel-feedback-stored (gen_ai.evaluation.result evaluations stored as the traces'
    feedback), x-flywheel-trace-ids (the stored traces' ids, comma-separated, up to 64: feedback goes to
    POST /v1/traces/{id}/feedback)."""

    partialSuccess: NotRequired[OtlpPartialSuccess]


COMPONENTS = {name: (t, mode) for name, t, mode in (
    ("OtlpExportTraceServiceRequest", OtlpExportTraceServiceRequest, "validation"),
    ("OtlpExportTraceServiceResponse", OtlpExportTraceServiceResponse, "serialization"))}
