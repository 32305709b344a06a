"""The dashboard's JSON answers (GET /v1/dashboard/summary, GET /v1/dashboard/jobs/{id}), as
pydantic models: serve/dashboard/data.py builds them, serve/openapi.py documents them.

Times are unix seconds; money is US dollars; "points" are accuracy percentage points (a
cycle's gain on its new-failure suite, candidate minus incumbent, times 100). A series is a
list of `[x, y]` pairs: `[step, value]` for training metrics, `[unix minute, count]` for
traffic.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Point = tuple[float, float]  # [x, y]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TrafficGroup(_Out):
    """The requests of one family or environment (or, failing both, one model)."""

    name: str
    kind: Literal["family", "env", "model"] = Field(description=(
        "where the name came from: the trace's metadata `family`, else its `env` / `environment` (or the "
        "request's metadata's), else the environment of its newest verifier; else the model it was served as"))
    requests: int
    passes: int
    failures: int
    failure_rate: float | None = Field(description="failures / judged (passes + failures); null when none judged")


class ServingCost(_Out):
    usd_per_million_tokens: float | None = Field(description="null when no served request with a latency is known")
    basis: Literal["estimate"] = Field(description=(
        "the server keeps no serving ledger: the catalog's price of `hardware` times the seconds this tenant's "
        "requests were in flight (the union of their intervals), over their prompt + completion tokens"))
    hardware: str | None
    usd_per_hour: float | None
    busy_seconds: float
    tokens: int
    note: str


class Traffic(_Out):
    available: bool = Field(description="false when the server keeps no trace store")
    requests: int = Field(description="every trace of this tenant")
    with_feedback: int
    prompt_tokens: int
    completion_tokens: int
    window: int = Field(description="the newest traces judged below (outcomes, groups, per_minute, cost)")
    outcomes: dict[str, int] = Field(description="pass, fail, neutral, unknown: each trace's newest verdict "
                                                 "(loop/curation_rules.py outcome, under the server's curation rules)")
    groups: list[TrafficGroup]
    models: dict[str, int] = Field(description="traces per model name (of the window)")
    per_minute: list[Point] = Field(description="[unix minute, requests] over the last 30 minutes")
    failures_per_minute: list[Point]
    cost: ServingCost


class TrainingCost(_Out):
    usd: float
    tokens: int
    usd_per_million_tokens: float | None
    jobs: int = Field(description="finished fine-tuning jobs (cycles included) with a recorded cost")
    note: str


class CycleView(_Out):
    number: int
    job_id: str
    status: str = Field(description="its job's status")
    reason: str = Field(description="why it started")
    outcome: str | None
    promote: bool | None = Field(description="the gate's decision; null until decided")
    reasons: list[str] = Field(description="the gate's reasons")
    gain_points: float | None
    usd: float | None
    points_per_usd: float | None = Field(description="realised points (the gain if promoted, else 0) per dollar")
    version: str | None
    fine_tuned_model: str | None
    created_at: int | None
    finished_at: int | None


class FlywheelView(_Out):
    id: str
    alias: str
    model: str
    status: str
    production_model: str
    production_version: str
    generation: int = Field(description="production changes so far: promotions plus rollbacks")
    promotions: int
    rollbacks: int = Field(description="generation minus promotions: every other change is a rollback")
    usd: float
    points: float
    points_per_usd: float | None
    cycles: list[CycleView] = Field(description="newest first")


class JobView(_Out):
    id: str
    status: str
    method: str
    model: str
    fine_tuned_model: str | None
    flywheel_id: str | None
    cycle: int | None
    created_at: int | None
    finished_at: int | None
    trained_tokens: int | None
    estimated_cost: float | None
    last_metrics: dict[str, float] = Field(description="the newest metrics event's numbers")


class LiveJob(_Out):
    job_id: str
    status: str
    series: dict[str, list[Point]] = Field(description="metric name -> [step, value]")


class DashboardSummary(_Out):
    """Everything the dashboard's front page shows, for the caller's tenant only."""

    object: Literal["dashboard.summary"]
    tenant: str
    generated_at: int
    traffic: Traffic
    training_cost: TrainingCost
    flywheels: list[FlywheelView]
    jobs: list[JobView] = Field(description="newest first, at most 50")
    live: list[LiveJob] = Field(description="the running jobs' training metrics (else the newest job's)")


class EventView(_Out):
    id: str
    created_at: int | None
    level: str
    type: str
    message: str
    data: dict[str, Any]


class CheckpointView(_Out):
    id: str
    step: int
    fine_tuned_model_checkpoint: str
    metrics: dict[str, Any]


class DashboardJob(_Out):
    """One job: its row, events, training metrics as series, checkpoints and (a cycle's job) its cycle."""

    object: Literal["dashboard.job"]
    job: JobView
    events: list[EventView] = Field(description="oldest first, the newest 200")
    series: dict[str, list[Point]] = Field(description="metric name -> [step, value], from its metrics events")
    checkpoints: list[CheckpointView]
    cycle: CycleView | None
