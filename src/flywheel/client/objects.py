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
