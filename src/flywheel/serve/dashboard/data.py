"""What the dashboard shows, for one tenant, read from the stores (no FastAPI here: the routes
in serve/dashboard/routes.py are thin over `summary` and `job_detail`).

- traffic: serve/dashboard/traffic.py (the trace store);
- the loop: each managed flywheel (jobs/flywheels.py) with its cycles, newest first: the
  gate's decision and reasons, the cycle's cost, its gain in points and realised points per
  dollar (economics/reports.py `intelligence_per_dollar`: the gain if promoted, else 0);
  promotions are the promoted cycles, rollbacks every other production change (the
  flywheel's `generation` counts them all);
- jobs: the tenant's fine-tuning jobs (cycles included), each with its newest metrics;
- live charts: the `metrics` events the worker writes while a job trains (worker/job_worker.py
  JobProgress: step, train_loss, train_reward_mean; any other number an event carries is
  charted too), as `[step, value]` series per metric name.

Every read names the tenant: another tenant's job is `NotFound`, as in the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import Field
from sqlalchemy import func, select

from flywheel.config import Config
from flywheel.economics.reports import intelligence_per_dollar, per_million
from flywheel.jobs.flywheels import Flywheels
from flywheel.jobs.objects import unix
from flywheel.jobs.store import JobStore
from flywheel.jobs.tables import EventRow, JobRow
from flywheel.loop.curation_rules import CurationConfig
from flywheel.serve.dashboard.schemas import (CheckpointView, CycleView, DashboardJob, DashboardSummary, EventView,
                                              FlywheelView, JobView, LiveJob, TrainingCost)
from flywheel.serve.dashboard.traffic import no_traffic, traffic

NOT_METRICS = {"step", "total_steps"}  # keys of a metrics event's data that are not charted
FINISHED = ("succeeded", "failed", "cancelled")


class DashboardConfig(Config):
    hardware: str | None = Field("cpu-2core", description=(
        "the catalog entry serving is priced at (economics/hardware.yaml); None: no serving cost"))
    window: int = Field(2000, ge=1, description="newest traces judged for outcomes, groups and cost")
    jobs: int = Field(50, ge=1, le=1000, description="newest jobs listed")
    events: int = Field(200, ge=1, le=1000, description="newest events of a job")
    live_jobs: int = Field(3, ge=0, description="jobs charted live on the front page")
    points: int = Field(1000, ge=2, description="most points per series (longer series are thinned)")


@dataclass
class Sources:
    """The server's stores; None where the server has none."""

    traces: Any  # a TraceStore (its engine is read) or None
    curation: CurationConfig | None  # the trace routes' rules (None without a trace store)
    jobs: JobStore | None
    flywheels: Flywheels | None


def summary(src: Sources, tenant: str, cfg: DashboardConfig, now: datetime) -> DashboardSummary:
    """The front page for `tenant`; `now`: aware UTC."""
    panel = no_traffic() if src.traces is None else traffic(src.traces.engine, tenant, src.curation,
                                                             hardware=cfg.hardware, window=cfg.window, now=now)
    jobs = [] if src.jobs is None else src.jobs.list_jobs(tenant, limit=cfg.jobs)[0]
    views = job_views(src.jobs, jobs) if src.jobs is not None else []
    live = [] if src.jobs is None else live_jobs(src.jobs.engine, jobs, cfg)
    return DashboardSummary(object="dashboard.summary", tenant=tenant, generated_at=int(now.timestamp()),
                            traffic=panel, training_cost=training_cost(src.jobs, tenant),
                            flywheels=flywheel_views(src.flywheels, tenant), jobs=views, live=live)


# ---------------------------------------------------------------- the loop


