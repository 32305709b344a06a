"""Traces: `TraceStore` (SQLite WAL by default, any SQLAlchemy URL), the incoming shapes
`TraceIn` / `FeedbackIn`, batch preparation for ingestion workers, and `import_jsonl`."""

from flywheel.traces.db import SchemaVersionError, default_url
from flywheel.traces.importer import ImportReport, import_jsonl
from flywheel.traces.results import (
    BatchResult,
    IdempotencyConflict,
    InvalidRecord,
    RecordResult,
    StoredFeedback,
    StoredTrace,
    StoredVerifier,
    TraceNotFound,
    TraceStats,
    TraceStoreBusy,
    TraceStoreError,
)
from flywheel.traces.schema import ChatMessage, FeedbackIn, TraceIn, Verifier
from flywheel.traces.store import TraceStore

__all__ = [
    "BatchResult", "ChatMessage", "FeedbackIn", "IdempotencyConflict", "ImportReport", "InvalidRecord",
    "RecordResult", "SchemaVersionError", "StoredFeedback", "StoredTrace", "StoredVerifier", "TraceIn",
    "TraceNotFound", "TraceStats", "TraceStore", "TraceStoreBusy", "TraceStoreError", "Verifier", "default_url",
    "import_jsonl",
]
