"""TraceStore's SQLite write path: rows exactly as SQLAlchemy Core writes them, content hashes
that never change, time-ordered ids."""

from __future__ import annotations

import sqlite3
import time
from datetime import datetime, timedelta, timezone

from flywheel.traces import TraceStore


def _records():
    t0 = datetime(2025, 3, 4, 5, 6, 7, tzinfo=timezone(timedelta(hours=2)))
    out = []
    for i in range(40):
        r = {"idempotency_key": f"k{i}", "messages": [{"role": "user", "content": f"q{i} é"}],
             "created_at": (t0 + timedelta(microseconds=0 if i % 3 else 123456 * i)).isoformat()}
        if i % 2:
            r.update(id=f"id-{i}", model="m", model_version="v1", latency_ms=i if i % 4 == 1 else i + 0.25,
                     response={"role": "assistant", "content": "a"}, usage={"prompt_tokens": i, "completion_tokens": 2},
                     metadata={"z": 1, "a": [1, {"b": None}]}, source="agent",
                     tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
        else:
            r["id"] = f"id-{i}"
        out.append(r)
    return out


def test_the_sqlite_fast_path_writes_what_sqlalchemy_core_writes(tmp_path):
    paths = {}
    for name in ("core", "fast"):
        paths[name] = tmp_path / f"{name}.db"
        with TraceStore(f"sqlite:///{paths[name]}") as store:
            if name == "core":
                store._sqlite = None  # the generic path: Core insert(), select() with IN lists
            else:
                store._sqlite.rows_per_statement = 7  # several multi-row statements, the last one short
            result = store.add_traces(_records()[:30])
            again = store.add_traces(_records())  # 30 duplicates, 10 new
            assert (result.added, again.duplicates, again.added) == (30, 30, 10)
    dumps = {}
    for name, path in paths.items():
        with sqlite3.connect(path) as conn:
            dumps[name] = conn.execute("SELECT * FROM traces ORDER BY seq").fetchall()
    assert len(dumps["fast"]) == 40 and dumps["fast"] == dumps["core"]
    assert dumps["fast"][0][4] == "2025-03-04 03:06:07.000000"  # created_at: naive UTC, SQLAlchemy's text form


def test_the_content_hash_format_never_changes():
    """Stored hashes decide duplicate vs conflict for retries: the hashed text is fixed (this
    value was computed by the first implementation)."""
    from flywheel.traces.encoding import digest, validate_trace

    sent = {"idempotency_key": "k", "messages": [{"role": "user", "content": "2+2="}],
            "response": {"role": "assistant", "content": "4"}, "created_at": "2025-01-02T03:04:05+01:00",
            "latency_ms": 12.5, "metadata": {"b": 1, "a": [None]}}
    trace, encoded = validate_trace(sent)
    assert digest(sent, encoded, trace["created_at"]) == "14396dcfc26e2a849a662d53468845c97d66b0d49edcdfd461495fcb284c086e"


def test_generated_ids_are_time_ordered_uuids():
    """Version 7 UUIDs: new traces append to the id index instead of landing all over it."""
    import uuid

    with TraceStore("sqlite://") as store:
        first = store.add_traces([{"messages": [{"role": "user", "content": str(i)}]} for i in range(200)]).ids
        time.sleep(0.003)  # a later millisecond
        later = store.add_traces([{"messages": [{"role": "user", "content": "x"}]}]).ids
    assert len(set(first)) == 200 and max(first) < later[0]
    for trace_id in first + later:
        u = uuid.UUID(trace_id)
        assert (u.version, u.variant, str(u)) == (7, uuid.RFC_4122, trace_id)
        assert abs((u.int >> 80) - time.time() * 1000) < 60_000  # the first 48 bits: Unix time in ms
