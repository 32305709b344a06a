"""The trace store's tables (SQLAlchemy 2 ORM, typed `Mapped[...]`).

`seq` is an integer primary key in insertion order: readers page through traces by it
(keyset pagination) and a later stage can keep it as a cursor. `id` is the public,
client-visible identifier. `content_hash` is the SHA-256 of the record as the client sent
it (minus its idempotency key), which decides whether a retry is a no-op or a conflict.
Every trace and feedback row is owned by a `tenant` (the API key's, on a server with keys);
idempotency keys are unique per tenant, ids across the store.
Times are stored as naive UTC. The declarative base, the JSON column type and the
`flywheel_meta` table are flywheel's shared ones (`flywheel.database`).
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column, relationship

from flywheel.database import Base, json_column
from flywheel.migrations import Schema

DEFAULT_TENANT = "default"  # a single-tenant server's, and every trace stored before tenants


class TraceRow(Base):
    __tablename__ = "traces"
    __table_args__ = (UniqueConstraint("tenant", "idempotency_key", name="uq_traces_tenant_idempotency_key"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(128), unique=True)
    idempotency_key: Mapped[str] = mapped_column(String(255))
    content_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    source: Mapped[str] = mapped_column(String(200), index=True)
    model: Mapped[str | None] = mapped_column(String(200))
    model_version: Mapped[str | None] = mapped_column(String(200))
    # a chat trace's message list, or a raw-completion trace's prompt as a JSON string
    messages: Mapped[list[dict[str, Any]] | str] = mapped_column(json_column(), nullable=False)
    tools: Mapped[list[dict[str, Any]] | None] = mapped_column(json_column())
    response: Mapped[dict[str, Any] | None] = mapped_column(json_column())
    usage: Mapped[dict[str, Any] | None] = mapped_column(json_column())
    # usage's two counts again as columns, so token totals are a SUM, not a JSON scan
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    latency_ms: Mapped[float | None] = mapped_column(Float)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", json_column())
    tenant: Mapped[str] = mapped_column(String(200), index=True, server_default=DEFAULT_TENANT)

    feedback: Mapped[list[FeedbackRow]] = relationship(
        back_populates="trace", order_by="FeedbackRow.seq", cascade="all, delete-orphan", passive_deletes=True)


class FeedbackRow(Base):
    __tablename__ = "trace_feedback"
    __table_args__ = (UniqueConstraint("tenant", "idempotency_key", name="uq_trace_feedback_tenant_idempotency_key"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(128), unique=True)
    trace_id: Mapped[str] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    content_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    score: Mapped[float | None] = mapped_column(Float)
    label: Mapped[str | None] = mapped_column(String(200), index=True)
    correction: Mapped[dict[str, Any] | None] = mapped_column(json_column())
    text: Mapped[str | None] = mapped_column(Text)
    verifier_env: Mapped[str | None] = mapped_column(String(200), index=True)
    verifier_task: Mapped[dict[str, Any] | None] = mapped_column(json_column())
    tenant: Mapped[str] = mapped_column(String(200), server_default=DEFAULT_TENANT)  # its trace's
    # "user" or "judge" (schema.FEEDBACK_SOURCES); rows stored before judges existed are "user"
    source: Mapped[str] = mapped_column(String(20), server_default="user")

    trace: Mapped[TraceRow] = relationship(back_populates="feedback")


SCHEMA = Schema("traces", Path(__file__).resolve().parent / "migrations", (TraceRow.__table__, FeedbackRow.__table__),
                lock_key=7_312_000, legacy_key="traces.schema_version")
