"""OTLP/HTTP bodies in and out: the two encodings the OTLP spec defines for a trace export.

A request is `application/x-protobuf` (an ExportTraceServiceRequest, decoded with the
`opentelemetry-proto` classes) or `application/json` (the OTLP/JSON mapping), either possibly
`Content-Encoding: gzip` (the OTel collector's otlphttp exporter compresses by default).
`decode_request` gives the OTLP/JSON dict that flywheel.traces.otlp reads: a protobuf body
goes through `MessageToDict` (lowerCamelCase keys, 64-bit integers as decimal strings, enums
as integers) with its trace and span ids turned from base64 into hex, as OTLP/JSON writes
them. The answer, an ExportTraceServiceResponse, goes back in the request's encoding.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import orjson

from flywheel.traces.encoding import NotJSON, decode_json
from flywheel.traces.otlp import OtlpMalformed

PROTOBUF, JSON = "application/x-protobuf", "application/json"
_MISSING_PROTO = ("decoding application/x-protobuf needs the opentelemetry-proto package: "
                  "pip install 'flywheel[serve]' (or send application/json)")


class Unsupported(ValueError):
    """A body this endpoint cannot read at all (415): its media type or content encoding;
    `header` names the request header at fault."""

    def __init__(self, message: str, header: str = "content-type"):
        super().__init__(message)
        self.header = header


def media_type(content_type: str | None) -> str:
    """PROTOBUF or JSON from a Content-Type header (parameters such as charset ignored)."""
    kind = (content_type or "").split(";", 1)[0].strip().lower()
    if kind in (PROTOBUF, JSON):
        return kind
    raise Unsupported(f"Content-Type {content_type!r} is not an OTLP/HTTP encoding: send {PROTOBUF} or {JSON}")


def inflate(raw: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body with its Content-Encoding (gzip, deflate or none) undone, at most `max_bytes`."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        return raw
    if encoding not in ("gzip", "deflate"):
        raise Unsupported(f"Content-Encoding {content_encoding!r} is not supported: send gzip, deflate or none",
                          header="content-encoding")
    inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
    try:
        out = inflater.decompress(raw, max_bytes + 1)
    except zlib.error as e:
        raise OtlpMalformed("", f"the body is not valid {encoding} ({e})") from None
    if len(out) > max_bytes:
        raise BodyTooLarge(f"the body inflates to more than {max_bytes} bytes")
    return out


class BodyTooLarge(ValueError):
    """A compressed body that inflates past the server's limit (413)."""


def decode_request(raw: bytes, kind: str) -> Any:
    """The OTLP/JSON form of a request body; OtlpMalformed when it cannot be decoded."""
    if kind == JSON:
        try:
            return decode_json(raw)
        except NotJSON as e:
            raise OtlpMalformed("", str(e)) from None
    try:
        from google.protobuf.json_format import MessageToDict
        from google.protobuf.message import DecodeError
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
    except ImportError:
        raise Unsupported(_MISSING_PROTO) from None
    message = ExportTraceServiceRequest()
    try:
        message.ParseFromString(raw)
    except DecodeError as e:
        raise OtlpMalformed("", f"the body is not a protobuf ExportTraceServiceRequest ({e})") from None
    body = MessageToDict(message, use_integers_for_enums=True)
    for rs in body.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:  # bytes: base64 in the protobuf JSON mapping, hex in OTLP/JSON
                        span[key] = base64.b64decode(span[key]).hex()
    return body


def encode_response(kind: str, rejected_spans: int, error_message: str) -> bytes:
    """An ExportTraceServiceResponse: `partialSuccess` only when spans were rejected or there is
    something to warn of (the spec's rule: a full success leaves it unset)."""
    partial = rejected_spans > 0 or bool(error_message)
    if kind == JSON:
        body = {"partialSuccess": {"rejectedSpans": rejected_spans, "errorMessage": error_message}} if partial else {}
        return orjson.dumps(body)
    try:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTracePartialSuccess,
            ExportTraceServiceResponse,
        )
    except ImportError:
        raise Unsupported(_MISSING_PROTO) from None
    response = ExportTraceServiceResponse()
    if partial:
        response.partial_success.CopyFrom(ExportTracePartialSuccess(rejected_spans=rejected_spans,
                                                                    error_message=error_message))
    return response.SerializeToString()
