"""The fine-tuning service's tables (SQLAlchemy 2 ORM, typed `Mapped[...]`): uploaded files,
jobs, their events and their checkpoints, managed flywheels and their cycles, each owned by a
tenant.

`seq` is an integer primary key in insertion order (keyset pagination: `after=<id>` pages by
the seq of that id); `id` is the public, OpenAI-shaped identifier (`file-…`, `ftjob-…`,
`ftevent-…`, `ftckpt-…`). Times are naive UTC. A job's claim is `worker` + `lease_until`: a
worker owns a running job while its lease is in the future and renews it by heartbeat; an
expired lease lets another worker claim the job and resume it from its last checkpoint
(`attempts` counts the claims). `control` is what a client asked of a running job
(`cancel`, `pause`), read by its worker at the next heartbeat. A POST retried with the same
`Idempotency-Key` finds its object by (tenant, idempotency_key); `request_hash` tells a retry
from a different request reusing the key.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import DateTime, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column  # a change here is a migration: flywheel/migrations

from flywheel.database import Base, json_column
from flywheel.migrations import Schema

class FileRow(Base):
    __tablename__ = "ft_files"
    __table_args__ = (UniqueConstraint("tenant", "idempotency_key"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    purpose: Mapped[str] = mapped_column(String(50))
    filename: Mapped[str] = mapped_column(String(500))
    bytes: Mapped[int] = mapped_column(Integer)
    lines: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # the client's Idempotency-Key header and the SHA-256 of what it sent: a retry gets the same object
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))


class JobRow(Base):
    __tablename__ = "ft_jobs"
    __table_args__ = (Index("ft_jobs_queue", "status", "seq"), UniqueConstraint("tenant", "idempotency_key"))

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    model: Mapped[str] = mapped_column(String(300))
    method: Mapped[dict[str, Any]] = mapped_column(json_column(), nullable=False)  # {"type", "<type>": {...}}
    training_file: Mapped[str | None] = mapped_column(String(64))  # None: a flywheel cycle (it curates its own)
    validation_file: Mapped[str | None] = mapped_column(String(64))
    suffix: Mapped[str | None] = mapped_column(String(64))
    seed: Mapped[int] = mapped_column(Integer)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", json_column())  # rows read back key it "metadata"
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(400), unique=True)
    model_path: Mapped[str | None] = mapped_column(Text)  # the fine-tuned model's folder
    model_deleted_at: Mapped[datetime | None] = mapped_column(DateTime)  # DELETE /v1/models/{id}: gone from listings
    error: Mapped[dict[str, Any] | None] = mapped_column(json_column())  # {"code", "message", "param"}
    trained_tokens: Mapped[int | None] = mapped_column(Integer)
    estimated_cost: Mapped[float | None] = mapped_column()
    control: Mapped[str | None] = mapped_column(String(16))  # "cancel" | "pause", asked of a running job
    worker: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[datetime | None] = mapped_column(DateTime)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))


class EventRow(Base):
    __tablename__ = "ft_events"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("ft_jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    level: Mapped[str] = mapped_column(String(10))  # info | warn | error
    type: Mapped[str] = mapped_column(String(10))  # message | metrics
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(json_column())


class CheckpointRow(Base):
    __tablename__ = "ft_checkpoints"

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("ft_jobs.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    step: Mapped[int] = mapped_column(Integer)
    metrics: Mapped[dict[str, Any]] = mapped_column(json_column(), nullable=False)
    fine_tuned_model_checkpoint: Mapped[str] = mapped_column(String(400), unique=True)
    path: Mapped[str] = mapped_column(Text)


PREFIX_CHARS = 8  # of a key, kept to tell keys apart in listings


class KeyRow(Base):
    """An API key of a tenant: its SHA-256, never the key (jobs/keys.py)."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(PREFIX_CHARS))
    name: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime)


class WebhookRow(Base):
    """Where a tenant wants its jobs' terminal states POSTed, signed with `secret`
    (Standard Webhooks: HMAC-SHA256; jobs/webhooks.py)."""

    __tablename__ = "webhook_endpoints"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    url: Mapped[str] = mapped_column(Text)
    secret: Mapped[str] = mapped_column(String(100))
    events: Mapped[list[str]] = mapped_column(json_column(), nullable=False)
    created_at: Mapped[datetime] = mapped_column(DateTime)


class FlywheelRow(Base):
    """A tenant's managed flywheel (finetuning/managed_flywheels.py): its checked request (`spec`), where
    its loop state lives (`data_dir`: registry, cycles, ledger) and where its traces do
    (`traces_url`), and what its production alias serves now. `generation` grows at every
    change of production (a promotion, a rollback), so a server polling it switches once per
    change; `cursor` is the trace seq after which failures count towards the next trigger."""

    __tablename__ = "ft_flywheels"
    __table_args__ = (UniqueConstraint("tenant", "idempotency_key"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    model: Mapped[str] = mapped_column(String(400))  # the model it started from
    suffix: Mapped[str] = mapped_column(String(64))
    alias: Mapped[str] = mapped_column(String(500), unique=True)  # ft:<model>:<tenant>:<suffix>:production
    spec: Mapped[dict[str, Any]] = mapped_column(json_column(), nullable=False)
    data_dir: Mapped[str] = mapped_column(Text)
    traces_url: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16))  # active | paused
    production_model: Mapped[str] = mapped_column(String(400))  # the model name the alias serves now
    production_version: Mapped[str] = mapped_column(String(32))  # its version in the flywheel's registry
    generation: Mapped[int] = mapped_column(Integer, default=0)
    cursor: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    meta: Mapped[dict[str, Any] | None] = mapped_column("metadata", json_column())
    idempotency_key: Mapped[str | None] = mapped_column(String(255))
    request_hash: Mapped[str | None] = mapped_column(String(64))


class FlywheelCycleRow(Base):
    """One cycle of a managed flywheel, run as the fine-tuning job `job_id`: why it started,
    and once decided the gate's decision, the models' scores, its cost and the version it
    registered."""

    __tablename__ = "ft_flywheel_cycles"
    __table_args__ = (UniqueConstraint("flywheel_id", "number"),)

    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True)
    flywheel_id: Mapped[str] = mapped_column(ForeignKey("ft_flywheels.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    job_id: Mapped[str] = mapped_column(ForeignKey("ft_jobs.id", ondelete="CASCADE"), index=True)
    reason: Mapped[str] = mapped_column(Text)
    outcome: Mapped[str | None] = mapped_column(String(64))  # promoted | rejected | waiting ... (None: not decided)
    decision: Mapped[dict[str, Any] | None] = mapped_column(json_column())
    scores: Mapped[dict[str, Any] | None] = mapped_column(json_column())
    new_failures: Mapped[int | None] = mapped_column(Integer)
    trace_cursor: Mapped[int | None] = mapped_column(Integer)
    usd: Mapped[float | None] = mapped_column()
    version: Mapped[str | None] = mapped_column(String(32))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)


TABLES = [FileRow.__table__, JobRow.__table__, EventRow.__table__, CheckpointRow.__table__, KeyRow.__table__,
          WebhookRow.__table__, FlywheelRow.__table__, FlywheelCycleRow.__table__]
SCHEMA = Schema("jobs", Path(__file__).resolve().parent / "migrations", tuple(TABLES), lock_key=7_311_999)
