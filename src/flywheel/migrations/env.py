"""Alembic's environment for every store: runs on the connection the store hands over
(`config.attributes["connection"]`), for the store's `Schema` (`config.attributes["schema"]`):
its tables only, its revision in its own version table."""

from __future__ import annotations

from alembic import context

schema = context.config.attributes["schema"]
context.configure(connection=context.config.attributes["connection"], target_metadata=schema.tables[0].metadata,
                  version_table=schema.version_table, include_object=schema.include_object)
with context.begin_transaction():
    context.run_migrations()
