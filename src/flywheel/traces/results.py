"""What the trace store hands back: per-record batch outcomes, stored traces and feedback, stats, errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

__all__ = ["IdempotencyConflict", "IngestResult", "InvalidRecord", "RecordResult", "StoredFeedback", "StoredTrace",
           "StoredVerifier", "TraceNotFound", "TraceStats", "TraceStoreBusy", "TraceStoreError"]

Status = Literal["added", "duplicate", "invalid", "conflict"]


class TraceStoreError(ValueError):
    """A request the store refuses; the message says why."""


class TraceNotFound(TraceStoreError):
    pass


class TraceStoreBusy(RuntimeError):
    """The store's other writers in this process held the write turn too long: try again later."""


class InvalidRecord(TraceStoreError):
    pass


class IdempotencyConflict(TraceStoreError):
    """The idempotency key (or client id) is already taken by different content."""


@dataclass(frozen=True)
class RecordResult:
    """The fate of record `index` of a batch.

    added: stored now. duplicate: a retry of a stored record (same key, same content); `id`
    is the stored one. invalid: refused by validation. conflict: its key or id already
    belongs to other content. `reason` explains the last two.
    """

    index: int
    status: Status
    id: str | None = None
    reason: str | None = None

    @property
    def accepted(self) -> bool:
        return self.status in ("added", "duplicate")

    def __str__(self) -> str:
        return f"record {self.index}: {self.reason or self.status}"


@dataclass(frozen=True)
class IngestResult:
    results: list[RecordResult]

    @property
    def ids(self) -> list[str | None]:
        """The stored id of each record, None where it was rejected."""
        return [r.id if r.accepted else None for r in self.results]

    @property
    def added(self) -> int:
        return sum(r.status == "added" for r in self.results)

    @property
    def duplicates(self) -> int:
        return sum(r.status == "duplicate" for r in self.results)

    @property
    def rejected(self) -> list[RecordResult]:
        return [r for r in self.results if not r.accepted]

    @property
    def ok(self) -> bool:
        return not self.rejected


@dataclass(frozen=True)
class StoredVerifier:
    env: str
    task: dict[str, Any]


@dataclass(frozen=True)
class StoredFeedback:
    id: str
    trace_id: str
    created_at: datetime  # UTC, aware
    idempotency_key: str | None = None
    score: float | None = None
    label: str | None = None
    correction: dict[str, Any] | None = None
    text: str | None = None
    verifier: StoredVerifier | None = None
    source: str = "user"  # "user" or "judge" (traces/schema.py FeedbackIn.source)


@dataclass(frozen=True)
class StoredTrace:
    id: str
    seq: int  # insertion order; a cursor for readers
    idempotency_key: str
    created_at: datetime  # UTC, aware
    source: str
    messages: list[dict[str, Any]]  # a chat trace's; [] for a raw completion
    prompt: str | None = None  # a raw completion's prompt, as served (no chat template)
    model: str | None = None
    model_version: str | None = None
    tools: list[dict[str, Any]] | None = None
    response: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    latency_ms: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    feedback: list[StoredFeedback] = field(default_factory=list)
    tenant: str = "default"  # who stored it (the API key's tenant)


@dataclass(frozen=True)
class TraceStats:
    url: str
    schema_revision: str  # the Alembic revision of the trace schema
    traces: int
    feedback: int
    traces_with_feedback: int
    by_source: dict[str, int]
    by_model: dict[str, int]
    prompt_tokens: int
    completion_tokens: int
    first: datetime | None
    last: datetime | None
