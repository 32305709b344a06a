"""Where the trace database lives and which schema it holds.

SQLite (WAL) at ./flywheel-data/traces.db by default, any SQLAlchemy URL otherwise; the
engine setup is flywheel's one (`flywheel.database.open_engine`). The trace tables are
created on open and their schema version recorded; a database of another version is refused.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection, Engine

from flywheel import database
from flywheel.database import writing
from flywheel.traces.tables import SCHEMA_VERSION, SCHEMA_VERSION_KEY, FeedbackRow, TraceRow

DEFAULT_DIR = Path("flywheel-data")


def default_url() -> str:
    return f"sqlite:///{(DEFAULT_DIR / 'traces.db').resolve()}"


def open_engine(url: str | None = None) -> Engine:
    """An engine for `url` (default: SQLite at ./flywheel-data/traces.db, folder created)."""
    return database.open_engine(url or default_url())


def ensure_schema(engine: Engine) -> None:
    with writing(engine) as conn:
        database.ensure_schema(conn, [TraceRow.__table__, FeedbackRow.__table__], SCHEMA_VERSION_KEY,
                               SCHEMA_VERSION, "trace")


def schema_version(conn: Connection) -> int:
    return database.schema_version(conn, SCHEMA_VERSION_KEY)
