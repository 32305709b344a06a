"""The SDK's typed objects: what the server's JSON answers hold, as frozen dataclasses.
`from_json` keeps the fields a class names and ignores others, so a server that grows a field
does not break an older client; `raw` keeps the whole answer."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T", bound="_Object")


@dataclass(frozen=True)
class _Object:
    raw: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_json(cls: type[T], data: dict[str, Any]) -> T:
        names = {f.name for f in fields(cls)} - {"raw"}
        return cls(raw=data, **{k: data.get(k) for k in names})


@dataclass(frozen=True)
class File(_Object):
    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int


@dataclass(frozen=True)
class Job(_Object):
    id: str
    model: str
    status: str
    training_file: str
    validation_file: str | None
    fine_tuned_model: str | None
    hyperparameters: dict[str, Any]
    method: dict[str, Any]
    error: dict[str, Any] | None
    trained_tokens: int | None
    created_at: int
    finished_at: int | None
    usage: dict[str, Any] | None

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class JobEvent(_Object):
    id: str
    created_at: int
    level: str
    type: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Checkpoint(_Object):
    id: str
    step_number: int
    fine_tuned_model_checkpoint: str
    metrics: dict[str, Any]
    created_at: int


@dataclass(frozen=True)
class Model(_Object):
    id: str
    owned_by: str
    created: int


@dataclass(frozen=True)
class ManagedFlywheel(_Object):
    """A managed flywheel (`flywheel` object): the model it started from, the production alias
    its clients call (`production_model`), what serves it now (`production`: model, version,
    generation) and its settings as the server keeps them, defaults filled in."""

    id: str
    created_at: int
    model: str
    suffix: str
    status: str
    organization_id: str
    production_model: str
    production: dict[str, Any]
    traces: dict[str, Any]
    training: dict[str, Any]
    curation: dict[str, Any]
    eval: dict[str, Any]
    gate: dict[str, Any]
    trigger: dict[str, Any]
    budget_usd: float | None
    metadata: dict[str, str] | None

    @property
    def production_version(self) -> str:
        return self.production["version"]


@dataclass(frozen=True)
class FlywheelCycle(_Object):
    """One cycle of a managed flywheel (`flywheel.cycle`): the fine-tuning job that runs it
    (`status` is that job's), why it started, and once decided the gate's decision, both
    models' scores, the version it registered and what it cost."""

    id: str
    flywheel_id: str
    number: int
    fine_tuning_job_id: str
    status: str
    reason: str
    outcome: str | None
    promoted: bool
    decision: dict[str, Any] | None
    scores: dict[str, Any] | None
    new_failures: int | None
    trace_cursor: int | None
    version: str | None
    fine_tuned_model: str | None
    error: dict[str, Any] | None
    estimated_cost: float | None
    created_at: int
    finished_at: int | None

    @property
    def done(self) -> bool:
        return self.status in ("succeeded", "failed", "cancelled")

    @property
    def reasons(self) -> list[str]:
        """The gate's reasons (none until the cycle is decided)."""
        return list((self.decision or {}).get("reasons") or [])