def cycle_view(row: dict[str, Any]) -> CycleView:
    """A cycle row of `Flywheels.cycles` (with its job's status, model and cost)."""
    decision = row["decision"] or {}
    gain = decision.get("gain")
    gain_points = None if gain is None else 100.0 * gain
    usd = row["estimated_cost"] if row["estimated_cost"] is not None else row["usd"]
    decided = row["outcome"] is not None
    realised = (gain_points or 0.0) if row["outcome"] == "promoted" else 0.0
    ppd = intelligence_per_dollar(realised, usd).value if decided and usd else None
    return CycleView(number=row["number"], job_id=row["job_id"], status=row["job_status"], reason=row["reason"],
                     outcome=row["outcome"], promote=decision.get("promote") if decision else None,
                     reasons=[str(r) for r in decision.get("reasons", [])], gain_points=gain_points, usd=usd,
                     points_per_usd=ppd, version=row["version"], fine_tuned_model=row["fine_tuned_model"],
                     created_at=unix(row["created_at"]), finished_at=unix(row["finished_at"]))


def flywheel_views(store: Flywheels | None, tenant: str) -> list[FlywheelView]:
    if store is None:
        return []
    out = []
    for fw in store.list(tenant, limit=100)[0]:
        cycles = [cycle_view(r) for r in store.cycles(tenant, fw["id"])]
        promotions = sum(c.outcome == "promoted" for c in cycles)
        usd = sum(c.usd or 0.0 for c in cycles)
        points = sum(c.gain_points or 0.0 for c in cycles if c.outcome == "promoted")
        out.append(FlywheelView(
            id=fw["id"], alias=fw["alias"], model=fw["model"], status=fw["status"],
            production_model=fw["production_model"], production_version=fw["production_version"],
            generation=fw["generation"], promotions=promotions, rollbacks=max(0, fw["generation"] - promotions),
            usd=usd, points=points, points_per_usd=intelligence_per_dollar(points, usd).value if usd else None,
            cycles=cycles))
    return out


# ---------------------------------------------------------------- jobs and their metrics


def _job_view(row: dict[str, Any], last: dict[str, float]) -> JobView:
    method = row["method"]
    cycle = method.get("flywheel") if method["type"] == "flywheel" else None
    return JobView(id=row["id"], status=row["status"], method=method["type"], model=row["model"],
                   fine_tuned_model=row["fine_tuned_model"],
                   flywheel_id=cycle["flywheel_id"] if cycle else None, cycle=cycle["cycle"] if cycle else None,
                   created_at=unix(row["created_at"]), finished_at=unix(row["finished_at"]),
                   trained_tokens=row["trained_tokens"], estimated_cost=row["estimated_cost"], last_metrics=last)


# the numbers of a metrics event's `metrics` row (metrics.jsonl's, worker/job_worker.py) charted
# beside its train_loss and train_reward_mean: KL and throughput
CHARTED = ("kl_ref", "mismatch_kl", "tokens_per_s", "samples_per_s", "pairs_per_s")


