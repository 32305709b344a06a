"""Where the trace database lives and which schema it holds.

SQLite (WAL) at <data dir>/traces.db by default (flywheel/locations.py: $FLYWHEEL_DATA_DIR,
else ./flywheel-data), any SQLAlchemy URL otherwise; the engine setup is flywheel's one
(`flywheel.database.open_engine`). The schema is brought to the
newest revision on open (traces/migrations, run by `flywheel.migrations`); a database a newer
flywheel wrote is refused.
"""

from __future__ import annotations

from sqlalchemy import Connection, Engine

from flywheel import database
from flywheel.locations import data_dir
from flywheel.traces.tables import SCHEMA


def default_url() -> str:
    return f"sqlite:///{(data_dir() / 'traces.db').resolve()}"


def open_engine(url: str | None = None) -> Engine:
    """An engine for `url` (default: SQLite at <data dir>/traces.db, folder created)."""
    return database.open_engine(url or default_url())


def ensure_schema(engine: Engine) -> None:
    SCHEMA.upgrade(engine)


def schema_revision(conn: Connection) -> str:
    return SCHEMA.current(conn) or "none"
