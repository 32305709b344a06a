"""How an incoming record becomes a row: validation, canonical JSON, the content hash.

A record is stored as sent: its JSON fields are serialised once, as canonical JSON (sorted
keys, compact), and those texts are both what the JSON columns hold (passed through the
driver untouched, see `Encoded`) and what the content hash covers. The models only
validate (they are strict where lax coercion would store something other than what was
checked); they are not dumped again, which would cost as much as the validation.

Agent traffic repeats the same `tools` list on every trace. A tools list whose canonical
text validated before is not validated again (a small cache of texts).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from datetime import datetime
from typing import Any

import orjson
from pydantic import BaseModel
from pydantic_core import PydanticSerializationError

from flywheel.canonical import canonical
from flywheel.clock import utc_naive, utc_now
from flywheel.database import Encoded
from flywheel.traces.schema import TRACE_IN, FeedbackIn

_KNOWN_TOOLS: dict[str, None] = {}  # canonical JSON of tools lists that validated
_KNOWN_TOOLS_MAX = 1024


class NotJSON(ValueError):
    pass


def decode_json(raw: bytes) -> Any:
    """The request body as JSON: orjson, and the stdlib's decoder for what orjson refuses or
    would change (NaN and infinities, lone surrogates, integers beyond 64 bits, which orjson
    turns into floats), so every body decodes to what `json.loads` gives and each record is
    then judged on what it really holds. Raises NotJSON if the body is not JSON."""
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
        raise NotJSON(f"the request body is not valid JSON ({e})") from None
    except RecursionError:  # orjson stops at depth 1,024 and hands such a body over
        raise NotJSON("the request body is nested too deeply to decode (more than ~1,000 levels)") from None


_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))


def _may_hold_big_ints(raw: bytes) -> bool:
    """True if the body has a run of 20 digits (in a string or not): the only way to write an
    integer beyond 64 bits (2**64 has 20 digits), which orjson would read as a float. A
    translate and a find, an order of magnitude faster than a regex."""
    return raw.translate(_DIGITS_ONLY).find(b"0" * 20) >= 0


def dump(model: BaseModel) -> dict[str, Any]:
    """A Python caller's model instance as the JSON it stands for (unset fields left out)."""
    try:
        return model.model_dump(mode="json", exclude_unset=True)
    except PydanticSerializationError:
        for name in model.model_fields_set:  # name the field (only on this failure path)
            try:
                model.model_dump(mode="json", include={name})
            except PydanticSerializationError as e:
                raise NotJSON(f"{name}: not JSON ({e})") from None
        raise


def encode_fields(sent: dict[str, Any]) -> dict[str, str]:
    """The object and array fields of a record, as canonical JSON texts."""
    encoded: dict[str, str] = {}
    for name, value in sent.items():
        if isinstance(value, (dict, list)):
            try:
                encoded[name] = canonical(value)
            except TypeError as e:  # orjson.JSONEncodeError
                raise NotJSON(f"{name}: not JSON ({e})") from None
    return encoded


def digest(sent: dict[str, Any], encoded: dict[str, str], created_at: datetime | None) -> str:
    """SHA-256 of a record's content: every field but the idempotency key, created_at as its UTC value.

    The hashed text is `canonical(scalars)`, then one `name=<canonical JSON>` line per JSON
    field in name order (stored hashes depend on it: it must never change)."""
    return _digest(sent, encoded, None if created_at is None else utc_naive(created_at))


def _digest(sent: dict[str, Any], encoded: dict[str, str], created_utc: datetime | None) -> str:
    # runs once per ingested trace: the pieces are fed to the hash one by one, never joined
    scalars = {name: value for name, value in sent.items() if name not in encoded and name != "idempotency_key"}
    if created_utc is not None:
        scalars["created_at"] = created_utc.isoformat()
    try:
        h = hashlib.sha256(canonical(scalars).encode())
    except TypeError as e:
        raise NotJSON(f"not JSON ({e})") from None
    for name in sorted(encoded):
        h.update(_LINE_HEADS.get(name) or f"\n{name}=".encode())
        h.update(encoded[name].encode())
    return h.hexdigest()


JSON_COLUMNS = ("messages", "tools", "response", "usage", "metadata")  # a trace's JSON fields (and row columns)
_LINE_HEADS = {name: f"\n{name}=".encode() for name in JSON_COLUMNS}


