"""Every store's schema is its Alembic migrations, run from here.

A store (jobs, traces, registry) declares a `Schema`: its tables, the folder of its revision
scripts (its package's `migrations/`), and the table that records its revision
(`alembic_version_<store>`, so stores that share one database keep their own). This folder is
Alembic's script location for all of them (env.py, script.py.mako).

`Schema.upgrade(engine)` brings a database, empty or at an older revision, to the newest in one
write transaction (SQLite: BEGIN IMMEDIATE serialises a server and its workers opening the store
at once; PostgreSQL: an advisory lock per store does); on SQLite foreign keys are checked at the
end, not enforced on the way, as Alembic's table-recreating batch migrations need. A database
at a revision this flywheel does not know (a newer release's) is refused rather than used.

Stores older than their migrations recorded `<store>.schema_version = 1` in `flywheel_meta`.
Such a database is stamped at revision 0001, which builds exactly that schema, and upgraded
from there; the old key then says `alembic`, so a release from before the migrations refuses
the database instead of writing into tables it does not know.

A schema change is a new revision: `Schema.revision(engine, message, rev_id)` against a
database at head writes the script from the difference; then read and tidy it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, Engine, Table, inspect, select, text, update

from flywheel.database import MetaRow, SchemaVersionError, writing

SCRIPT_LOCATION = Path(__file__).resolve().parent
LEGACY_REVISION = "0001"  # the revision that builds a pre-migration store's schema version 1
MIGRATED = "alembic"  # a pre-migration store's flywheel_meta value once it is upgraded


@dataclass(frozen=True)
class Schema:
    store: str  # "jobs", "traces", "registry": names the version table and the messages
    versions: Path  # the folder of the store's revision scripts
    tables: tuple[Table, ...]
    lock_key: int  # pg_advisory_xact_lock key of this store's migrations
    legacy_key: str | None = None  # flywheel_meta key of a store made before its migrations

    @property
    def version_table(self) -> str:
        return f"alembic_version_{self.store}"

    def config(self, conn: Connection) -> Config:
        cfg = Config()
        cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
        cfg.set_main_option("path_separator", "os")  # a folder's path may hold spaces
        cfg.set_main_option("version_locations", str(self.versions))
        cfg.attributes["connection"] = conn
        cfg.attributes["schema"] = self
        return cfg

    def scripts(self) -> ScriptDirectory:
        return ScriptDirectory(str(SCRIPT_LOCATION), version_locations=[str(self.versions)])

    def head(self) -> str:
        return self.scripts().get_current_head()

    def current(self, conn: Connection) -> str | None:
        return MigrationContext.configure(conn, opts={"version_table": self.version_table}).get_current_revision()

    def include_object(self, obj, name, kind, reflected, compare_to) -> bool:
        """Only this store's tables and what belongs to them: the database may hold other stores'."""
        table = name if kind == "table" else getattr(getattr(obj, "table", None), "name", None)
        return table is None or table in {t.name for t in self.tables}

    def upgrade(self, engine: Engine) -> None:
        with writing(engine, foreign_keys=False) as conn:  # SQLite: batch migrations recreate tables
            if engine.dialect.name == "postgresql":
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": self.lock_key})
            found = self.current(conn)
            cfg = self.config(conn)
            if found is None and self._legacy_version(conn) is not None:
                command.stamp(cfg, LEGACY_REVISION)
                found = LEGACY_REVISION
            known = {s.revision for s in self.scripts().walk_revisions()}
            if found is not None and found not in known:
                raise SchemaVersionError(
                    f"{_where(engine)} holds {self.store} schema revision {found}, which this flywheel does not know "
                    f"(its newest is {self.head()}): a newer flywheel wrote it")
            if found != self.head():
                command.upgrade(cfg, "head")
            if self.legacy_key is not None and "flywheel_meta" in inspect(conn).get_table_names():
                conn.execute(update(MetaRow).where(MetaRow.key == self.legacy_key).values(value=MIGRATED))

    def _legacy_version(self, conn: Connection) -> str | None:
        """The pre-migration schema version this database records for the store (None: none)."""
        if self.legacy_key is None or "flywheel_meta" not in inspect(conn).get_table_names():
            return None
        found = conn.scalar(select(MetaRow.value).where(MetaRow.key == self.legacy_key))
        if found not in (None, "1", MIGRATED):
            raise SchemaVersionError(f"{_where(conn.engine)} holds {self.store} schema version {found}; this "
                                     f"flywheel can upgrade only version 1")
        return found if found == "1" else None

    def revision(self, engine: Engine, message: str, rev_id: str) -> None:
        """Write a new revision script from the difference between the tables and the database."""
        with writing(engine) as conn:
            command.revision(self.config(conn), message=message, autogenerate=True, rev_id=rev_id,
                             version_path=str(self.versions))


def _where(engine: Engine) -> str:
    return engine.url.render_as_string(hide_password=True)
