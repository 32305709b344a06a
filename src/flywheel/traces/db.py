"""Open the trace database: SQLite (WAL) under ./flywheel-data/ by default, any SQLAlchemy URL otherwise.

SQLite connections run with journal_mode=WAL (readers never block the writer),
synchronous=NORMAL (a commit survives a crash of the process, not necessarily a power cut),
foreign_keys=ON and a 30 s busy timeout. pysqlite's own transaction handling is switched off
and the store emits BEGIN itself: write transactions use BEGIN IMMEDIATE, so two writers
queue on the lock at their first statement instead of failing with "database is locked"
when a read turns into a write.

The schema is created on open and its version recorded in `flywheel_meta`; a database of
another version is refused (migrations are not written yet).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import orjson
from sqlalchemy import Connection, Engine, create_engine, event, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

from flywheel.traces.tables import SCHEMA_VERSION, SCHEMA_VERSION_KEY, Base, MetaRow

DEFAULT_DIR = Path("flywheel-data")
_WRITE = "flywheel_write"


class Encoded(str):
    """JSON text serialised already (the store hashes it too); a JSON column stores it as is."""

    __slots__ = ()


def _dumps(value) -> str:
    if type(value) is Encoded:
        return value
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


class SchemaVersionError(RuntimeError):
    pass


def default_url() -> str:
    return f"sqlite:///{(DEFAULT_DIR / 'traces.db').resolve()}"


def open_engine(url: str | None = None) -> Engine:
    """An engine for `url` (default: SQLite at ./flywheel-data/traces.db, folder created).

    An in-memory SQLite URL gives one shared connection: fine for a test in one thread, not
    for concurrent writers (use a file).
    """
    parsed = make_url(url or default_url())
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, json_serializer=_dumps, json_deserializer=orjson.loads, pool_pre_ping=True)
    database = parsed.database or ""
    memory = database in ("", ":memory:") or parsed.query.get("mode") == "memory"
    options: dict = {}
    if memory:  # one shared connection, or each checkout would see its own empty database
        options = {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}
    else:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, json_serializer=_dumps, json_deserializer=orjson.loads, **options)
    event.listen(engine, "connect", _sqlite_on_connect)
    event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def _sqlite_on_connect(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None  # no implicit BEGIN from pysqlite: _sqlite_on_begin owns it
    cursor = dbapi_connection.cursor()
    for pragma in ("busy_timeout=30000", "journal_mode=WAL", "synchronous=NORMAL", "foreign_keys=ON"):
        cursor.execute(f"PRAGMA {pragma}")
    cursor.close()


def _sqlite_on_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")


@contextlib.contextmanager
def writing(engine: Engine) -> Iterator[Connection]:
    """A write transaction, committed when the block ends without an exception."""
    with engine.connect() as conn:
        conn.execution_options(**{_WRITE: True})
        with conn.begin():
            yield conn


def ensure_schema(engine: Engine) -> None:
    with writing(engine) as conn:
        Base.metadata.create_all(conn)
        found = conn.scalar(select(MetaRow.value).where(MetaRow.key == SCHEMA_VERSION_KEY))
        if found is None:
            conn.execute(insert(MetaRow).values(key=SCHEMA_VERSION_KEY, value=str(SCHEMA_VERSION)))
        elif found != str(SCHEMA_VERSION):
            raise SchemaVersionError(
                f"{engine.url.render_as_string(hide_password=True)} holds trace schema version {found}, "
                f"this flywheel reads version {SCHEMA_VERSION} (no migration exists yet)")


def schema_version(conn: Connection) -> int:
    return int(conn.scalar(select(MetaRow.value).where(MetaRow.key == SCHEMA_VERSION_KEY)))


def pragma(engine: Engine, name: str) -> str:
    """One SQLite PRAGMA's value as a connection of this engine sees it (for checks and stats)."""
    with engine.connect() as conn:
        return str(conn.exec_driver_sql(f"PRAGMA {name}").scalar())
