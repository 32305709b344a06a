"""Every store's schema is its Alembic migrations (flywheel.migrations): from an empty database
they build exactly the tables the store declares, a second open changes nothing, a database
written by a newer flywheel is refused, and a database of the previous release's schema is
upgraded with its rows: the trace and registry stores' flywheel_meta version 1
(tests/data/schema_v1, the DDL that release ran) and the job store's first revision. On SQLite
and, in `make test-all`, on PostgreSQL (tests/conftest.py's `db_url`)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, select, text

from flywheel.database import MetaRow, SchemaVersionError, open_engine, writing
from flywheel.jobs import JobStore
from flywheel.jobs.tables import SCHEMA as JOBS
from flywheel.registry import Registry
from flywheel.registry.storage import SCHEMA as REGISTRY
from flywheel.traces import TraceStore
from flywheel.traces.tables import SCHEMA as TRACES

V1 = Path(__file__).resolve().parents[1] / "data" / "schema_v1"
SCHEMAS = {"jobs": JOBS, "traces": TRACES, "registry": REGISTRY}


def open_store(name: str, url: str, tmp_path: Path):
    if name == "jobs":
        return JobStore(url, tmp_path / "files")
    if name == "traces":
        return TraceStore(url)
    return Registry(tmp_path / "registry", url=url)


def dialect(url: str) -> str:
    return "postgresql" if url.startswith("postgresql") else "sqlite"


def run_script(url: str, sql: str) -> None:
    """Statements separated by `;` at line ends, as the dumps in tests/data/schema_v1 are."""
    engine = create_engine(url)
    with engine.begin() as conn:
        for statement in sql.split(";\n"):
            body = "\n".join(line for line in statement.splitlines() if not line.startswith("--")).strip()
            if body:
                conn.execute(text(body))
    engine.dispose()


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_migrations_build_exactly_the_declared_tables(name, db_url, tmp_path):
    schema = SCHEMAS[name]
    store = open_store(name, db_url, tmp_path)
    with store.engine.connect() as conn:
        assert schema.current(conn) == schema.head()
        ctx = MigrationContext.configure(conn, opts={"include_object": schema.include_object})
        assert compare_metadata(ctx, schema.tables[0].metadata) == []  # the tables and the migrations agree
    assert {t.name for t in schema.tables} <= set(inspect(store.engine).get_table_names())
    store.close()
    open_store(name, db_url, tmp_path).close()  # at head: nothing to do


@pytest.mark.parametrize("name", SCHEMAS)
def test_concurrent_opens_of_an_empty_database_all_succeed(name, db_url, tmp_path):
    errors = []

    def open_one():
        try:
            open_store(name, db_url, tmp_path).close()
        except Exception as e:  # noqa: BLE001 - the assertion reports it
            errors.append(e)

    threads = [threading.Thread(target=open_one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("name", SCHEMAS)
def test_a_database_from_a_newer_flywheel_is_refused(name, db_url, tmp_path):
    open_store(name, db_url, tmp_path).close()
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE {SCHEMAS[name].version_table} SET version_num = 'f00d'"))
    engine.dispose()
    with pytest.raises(SchemaVersionError, match=f"{name} schema revision f00d, which this flywheel does not know"):
        open_store(name, db_url, tmp_path)


def test_the_stores_share_one_database_each_with_its_own_revision(tmp_path):
    url = f"sqlite:///{tmp_path / 'all.db'}"
    stores = [open_store(name, url, tmp_path) for name in SCHEMAS]
    with stores[0].engine.connect() as conn:
        assert {name: s.current(conn) for name, s in SCHEMAS.items()} == {n: s.head() for n, s in SCHEMAS.items()}
    for store in stores:
        store.close()


def test_a_trace_store_of_the_previous_release_is_upgraded_with_its_traces_and_feedback(db_url, tmp_path):
    run_script(db_url, (V1 / f"traces.{dialect(db_url)}.sql").read_text())
    run_script(db_url, """
        INSERT INTO traces (id, idempotency_key, content_hash, created_at, source, messages)
            VALUES ('t-old', 'k-old', 'h', '2026-11-01 00:00:00', 'serve', '[]');
        INSERT INTO trace_feedback (id, trace_id, idempotency_key, content_hash, created_at, score)
            VALUES ('f-old', 't-old', 'fk-old', 'h', '2026-11-01 00:01:00', 0.0);
    """)
    with TraceStore(db_url) as store:
        old = store.get("t-old")
        assert old.tenant == "default" and [f.id for f in old.feedback] == ["f-old"]
        assert store.stats().schema_revision == TRACES.head()
        # keys are the tenant's own now: another tenant may use the old key, and the old trace's own tenant is told
        other = {"messages": [{"role": "user", "content": "hi"}], "idempotency_key": "k-old"}
        assert store.add_traces([other], tenant="acme").results[0].status == "added"
        assert store.add_traces([other]).results[0].status == "conflict"
        with store.engine.connect() as conn:
            assert conn.scalar(select(MetaRow.value).where(MetaRow.key == "traces.schema_version")) == "alembic"
            ctx = MigrationContext.configure(conn, opts={"include_object": TRACES.include_object})
            assert compare_metadata(ctx, TRACES.tables[0].metadata) == []


@pytest.mark.parametrize("with_pruned", [True, False], ids=["with-registry_pruned", "before-registry_pruned"])
def test_a_registry_of_the_previous_release_is_upgraded_with_its_versions(with_pruned, db_url, tmp_path):
    script = (V1 / f"registry.{dialect(db_url)}.sql").read_text()
    if not with_pruned:  # registries of schema version 1 made before registry_pruned existed
        script = ";\n".join(s for s in script.split(";\n") if "registry_pruned" not in s)
    run_script(db_url, script)
    run_script(db_url, """
        INSERT INTO registry_state (id, production, generation) VALUES (1, NULL, 0);
        INSERT INTO registry_versions (seq, id, created_at, path, source, storage, status, reasons, data_counts,
                                       config, eval_scores, cost, files, notes)
            VALUES (1, 'v-old', '2026-11-01 00:00:00', 'models/v-old', '/src', 'copy', 'candidate', '[]', '{}',
                    '{}', '{}', '{}', '{}', '');
    """)
    with Registry(tmp_path / "registry", url=db_url) as registry:
        assert [v.id for v in registry.list()] == ["v-old"] and registry.production() is None
        assert "registry_pruned" in inspect(registry.engine).get_table_names()
        with registry.engine.connect() as conn:
            assert REGISTRY.current(conn) == REGISTRY.head()


def test_a_pre_migration_store_of_an_unknown_version_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    run_script(url, (V1 / "traces.sqlite.sql").read_text().replace("'traces.schema_version', '1'",
                                                                   "'traces.schema_version', '7'"))
    with pytest.raises(SchemaVersionError, match="holds traces schema version 7; this flywheel can upgrade only "
                                                 "version 1"):
        TraceStore(url)


def test_a_job_store_at_the_first_revision_is_upgraded_with_its_rows(db_url, tmp_path):
    engine = open_engine(db_url)
    with writing(engine) as conn:
        command.upgrade(JOBS.config(conn), "0001")
        conn.execute(text(
            "INSERT INTO ft_jobs (id, tenant, model, method, training_file, seed, status, created_at, attempts) "
            "VALUES ('ftjob-old', 't', 'tiny', :method, 'file-1', 0, 'queued', '2026-12-01 00:00:00', 0)"),
            {"method": '{"type": "supervised"}'})
    engine.dispose()
    store = JobStore(db_url, tmp_path / "files")
    with store.engine.connect() as conn:
        assert JOBS.current(conn) == JOBS.head() != "0001"
    old = store.get_job("t", "ftjob-old")
    assert old["status"] == "queued" and old["model_deleted_at"] is None
    store.close()
