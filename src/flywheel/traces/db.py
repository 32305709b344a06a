"""Where the trace database lives and which schema it holds.

SQLite (WAL) at ./flywheel-data/traces.db by default, any SQLAlchemy URL otherwise; the
engine setup is flywheel's one (`flywheel.database.open_engine`). The schema is brought to the
newest revision on open (traces/migrations, run by `flywheel.migrations`); a database a newer
flywheel wrote is refused.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Connection, Engine

from flywheel import database
from flywheel.traces.tables import SCHEMA

DEFAULT_DIR = Path("flywheel-data")


def default_url() -> str:
    return f"sqlite:///{(DEFAULT_DIR / 'traces.db').resolve()}"


def open_engine(url: str | None = None) -> Engine:
    """An engine for `url` (default: SQLite at ./flywheel-data/traces.db, folder created)."""
    return database.open_engine(url or default_url())


def ensure_schema(engine: Engine) -> None:
    SCHEMA.upgrade(engine)


def schema_revision(conn: Connection) -> str:
    return SCHEMA.current(conn) or "none"
