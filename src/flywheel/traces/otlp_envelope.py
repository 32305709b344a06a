"""The OTLP/JSON envelope of a trace export, read into `Span`s (see otlp.py): the
resource / scope / span nesting, ids as hex, 64-bit integers as numbers or decimal strings,
attribute AnyValues decoded to Python. A fault raises `OtlpMalformed` naming its field path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_HEX32, _HEX16 = re.compile(r"[0-9a-fA-F]{32}"), re.compile(r"[0-9a-fA-F]{16}")
_INT = re.compile(r"-?[0-9]+")
_ANY_KEYS = ("stringValue", "boolValue", "intValue", "doubleValue", "arrayValue", "kvlistValue", "bytesValue")
_UINT64, _INT64 = 2 ** 64 - 1, 2 ** 63


class OtlpMalformed(ValueError):
    """A request that is not an ExportTraceServiceRequest; `field` is the path of the fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


@dataclass(frozen=True)
class Span:
    path: str  # where it was in the request: resourceSpans[i].scopeSpans[j].spans[k]
    order: int  # its position in the request
    trace_id: str  # 32 lowercase hex
    span_id: str  # 16 lowercase hex
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]  # AnyValues decoded: kvlist -> dict, array -> list
    events: list[tuple[str, dict[str, Any]]]  # (name, attributes) in order
    service: str  # the resource's service.name
    scope: str  # the instrumentation scope's name
    event_times: tuple[int, ...] = ()  # each event's timeUnixNano (0 when unset), as `events`

    @property
    def genai(self) -> bool:
        return any(k.startswith("gen_ai.") for k in self.attributes) or any(
            name.startswith("gen_ai.") for name, _ in self.events)

    @property
    def evaluation(self) -> bool:
        """A span that is itself a `gen_ai.evaluation.result` (emitters that cannot add an
        event write a zero-length span with the event's attributes under the evaluated span)."""
        return "gen_ai.evaluation.name" in self.attributes and self.operation is None

    @property
    def operation(self) -> str | None:
        op = self.attributes.get("gen_ai.operation.name")
        return op if isinstance(op, str) else None


def parse_request(body: Any) -> list[Span]:
    if not isinstance(body, dict):
        raise OtlpMalformed("", "expected a JSON object (an ExportTraceServiceRequest)")
    spans: list[Span] = []
    for i, rs in enumerate(_list(body, "resourceSpans", "")):
        where = f"resourceSpans[{i}]"
        _object(rs, where)
        resource = rs.get("resource") or {}
        _object(resource, f"{where}.resource")
        service = attributes(resource.get("attributes"), f"{where}.resource.attributes").get("service.name")
        service = service if isinstance(service, str) and service else "unknown_service"
        for j, ss in enumerate(_list(rs, "scopeSpans", where)):
            at = f"{where}.scopeSpans[{j}]"
            _object(ss, at)
            scope = ss.get("scope") or {}
            _object(scope, f"{at}.scope")
            scope_name = scope.get("name") if isinstance(scope.get("name"), str) else ""
            for k, raw in enumerate(_list(ss, "spans", at)):
                spans.append(_span(raw, f"{at}.spans[{k}]", len(spans), service, scope_name))
    return spans