def numbers(data: dict[str, Any] | None) -> dict[str, float]:
    """The charted numbers of a metrics event's data: its top-level numbers (booleans and
    NOT_METRICS left out) and those of its `metrics` row named in CHARTED."""
    data = data or {}
    row = data.get("metrics") if isinstance(data.get("metrics"), dict) else {}
    picked = {**{k: v for k, v in data.items() if k not in NOT_METRICS},
              **{k: row[k] for k in CHARTED if k in row}}
    return {k: float(v) for k, v in picked.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def job_views(jobs: JobStore, rows: list[dict[str, Any]]) -> list[JobView]:
    """The rows as views, each with its newest metrics event's numbers (one query for all)."""
    ids = [r["id"] for r in rows]
    last: dict[str, dict[str, float]] = {}
    if ids:
        newest = (select(func.max(EventRow.seq)).where(EventRow.job_id.in_(ids), EventRow.type == "metrics")
                  .group_by(EventRow.job_id))
        with jobs.engine.connect() as conn:
            for job_id, data in conn.execute(select(EventRow.job_id, EventRow.data).where(EventRow.seq.in_(newest))):
                last[job_id] = numbers(data)
    return [_job_view(r, last.get(r["id"], {})) for r in rows]


def metric_series(engine, job_id: str, most: int) -> dict[str, list[tuple[float, float]]]:
    """Metric name -> [step, value] from the job's metrics events, in order; a series longer than
    `most` keeps every k-th point and the last."""
    with engine.connect() as conn:
        rows = conn.execute(select(EventRow.data).where(EventRow.job_id == job_id, EventRow.type == "metrics")
                            .order_by(EventRow.seq)).scalars().all()
    series: dict[str, dict[float, float]] = {}
    for data in rows:
        if not data or "step" not in data:
            continue
        for name, value in numbers(data).items():
            series.setdefault(name, {})[float(data["step"])] = value  # a step reported twice: the later value
    out = {}
    for name, by_step in series.items():
        points = sorted(by_step.items())
        if len(points) > most:
            k = -(-len(points) // most)
            points = points[::k] + ([points[-1]] if (len(points) - 1) % k else [])
        out[name] = points
    return out


def live_jobs(engine, rows: list[dict[str, Any]], cfg: DashboardConfig) -> list[LiveJob]:
    """The series of the running jobs that reported metrics (newest first, at most
    `cfg.live_jobs`), else of the newest job that did (a cycle's job reports stages, not steps)."""
    out: list[LiveJob] = []
    running = [r for r in rows if r["status"] == "running"]
    for row in [*running, *(r for r in rows if r["status"] != "running")]:
        if len(out) >= cfg.live_jobs or (out and row["status"] != "running"):
            break
        series = metric_series(engine, row["id"], cfg.points)
        if series:
            out.append(LiveJob(job_id=row["id"], status=row["status"], series=series))
    return out


def training_cost(jobs: JobStore | None, tenant: str) -> TrainingCost:
    """Cost per 1M trained tokens over the tenant's finished jobs that recorded both (the
    worker's ledger prices each attempt; a cycle's job counts no trained tokens)."""
    note = "the worker's cost ledger over trained tokens, finished jobs with both recorded"
    if jobs is None:
        return TrainingCost(usd=0.0, tokens=0, usd_per_million_tokens=None, jobs=0, note="no fine-tuning API")
    with jobs.engine.connect() as conn:
        n, usd, tokens = conn.execute(select(
            func.count(), func.coalesce(func.sum(JobRow.estimated_cost), 0.0),
            func.coalesce(func.sum(JobRow.trained_tokens), 0))
            .where(JobRow.tenant == tenant, JobRow.status.in_(FINISHED), JobRow.estimated_cost.is_not(None),
                   JobRow.trained_tokens > 0)).one()
    return TrainingCost(usd=float(usd), tokens=int(tokens), usd_per_million_tokens=per_million(float(usd), int(tokens)),
                        jobs=n, note=note)


def job_detail(src: Sources, tenant: str, job_id: str, cfg: DashboardConfig) -> DashboardJob:
    """One job of `tenant` (jobs.store.NotFound for anyone else's): its view, its newest events
    oldest first, its metric series, checkpoints, and the cycle it runs (a cycle's job)."""
    assert src.jobs is not None, "the dashboard's job view needs the fine-tuning API"
    row = src.jobs.get_job(tenant, job_id)
    events = src.jobs.list_events(tenant, job_id, limit=cfg.events)[0][::-1]
    checkpoints = src.jobs.list_checkpoints(tenant, job_id, limit=100)[0][::-1]
    cycle = src.flywheels.cycle_of_job(job_id) if src.flywheels is not None else None
    return DashboardJob(
        object="dashboard.job", job=job_views(src.jobs, [row])[0],
        events=[EventView(id=e["id"], created_at=unix(e["created_at"]), level=e["level"], type=e["type"],
                          message=e["message"], data=e["data"] or {}) for e in events],
        series=metric_series(src.jobs.engine, job_id, cfg.points),
        checkpoints=[CheckpointView(id=c["id"], step=c["step"], fine_tuned_model_checkpoint=c[
            "fine_tuned_model_checkpoint"], metrics=c["metrics"]) for c in checkpoints],
        cycle=cycle_view(cycle) if cycle is not None and cycle["tenant"] == tenant else None)
