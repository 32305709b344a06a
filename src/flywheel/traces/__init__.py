"""Traces: `TraceStore` (SQLite WAL by default, any SQLAlchemy URL), the incoming shapes
`TraceIn` / `FeedbackIn`, batch preparation for ingestion workers, and `import_jsonl`."""

from flywheel.database import SchemaVersionError
from flywheel.traces import results
from flywheel.traces.db import default_url
from flywheel.traces.importer import ImportReport, import_jsonl
from flywheel.traces.results import *  # noqa: F403 - what the store hands back, as results.__all__ lists
from flywheel.traces.schema import FeedbackIn, TraceIn, Verifier
from flywheel.traces.store import TraceStore

__all__ = [*results.__all__, "FeedbackIn", "ImportReport", "SchemaVersionError", "TraceIn", "TraceStore", "Verifier",
           "default_url", "import_jsonl"]
