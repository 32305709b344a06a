"""The trace store's tables (SQLAlchemy 2 ORM, typed `Mapped[...]`).

`seq` is an integer primary key in insertion order: readers page through traces by it
(keyset pagination) and a later stage can keep it as a cursor. `id` is the public,
client-visible identifier. `content_hash` is the SHA-256 of the record as the client sent
it (minus its idempotency key), which decides whether a retry is a no-op or a conflict.
Times are stored as naive UTC. The declarative base, the JSON column type and the
`flywheel_meta` table are flywheel's shared ones (`flywheel.database`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from flywheel.database import Base, json_column

SCHEMA_VERSION = 1
SCHEMA_VERSION_KEY = "traces.schema_version"


class TraceRow(Base):
    __tablename__ = "traces"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(128), unique=True)
    idempotency_key: Mapped[str] = mapped_column(String(255), unique=True)
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

    feedback: Mapped[list[FeedbackRow]] = relationship(
        back_populates="trace", order_by="FeedbackRow.seq", cascade="all, delete-orphan", passive_deletes=True)


class FeedbackRow(Base):
    __tablename__ = "trace_feedback"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(128), unique=True)
    trace_id: Mapped[str] = mapped_column(ForeignKey("traces.id", ondelete="CASCADE"), index=True)
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    content_hash: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    score: Mapped[float | None] = mapped_column(Float)
    label: Mapped[str | None] = mapped_column(String(200), index=True)
    correction: Mapped[dict[str, Any] | None] = mapped_column(json_column())
    text: Mapped[str | None] = mapped_column(Text)
    verifier_env: Mapped[str | None] = mapped_column(String(200), index=True)
    verifier_task: Mapped[dict[str, Any] | None] = mapped_column(json_column())

    trace: Mapped[TraceRow] = relationship(back_populates="feedback")
