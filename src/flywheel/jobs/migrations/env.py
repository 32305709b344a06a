"""Alembic's environment for the job store: run on the connection JobStore hands over
(`config.attributes["connection"]`), versions kept in `alembic_version_jobs` so other stores
in the same database keep their own."""

from __future__ import annotations

from alembic import context

from flywheel.jobs.tables import TABLES

VERSION_TABLE = "alembic_version_jobs"
connection = context.config.attributes["connection"]
NAMES = {t.name for t in TABLES}


def include_object(obj, name, kind, reflected, compare_to) -> bool:
    """Only the job store's tables: the database may hold other stores' (traces, registry)."""
    table = name if kind == "table" else getattr(getattr(obj, "table", None), "name", None)
    return table is None or table in NAMES


context.configure(connection=connection, target_metadata=TABLES[0].metadata, version_table=VERSION_TABLE,
                  include_object=include_object)
with context.begin_transaction():
    context.run_migrations()
