"""The job store's schema is its Alembic migrations: from an empty database they build exactly
the tables jobs/tables.py declares, a second open changes nothing, and a database written by a
newer flywheel is refused. On SQLite and, with FLYWHEEL_TEST_POSTGRES_URL, on PostgreSQL."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from flywheel.database import SchemaVersionError
from flywheel.jobs import JobStore
from flywheel.jobs import migrate
from flywheel.jobs.tables import TABLES

@pytest.fixture
def url(job_db_url):
    return job_db_url  # tests/conftest.py: SQLite, and PostgreSQL when configured


def test_the_migrations_build_exactly_the_declared_tables(url, tmp_path):
    store = JobStore(url, tmp_path / "files")
    names = {t.name for t in TABLES}
    with store.engine.connect() as conn:
        assert migrate.current(conn) == migrate.head()
        ctx = MigrationContext.configure(conn, opts={"include_object": lambda o, name, kind, r, c: (
            (name if kind == "table" else getattr(getattr(o, "table", None), "name", None)) in names | {None})})
        assert compare_metadata(ctx, TABLES[0].metadata) == []  # tables.py and the migrations agree
    assert names <= set(inspect(store.engine).get_table_names())
    store.close()
    JobStore(url, tmp_path / "files").close()  # at head: nothing to do


def test_concurrent_opens_of_an_empty_database_both_succeed(url, tmp_path):
    errors = []

    def open_store():
        try:
            JobStore(url, tmp_path / "files").close()
        except Exception as e:  # noqa: BLE001 - the assertion reports it
            errors.append(e)

    threads = [threading.Thread(target=open_store) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_database_from_a_newer_flywheel_is_refused(url, tmp_path):
    JobStore(url, tmp_path / "files").close()
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {migrate.VERSION_TABLE} SET version_num = 'f00d'"))
    engine.dispose()
    with pytest.raises(SchemaVersionError, match="revision f00d, which this flywheel does not know"):
        JobStore(url, tmp_path / "files")


def test_a_database_at_the_first_revision_is_upgraded_with_its_rows(url, tmp_path):
    from alembic import command

    from flywheel.database import writing

    engine = create_engine(url)
    with writing(engine) if url.startswith("sqlite") else engine.begin() as conn:
        command.upgrade(migrate._config(conn), "0001")
        conn.execute(text(
            "INSERT INTO ft_jobs (id, tenant, model, method, training_file, seed, status, created_at, attempts) "
            "VALUES ('ftjob-old', 't', 'tiny', :method, 'file-1', 0, 'queued', '2026-12-01 00:00:00', 0)"),
            {"method": '{"type": "supervised"}'})
    engine.dispose()
    store = JobStore(url, tmp_path / "files")
    with store.engine.connect() as conn:
        assert migrate.current(conn) == migrate.head() != "0001"
    old = store.get_job("t", "ftjob-old")
    assert old["status"] == "queued" and old["model_deleted_at"] is None
    store.close()
