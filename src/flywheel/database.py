"""The SQL databases of flywheel's stores (traces, registry, jobs): one declarative base, one engine setup.

`open_engine(url)`: any SQLAlchemy URL; SQLite connections run with journal_mode=WAL (readers
never block the writer), synchronous=NORMAL (a commit survives a crash of the process, not
necessarily a power cut), foreign_keys=ON and a 30 s busy timeout. pysqlite's own
transaction handling is switched off and BEGIN is emitted here: `writing(engine)` opens
BEGIN IMMEDIATE, so two writers queue on the lock at their first statement instead of
failing with "database is locked" when a read turns into a write.

Every table derives from `Base`; each store's schema is its Alembic migrations
(`flywheel.migrations`). `flywheel_meta` is where stores recorded their schema version before
those existed. JSON columns are `json_column()` (JSONB on PostgreSQL); a value given as
`Encoded` text is stored as is.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
from sqlalchemy import JSON, Connection, Engine, String, create_engine, event
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.pool import StaticPool

_WRITE = "flywheel_write"


class Base(DeclarativeBase):
    pass


class MetaRow(Base):
    """Key/value facts about the database itself, such as the schema version of each store."""

    __tablename__ = "flywheel_meta"

    key: Mapped[str] = mapped_column(String(100), primary_key=True)
    value: Mapped[str] = mapped_column(String(200))


class SchemaVersionError(RuntimeError):
    pass


class Encoded(str):
    """JSON text serialised already (the store hashes it too); a JSON column stores it as is."""

    __slots__ = ()


def json_column() -> JSON:
    """A JSON column type; none_as_null: Python None is SQL NULL, not the JSON text 'null'."""
    return JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), "postgresql")


def _dumps(value) -> str:
    if type(value) is Encoded:
        return value
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def open_engine(url: str) -> Engine:
    """An engine for `url`; a SQLite file's folder is created.

    An in-memory SQLite URL gives one shared connection: fine for a test in one thread, not
    for concurrent writers (use a file).
    """
    parsed = make_url(url)
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


BUSY_TIMEOUT_S = 30.0


def _sqlite_on_connect(dbapi_connection, _record) -> None:
    dbapi_connection.isolation_level = None  # no implicit BEGIN from pysqlite: _sqlite_on_begin owns it
    cursor = dbapi_connection.cursor()
    cursor.execute(f"PRAGMA busy_timeout={int(BUSY_TIMEOUT_S * 1000)}")
    _set_wal(cursor)
    for pragma_ in ("synchronous=NORMAL", "foreign_keys=ON"):
        cursor.execute(f"PRAGMA {pragma_}")
    cursor.close()


def _set_wal(cursor) -> None:
    """journal_mode=WAL. Switching a new file's mode needs it to itself, and SQLite answers
    "database is locked" at once, without its busy handler, while another connection is
    inside a transaction there (processes opening a new store together): wait for that."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _sqlite_on_begin(conn: Connection) -> None:
    """BEGIN (IMMEDIATE for a write) on the DBAPI connection itself, without the overhead of
    SQLAlchemy's execute, which is larger than a short read's SELECT (bench/api.py)."""
    conn.connection.dbapi_connection.execute("BEGIN IMMEDIATE" if conn.get_execution_options().get(_WRITE) else "BEGIN")


@contextlib.contextmanager
def writing(engine: Engine, *, foreign_keys: bool = True) -> Iterator[Connection]:
    """A write transaction, committed when the block ends without an exception.

    foreign_keys=False (SQLite; a schema migration that recreates tables): foreign keys are
    not enforced in the transaction, so dropping a parent table does not cascade into its
    children's rows; before the commit every foreign key is checked, and a violation
    aborts the transaction."""
    with engine.connect() as conn:
        relax = not foreign_keys and engine.dialect.name == "sqlite"
        raw = conn.connection.dbapi_connection
        if relax:  # only outside a transaction does SQLite take this pragma
            raw.execute("PRAGMA foreign_keys=OFF")
        try:
            conn.execution_options(**{_WRITE: True})
            with conn.begin():
                yield conn
                if relax and (broken := conn.exec_driver_sql("PRAGMA foreign_key_check").all()):
                    raise RuntimeError(f"foreign keys broken by this transaction (table, rowid, parent): {broken[:5]}")
        finally:
            if relax:
                raw.execute("PRAGMA foreign_keys=ON")


def pragma(engine: Engine, name: str) -> str:
    """One SQLite PRAGMA's value as a connection of this engine sees it (for checks and stats)."""
    with engine.connect() as conn:
        return str(conn.exec_driver_sql(f"PRAGMA {name}").scalar())
