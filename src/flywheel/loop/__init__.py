"""The continuous flywheel: traces, curation, cycles, gates, registry, promotion.

Traces: `TraceStore` (SQLite WAL by default, any SQLAlchemy URL), the incoming shapes
`TraceIn` / `FeedbackIn`, and `import_jsonl`. Models: `Registry` (versions with lineage, one
production version, promote / rollback / reject with history, `production_marker()`).
The rest is imported from its module: `curation` (traces -> RL / SFT / DPO / replay items),
`gate` (the promotion rule), `evaluation` (suites), `cycle` (one resumable cycle),
`serving` (serve the production version), `daemon` (`flywheel loop run`), `loop_config`.
"""

from flywheel.loop.registry import Registry, default_root
from flywheel.loop.registry_storage import (
    HistoryEntry,
    InvalidModelFolder,
    ProductionMarker,
    RegistryError,
    StatusError,
    Version,
    VersionNotFound,
)
from flywheel.loop.trace_db import SchemaVersionError, default_url
from flywheel.loop.trace_import import ImportReport, import_jsonl
from flywheel.loop.trace_results import (
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
from flywheel.loop.trace_schema import ChatMessage, FeedbackIn, TraceIn, Verifier
from flywheel.loop.trace_store import TraceStore

__all__ = [
    "BatchResult", "ChatMessage", "FeedbackIn", "IdempotencyConflict", "ImportReport", "InvalidRecord",
    "RecordResult", "SchemaVersionError", "StoredFeedback", "StoredTrace", "StoredVerifier", "TraceIn",
    "TraceNotFound", "TraceStats", "TraceStore", "TraceStoreBusy", "TraceStoreError", "Verifier", "default_url",
    "import_jsonl",
    "HistoryEntry", "InvalidModelFolder", "ProductionMarker", "Registry", "RegistryError", "StatusError", "Version",
    "VersionNotFound", "default_root",
]
