"""TraceStore: the database of served requests, imported agent episodes and their feedback.

Ingestion is batch-first. `add_traces` validates every record on its own (a refused record
is reported with its index and reason and never holds back the others), then stores all
the valid ones in ONE write transaction (on SQLite: multi-row INSERT statements through
the driver, see `_SqliteTraceSQL`; elsewhere one Core executemany, never one ORM object
per row), and commits before it returns: an id in the result is durable. Ids the store
assigns are time-ordered UUIDs (version 7), so new rows append to the id index.

Idempotency. Every stored trace has a unique key (the client's `idempotency_key`, else its
id) and the SHA-256 of its content as sent. A record whose key is taken by identical
content is a no-op that reports the stored id ("duplicate"); by other content, a
"conflict". The check runs inside the write transaction: on SQLite BEGIN IMMEDIATE
serialises writers so it is exact; elsewhere a writer that loses a race hits the unique
index and the whole transaction is retried, when the check sees the winner's rows.

Tenants. Every trace and feedback is written for a tenant (default "default"); idempotency
keys are the tenant's own. Readers given a `tenant` see only that tenant's traces (a trace
of another tenant is not found); without one, a reader sees the whole store (the loop's
and the operator's view).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from typing import Any

from pydantic import ValidationError
from sqlalchemy import JSON, DateTime, exists, func, insert, or_, select
from sqlalchemy.exc import IntegrityError

from flywheel.clock import utc_aware, utc_naive
from flywheel.closing import Closing
from flywheel.database import Encoded, writing
from flywheel.traces.batch import PreparedBatch, prepare_traces
from flywheel.traces.db import ensure_schema, open_engine, schema_revision
from flywheel.traces.encoding import HASH, ID, JSON_COLUMNS, KEY, TRACE_COLUMNS, NotJSON, feedback_row
from flywheel.traces.results import (
    IdempotencyConflict,
    IngestResult,
    InvalidRecord,
    RecordResult,
    StoredFeedback,
    StoredTrace,
    StoredVerifier,
    TraceNotFound,
    TraceStats,
    TraceStoreBusy,
)
from flywheel.traces.schema import FeedbackIn, describe
from flywheel.traces.tables import DEFAULT_TENANT, FeedbackRow, TraceRow

_TRACES = TraceRow.__table__
INSERT_COLUMNS = (*TRACE_COLUMNS, "tenant")  # a stored row: the prepared row, then its tenant
_FEEDBACK = FeedbackRow.__table__
_RACE_RETRIES = 5
WRITE_WAIT_S = 30.0  # the longest a writer queues behind this process's others (SQLite's busy_timeout too)
_IN_CHUNK = 500  # values per IN (...) list


def _chunks(items: list, size: int = _IN_CHUNK) -> Iterator[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


class TraceStore(Closing):
    """Traces and feedback in SQLite (default ./flywheel-data/traces.db) or any SQLAlchemy URL.

    Safe to share between threads; several processes may open the same SQLite file.
    """

    def __init__(self, url: str | None = None, *, default_source: str = "unknown"):
        self.engine = open_engine(url)
        try:
            ensure_schema(self.engine)
        except BaseException:
            self.engine.dispose()
            raise
        self.url = self.engine.url.render_as_string(hide_password=True)
        self.default_source = default_source
        self._sqlite = _SqliteTraceSQL(self.engine) if self.engine.dialect.name == "sqlite" else None
        # This process's writers queue here, handed the turn as soon as it is free; on SQLite
        # they would otherwise meet at BEGIN IMMEDIATE and poll in the busy handler's sleeps.
        self._write_lock = threading.Lock()

    def close(self) -> None:
        self.engine.dispose()

    # -- writing -------------------------------------------------------------------------

    def add_traces(self, records: Iterable[Any], *, source: str | None = None,
                   tenant: str = DEFAULT_TENANT) -> IngestResult:
        """Validate and store a batch for `tenant`; `source` is the default for records that name none."""
        return self.add_prepared(prepare_traces(records, source or self.default_source), tenant=tenant)

    def add_prepared(self, batch: PreparedBatch, *, tenant: str = DEFAULT_TENANT) -> IngestResult:
        """Store for `tenant` a batch that `flywheel.traces.batch` prepared (here or in another process)."""
        results: list[RecordResult | None] = [None] * batch.size
        for refused in batch.invalid:
            results[refused.index] = refused
        if batch.rows:
            self._retry_races(lambda conn: self._store_traces(conn, batch.rows, results, tenant))
        return IngestResult(results)  # type: ignore[arg-type]  # every slot is filled by now

    def _store_traces(self, conn, pending: list[tuple[int, tuple]], results: list, tenant: str) -> None:
        by_key: dict[str, tuple[str, str]] = {}  # the tenant's key -> (id, hash), stored or earlier in the batch
        taken_ids: set[str] = set()  # ids stored for any tenant
        keys = [row[KEY] for _, row in pending]
        ids = [row[ID] for _, row in pending]
        t = _TRACES.c
        for key_chunk, id_chunk in zip(_chunks(keys), _chunks(ids)):
            if self._sqlite is not None:
                found = self._sqlite.taken(conn, tenant, key_chunk, id_chunk)
            else:
                found = conn.execute(
                    select(t.id, t.idempotency_key, t.content_hash, t.tenant)
                    .where(or_((t.tenant == tenant) & t.idempotency_key.in_(key_chunk), t.id.in_(id_chunk))))
            for trace_id, key, digest, owner in found:
                if owner == tenant:
                    by_key[key] = (trace_id, digest)
                taken_ids.add(trace_id)
        rows = []
        for index, row in pending:
            key, trace_id = row[KEY], row[ID]
            if key in by_key:
                stored_id, digest = by_key[key]
                if digest == row[HASH]:
                    results[index] = RecordResult(index, "duplicate", id=stored_id)
                else:
                    results[index] = RecordResult(
                        index, "conflict", reason=f"idempotency key {key!r} is already used by trace "
                                                  f"{stored_id!r} with different content")
            elif trace_id in taken_ids:
                results[index] = RecordResult(
                    index, "conflict", reason=f"id {trace_id!r} is taken: choose another id, or send none and "
                                              f"the store assigns one")
            else:
                by_key[key] = (trace_id, row[HASH])
                taken_ids.add(trace_id)
                rows.append((*row, tenant))
                results[index] = RecordResult(index, "added", id=trace_id)
        if rows:
            if self._sqlite is not None:
                self._sqlite.insert(conn, rows)
            else:  # one executemany; Encoded: the JSON serializer passes the text through
                conn.execute(insert(_TRACES), [
                    {name: Encoded(value) if name in JSON_COLUMNS and value is not None else value
                     for name, value in zip(INSERT_COLUMNS, row)} for row in rows])

    def add_feedback(self, trace_id: str, feedback: FeedbackIn | dict[str, Any], *,
                     tenant: str = DEFAULT_TENANT) -> str:
        """Store one outcome of one of `tenant`'s traces and return its id (the stored one for a
        retry); TraceNotFound when the tenant has no such trace."""
        try:
            fb, row = feedback_row(trace_id, feedback, tenant)
        except ValidationError as e:
            raise InvalidRecord(f"feedback: {describe(e)}") from None
        except NotJSON as e:
            raise InvalidRecord(f"feedback: {e}") from None
        except OverflowError:  # e.g. 0001-01-01T00:00:00+01:00 is before year 1 in UTC
            raise InvalidRecord("feedback: created_at: out of range once converted to UTC") from None
        digest = row["content_hash"]

        def store(conn) -> str:
            if conn.scalar(select(_TRACES.c.seq).where(_TRACES.c.id == trace_id,
                                                       _TRACES.c.tenant == tenant)) is None:
                raise TraceNotFound(f"no trace with id {trace_id!r}")
            if fb.idempotency_key is not None:
                found = conn.execute(select(_FEEDBACK.c.id, _FEEDBACK.c.content_hash)
                                     .where(_FEEDBACK.c.tenant == tenant,
                                            _FEEDBACK.c.idempotency_key == fb.idempotency_key)).first()
                if found is not None:
                    if found.content_hash == digest:
                        return found.id
                    raise IdempotencyConflict(f"idempotency key {fb.idempotency_key!r} is already used by "
                                              f"feedback {found.id!r} with different content")
            conn.execute(insert(_FEEDBACK), row)
            return row["id"]

        return self._retry_races(store)

    def _retry_races(self, work):
        # Bounded: a writer of another process may hold the database for long, and each one
        # queued here would otherwise wait its own busy_timeout after the one before it.
        if not self._write_lock.acquire(timeout=WRITE_WAIT_S):
            raise TraceStoreBusy(f"{self.url}: this process's other writers held the write turn for "
                                 f"{WRITE_WAIT_S:g} s; nothing was written, try again")
        try:
            for attempt in range(_RACE_RETRIES):
                try:
                    with writing(self.engine) as conn:
                        return work(conn)
                except IntegrityError:  # another writer took a key between our check and insert
                    if attempt == _RACE_RETRIES - 1:
                        raise
        finally:
            self._write_lock.release()

    # -- reading -------------------------------------------------------------------------

    def get(self, trace_id: str, *, tenant: str | None = None) -> StoredTrace:
        """The trace (of `tenant`, when given) with its feedback; TraceNotFound otherwise."""
        where = [_TRACES.c.id == trace_id] + ([] if tenant is None else [_TRACES.c.tenant == tenant])
        with self.engine.connect() as conn:
            row = conn.execute(select(_TRACES).where(*where)).first()
            if row is None:
                raise TraceNotFound(f"no trace with id {trace_id!r}")
            return _stored_trace(row, feedback_of(conn, [trace_id]).get(trace_id, []))

    def iter_traces(self, since: datetime | None = None, source: str | None = None,
                    with_feedback: bool | None = None, batch_size: int = 1000,
                    include_feedback: bool = True, after_seq: int = 0,
                    tenant: str | None = None, models: Sequence[str] | None = None) -> Iterator[StoredTrace]:
        """Traces in insertion order, `batch_size` rows per query; no transaction stays open between pages.

        since: created at or after (naive = UTC). with_feedback: True = only traces that have
        feedback, False = only those without, None = all. after_seq: resume after a trace's
        `seq` (a reader's cursor). tenant: only that tenant's; models: only those served as
        (or posted naming) one of these model names. Traces added while iterating are yielded when they sort
        after the current page. On SQLite seq follows commit order; on PostgreSQL a
        transaction may commit after a later seq was read, so a cursor there can skip it.
        """
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        where = _filters(since, source, with_feedback, tenant, models)
        last = after_seq
        while True:
            with self.engine.connect() as conn:
                rows = conn.execute(select(_TRACES).where(_TRACES.c.seq > last, *where)
                                    .order_by(_TRACES.c.seq).limit(batch_size)).all()
                feedback = feedback_of(conn, [r.id for r in rows]) if include_feedback and rows else {}
            for row in rows:
                yield _stored_trace(row, feedback.get(row.id, []))
            if len(rows) < batch_size:
                return
            last = rows[-1].seq

    def feedback_after(self, after_seq: int = 0, after_trace_seq: int = 0, batch_size: int = 5000,
                       tenant: str | None = None, models: Sequence[str] | None = None
                       ) -> Iterator[tuple[int, StoredFeedback]]:
        """(seq, feedback) of the feedback stored after feedback `after_seq`, on traces after
        trace `after_trace_seq`, in insertion order, `batch_size` rows per query: an
        incremental reader's feed (see loop/failure_counter.py); tenant: only feedback on
        that tenant's traces; models: only on traces of these model names. Same caveat as `iter_traces`'s
        cursor on PostgreSQL."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        f, t = _FEEDBACK, _TRACES
        last = after_seq
        while True:
            query = select(f).where(f.c.seq > last, *([] if tenant is None else [f.c.tenant == tenant]))
            if after_trace_seq or models is not None:  # walks the feedback by seq, one trace lookup per row
                query = query.join(t, t.c.id == f.c.trace_id).where(t.c.seq > after_trace_seq)
                if models is not None:
                    query = query.where(t.c.model.in_(list(models)))
            with self.engine.connect() as conn:
                rows = conn.execute(query.order_by(f.c.seq).limit(batch_size)).all()
            for row in rows:
                yield row.seq, _stored_feedback(row)
            if len(rows) < batch_size:
                return
            last = rows[-1].seq

    def max_seq(self) -> int:
        """The newest trace's seq (0 when empty): a cursor covering every trace stored so far."""
        with self.engine.connect() as conn:
            return int(conn.scalar(select(func.max(_TRACES.c.seq))) or 0)

    def count(self, since: datetime | None = None, source: str | None = None,
              with_feedback: bool | None = None, tenant: str | None = None,
              models: Sequence[str] | None = None) -> int:
        with self.engine.connect() as conn:
            return conn.scalar(select(func.count()).select_from(_TRACES)
                               .where(*_filters(since, source, with_feedback, tenant, models)))

    def stats(self) -> TraceStats:
        t, f = _TRACES, _FEEDBACK
        with self.engine.connect() as conn:
            n, first, last, prompt, completion = conn.execute(select(
                func.count(), func.min(t.c.created_at), func.max(t.c.created_at),
                func.coalesce(func.sum(t.c.prompt_tokens), 0), func.coalesce(func.sum(t.c.completion_tokens), 0))).one()
            return TraceStats(
                url=self.url,
                schema_revision=schema_revision(conn),
                traces=n,
                feedback=conn.scalar(select(func.count()).select_from(f)),
                traces_with_feedback=conn.scalar(select(func.count(func.distinct(f.c.trace_id)))),
                by_source=dict(conn.execute(select(t.c.source, func.count()).group_by(t.c.source)
                                            .order_by(func.count().desc(), t.c.source)).all()),
                by_model={m or "": c for m, c in conn.execute(
                    select(t.c.model, func.count()).group_by(t.c.model).order_by(func.count().desc(), t.c.model))},
                prompt_tokens=int(prompt),
                completion_tokens=int(completion),
                first=utc_aware(first) if first else None,
                last=utc_aware(last) if last else None,
            )


class _SqliteTraceSQL:
    """The two statements of a trace batch on SQLite, run through the driver directly.

    What SQLAlchemy Core does per row of an executemany (building each parameter dict,
    running each column's bind processor through its generic machinery) costs as much as
    SQLite's own insert of a trace row. Here the INSERT is compiled once by SQLAlchemy (same
    SQL, same column order) and each row gets the same bind processors (float coercion, and
    datetime formatting by `datetime.isoformat`, a large share of the processor's cost, where it
    writes the same text: checked at start-up). A prepared row's JSON columns are canonical
    JSON text already, which is exactly what the JSON processor would return for them.

    Rows go in as multi-row `INSERT ... VALUES (...), (...), ...` statements (as many rows as
    SQLite's variable limit allows): one statement step per chunk instead of one per row.
    The driver releases the GIL around each step, and a thread that has to take it back
    from busy threads waits up to the interpreter's switch interval (5 ms) each time: with
    concurrent batches (other requests validating), a 500-row executemany can stall that
    way for a long time while it holds the database's write lock.
    """

    def __init__(self, engine):
        dialect = engine.dialect
        columns = [c for c in _TRACES.columns if c.key != "seq"]  # the table's order: INSERT_COLUMNS
        compiled = insert(_TRACES).compile(dialect=dialect, column_keys=[c.key for c in columns])
        head, _, row = str(compiled).partition(" VALUES ")
        self._insert_head, self._insert_row = head + " VALUES ", row  # "INSERT INTO traces (...)", "(?, ...)"
        self._insert_sql: dict[int, str] = {}  # rows per statement -> its SQL
        order = compiled.positiontup
        if tuple(order) != INSERT_COLUMNS:  # a row's values go in as they are: the orders must agree
            raise RuntimeError(f"the traces INSERT takes {order}, stored rows hold {INSERT_COLUMNS}")
        self.width = len(order)
        with engine.connect() as conn:
            dbapi = conn.connection.dbapi_connection
            limit = dbapi.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER) if hasattr(dbapi, "getlimit") else 999
        self.rows_per_statement = max(1, min(500, limit // self.width))
        by_key = {c.key: c for c in columns}
        self.processed: list[tuple[int, Any]] = []  # (position, bind processor) of non-JSON columns that have one
        for position, key in enumerate(order):
            col = by_key[key]
            process = col.type.dialect_impl(dialect).bind_processor(dialect)
            if isinstance(col.type, DateTime) and _writes_like(process, _iso_datetime):
                process = _iso_datetime
            if process is not None and not isinstance(col.type, JSON):
                self.processed.append((position, process))
        self.select_sql = ("SELECT id, idempotency_key, content_hash, tenant FROM traces "
                           "WHERE (tenant = ? AND idempotency_key IN ({})) OR id IN ({})")

    def taken(self, conn, tenant: str, keys: list[str], ids: list[str]):
        sql = self.select_sql.format(",".join("?" * len(keys)), ",".join("?" * len(ids)))
        return conn.exec_driver_sql(sql, (tenant, *keys, *ids)).all()

    def insert(self, conn, rows: list[tuple]) -> None:
        params: list = []
        processed = self.processed
        for row in rows:
            base = len(params)
            params += row
            for position, process in processed:
                value = row[position]
                if value is not None:
                    params[base + position] = process(value)
        width, step = self.width, self.rows_per_statement
        for start in range(0, len(rows), step):
            n = min(step, len(rows) - start)
            sql = self._insert_sql.get(n)
            if sql is None:
                sql = self._insert_sql[n] = self._insert_head + ", ".join([self._insert_row] * n)
            conn.exec_driver_sql(sql, tuple(params[start * width:(start + n) * width]))


def _iso_datetime(value: datetime) -> str:
    return value.isoformat(" ", "microseconds")


def _writes_like(process, fast) -> bool:
    samples = (datetime(2025, 1, 2, 3, 4, 5), datetime(1999, 12, 31, 23, 59, 59, 999_999),
               datetime(987, 6, 5, 4, 3, 2, 1))
    return process is not None and all(process(t) == fast(t) for t in samples)


def _filters(since: datetime | None, source: str | None, with_feedback: bool | None,
             tenant: str | None = None, models: Sequence[str] | None = None) -> list:
    where = [] if tenant is None else [_TRACES.c.tenant == tenant]
    if models is not None:
        where.append(_TRACES.c.model.in_(list(models)))
    if since is not None:
        where.append(_TRACES.c.created_at >= utc_naive(since))
    if source is not None:
        where.append(_TRACES.c.source == source)
    if with_feedback is not None:
        has = exists().where(_FEEDBACK.c.trace_id == _TRACES.c.id)
        where.append(has if with_feedback else ~has)
    return where


def feedback_of(conn, trace_ids: list[str]) -> dict[str, list[StoredFeedback]]:
    """Trace id -> its feedback in stored order, on an open connection (the dashboard reads
    with it too, so feedback is read one way wherever a verdict is taken from it)."""
    out: dict[str, list[StoredFeedback]] = {}
    for chunk in _chunks(trace_ids):
        for row in conn.execute(select(_FEEDBACK).where(_FEEDBACK.c.trace_id.in_(chunk)).order_by(_FEEDBACK.c.seq)):
            out.setdefault(row.trace_id, []).append(_stored_feedback(row))
    return out


def _stored_feedback(row) -> StoredFeedback:
    return StoredFeedback(
        id=row.id, trace_id=row.trace_id, created_at=utc_aware(row.created_at), idempotency_key=row.idempotency_key,
        score=row.score, label=row.label, correction=row.correction, text=row.text,
        verifier=StoredVerifier(row.verifier_env, row.verifier_task) if row.verifier_env is not None else None,
        source=row.source)


def _stored_trace(row, feedback: list[StoredFeedback]) -> StoredTrace:
    return StoredTrace(
        id=row.id, seq=row.seq, idempotency_key=row.idempotency_key, created_at=utc_aware(row.created_at),
        source=row.source, messages=[] if isinstance(row.messages, str) else row.messages,
        prompt=row.messages if isinstance(row.messages, str) else None, model=row.model, model_version=row.model_version,
        tools=row.tools, response=row.response, usage=row.usage, latency_ms=row.latency_ms,
        metadata=row.metadata or {}, feedback=feedback, tenant=row.tenant)