def new_trace_ids(count: int) -> list[str]:
    """`count` UUIDs version 7 (RFC 9562): 48 bits of Unix time in milliseconds, then 74 random bits.

    Time-ordered, so a batch's new ids land together at the end of the unique index on
    `id`. Random (version 4) ids scatter every insert over the whole index, so once the index
    outgrows SQLite's page cache a batch rewrites a page per trace. One clock reading and one
    read of the OS's random source serve the whole batch."""
    if count < 1:
        return []
    stamp = f"{time.time_ns() // 1_000_000 & 0xFFFFFFFFFFFF:012x}"
    head = f"{stamp[:8]}-{stamp[8:12]}-7"
    noise = os.urandom(10 * count).hex()
    ids = []
    for start in range(0, 20 * count, 20):
        r = noise[start:start + 20]
        ids.append(f"{head}{r[1:4]}-{_VARIANT[int(r[4], 16) & 3]}{r[5:8]}-{r[8:20]}")
    return ids


_VARIANT = "89ab"  # the RFC 4122 / 9562 variant: the two top bits of the 17th hex digit are 10


def validate_trace(record: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(the record as validated, canonical JSON of its object and array fields); raises
    ValidationError or NotJSON. The stored texts are those of the record as sent."""
    if not isinstance(record, dict):
        return TRACE_IN.validate_python(record), {}  # raises: not an object
    encoded = encode_fields(record)
    tools = encoded.get("tools")
    if tools is not None and tools in _KNOWN_TOOLS:
        trace = TRACE_IN.validate_python({k: v for k, v in record.items() if k != "tools"})
    else:
        trace = TRACE_IN.validate_python(record)
        if tools is not None:
            if len(_KNOWN_TOOLS) >= _KNOWN_TOOLS_MAX:
                _KNOWN_TOOLS.clear()
            _KNOWN_TOOLS[tools] = None
    return trace, encoded


# A prepared `traces` row is a tuple in this order (the table's, less its `seq`): cheaper to
# pickle back from an ingestion worker than a dict, and the order of the SQLite INSERT.
TRACE_COLUMNS = ("id", "idempotency_key", "content_hash", "created_at", "source", "model", "model_version",
                 "messages", "tools", "response", "usage", "prompt_tokens", "completion_tokens", "latency_ms",
                 "metadata")
ID, KEY, HASH = 0, 1, 2  # positions in a row


def trace_row(trace: dict[str, Any], sent: dict[str, Any], encoded: dict[str, str],
              source: str, now: datetime, new_id: str | None) -> tuple:
    """The `traces` row (values in TRACE_COLUMNS order) of a record: `trace` as validated,
    `sent` as it came. Its JSON columns hold canonical JSON text, which the writers store as
    it is (absent or null: SQL NULL). new_id: the id (from `new_trace_ids`) if the record names none."""
    get = trace.get
    trace_id = get("id") or new_id
    usage = get("usage")
    created = get("created_at")
    if created is not None:
        created = utc_naive(created)
    text = encoded.get
    return (trace_id, get("idempotency_key") or trace_id, _digest(sent, encoded, created),
            now if created is None else created, get("source") or source, get("model"), get("model_version"),
            text("messages") or _prompt_text(get("prompt")), text("tools"), text("response"), text("usage"),
            usage["prompt_tokens"] if usage else None, usage["completion_tokens"] if usage else None,
            get("latency_ms"), text("metadata"))


def _prompt_text(prompt: str | None) -> str | None:
    """A raw-completion trace's prompt as the `messages` column holds it: a JSON string
    (a chat trace's column holds its message list; `_stored_trace` tells them apart)."""
    return None if prompt is None else canonical(prompt)


def feedback_row(trace_id: str, feedback: FeedbackIn | dict[str, Any],
                 tenant: str) -> tuple[FeedbackIn, dict[str, Any]]:
    """(model, `trace_feedback` row) of one feedback record of `tenant`'s; raises ValidationError or NotJSON."""
    if isinstance(feedback, FeedbackIn):
        fb, sent = feedback, dump(feedback)
    else:
        fb, sent = FeedbackIn.model_validate(feedback), feedback
    encoded = encode_fields(sent)
    return fb, {
        "id": str(uuid.uuid4()),
        "trace_id": trace_id,
        "idempotency_key": fb.idempotency_key,
        # the trace id is part of the content: the same key on another trace is a conflict
        "content_hash": digest({"trace_id": trace_id, **sent}, encoded, fb.created_at),
        "created_at": utc_naive(fb.created_at or utc_now()),
        "score": fb.score,
        "label": fb.label,
        "correction": Encoded(encoded["correction"]) if "correction" in encoded else None,
        "text": fb.text,
        "verifier_env": fb.verifier.env if fb.verifier else None,
        "verifier_task": Encoded(canonical(fb.verifier.task)) if fb.verifier else None,
        "tenant": tenant,
        "source": fb.source,
    }

