"""The job store's schema is Alembic's (jobs/migrations): `upgrade(engine)` brings a database,
empty or at an older revision, to the newest, in one write transaction (SQLite: BEGIN
IMMEDIATE serialises a server and its workers opening the store at once; PostgreSQL: an
advisory lock does). A database at a revision this flywheel does not know (a newer release's)
is refused rather than used.

A schema change is a new revision: `alembic revision --autogenerate` against a database at
head (`revision()` below does it with the store's settings), then read and tidy the script.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, text

from flywheel.database import SchemaVersionError, writing

SCRIPTS = Path(__file__).resolve().parent / "migrations"
VERSION_TABLE = "alembic_version_jobs"
_LOCK = 7_311_999  # pg_advisory_xact_lock key of job-store migrations


def _config(conn) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPTS))
    cfg.attributes["connection"] = conn
    return cfg


def head() -> str:
    return ScriptDirectory(str(SCRIPTS)).get_current_head()


def current(conn) -> str | None:
    return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade(engine: Engine) -> None:
    with writing(engine) as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _LOCK})
        found = current(conn)
        known = {s.revision for s in ScriptDirectory(str(SCRIPTS)).walk_revisions()}
        if found is not None and found not in known:
            raise SchemaVersionError(
                f"{engine.url.render_as_string(hide_password=True)} holds job-store schema revision {found}, which "
                f"this flywheel does not know (its newest is {head()}): a newer flywheel wrote it")
        if found != head():
            command.upgrade(_config(conn), "head")


def revision(engine: Engine, message: str, rev_id: str) -> None:
    """Write a new revision script from the difference between the tables and the database."""
    with writing(engine) as conn:
        command.revision(_config(conn), message=message, autogenerate=True, rev_id=rev_id)