def _span(raw: Any, where: str, order: int, service: str, scope: str) -> Span:
    _object(raw, where)
    parent = raw.get("parentSpanId") or None
    events, times = [], []
    for e, event in enumerate(_list(raw, "events", where)):
        _object(event, f"{where}.events[{e}]")
        name = event.get("name", "")
        if not isinstance(name, str):
            raise OtlpMalformed(f"{where}.events[{e}].name", "expected a string")
        events.append((name, attributes(event.get("attributes"), f"{where}.events[{e}].attributes")))
        times.append(_uint64(event.get("timeUnixNano", 0), f"{where}.events[{e}].timeUnixNano"))
    name = raw.get("name", "")
    if not isinstance(name, str):
        raise OtlpMalformed(f"{where}.name", "expected a string")
    return Span(
        path=where, order=order, trace_id=_hex_id(raw.get("traceId"), _HEX32, f"{where}.traceId", 32),
        span_id=_hex_id(raw.get("spanId"), _HEX16, f"{where}.spanId", 16),
        parent_id=None if parent is None else _hex_id(parent, _HEX16, f"{where}.parentSpanId", 16),
        name=name, start_ns=_uint64(raw.get("startTimeUnixNano", 0), f"{where}.startTimeUnixNano"),
        end_ns=_uint64(raw.get("endTimeUnixNano", 0), f"{where}.endTimeUnixNano"),
        attributes=attributes(raw.get("attributes"), f"{where}.attributes"), events=events,
        service=service, scope=scope, event_times=tuple(times))


def _object(value: Any, where: str) -> None:
    if not isinstance(value, dict):
        raise OtlpMalformed(where, f"expected a JSON object, got {_kind(value)}")


def _list(obj: dict, key: str, where: str) -> list:
    value = obj.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise OtlpMalformed(f"{where}.{key}" if where else key, f"expected a JSON array, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


def _hex_id(value: Any, pattern: re.Pattern, where: str, n: int) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise OtlpMalformed(where, f"expected {n} hex characters, got {value!r}"[:200])
    if not value.strip("0"):
        raise OtlpMalformed(where, "an all-zero id is invalid")
    return value.lower()


def _uint64(value: Any, where: str) -> int:
    if isinstance(value, str) and _INT.fullmatch(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _UINT64:
        raise OtlpMalformed(where, f"expected an unsigned 64-bit integer (a number or a decimal string), got {value!r}")
    return value


def attributes(value: Any, where: str) -> dict[str, Any]:
    """A list of KeyValue as {key: decoded value}."""
    if value is None:
        return {}
    if not isinstance(value, list):
        raise OtlpMalformed(where, f"expected a JSON array of {{key, value}}, got {_kind(value)}")
    out: dict[str, Any] = {}
    for i, kv in enumerate(value):
        _object(kv, f"{where}[{i}]")
        key = kv.get("key")
        if not isinstance(key, str):
            raise OtlpMalformed(f"{where}[{i}].key", "required, a string")
        out[key] = any_value(kv.get("value"), f"{where}[{i}].value")
    return out


def any_value(value: Any, where: str) -> Any:
    """An OTLP AnyValue as Python: str, bool, int, float, list, dict, base64 text for bytes; {} -> None."""
    if value is None or value == {}:
        return None
    _object(value, where)
    keys = [k for k in _ANY_KEYS if k in value]
    if len(keys) != 1:
        raise OtlpMalformed(where, f"expected exactly one of {', '.join(_ANY_KEYS)}")
    key = keys[0]
    v, at = value[key], f"{where}.{key}"
    if key in ("stringValue", "bytesValue"):
        if not isinstance(v, str):
            raise OtlpMalformed(at, "expected a string")
        return v
    if key == "boolValue":
        if not isinstance(v, bool):
            raise OtlpMalformed(at, "expected true or false")
        return v
    if key == "intValue":
        if isinstance(v, str) and _INT.fullmatch(v):
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not -_INT64 <= v < _INT64:
            raise OtlpMalformed(at, f"expected a 64-bit integer (a number or a decimal string), got {v!r}")
        return v
    if key == "doubleValue":
        if isinstance(v, str) and v in ("NaN", "Infinity", "-Infinity"):
            return float(v.lower().replace("infinity", "inf"))
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise OtlpMalformed(at, f"expected a number, got {v!r}")
        return float(v)
    _object(v, at)
    if key == "arrayValue":
        return [any_value(x, f"{at}.values[{i}]") for i, x in enumerate(_list(v, "values", at))]
    return attributes(v.get("values"), f"{at}.values")  # kvlistValue
