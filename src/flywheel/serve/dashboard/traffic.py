"""The dashboard's production-traffic panel, from the trace store (no FastAPI here).

Totals (requests, feedback, tokens) are SQL aggregates over every trace of the tenant. The
rest reads the tenant's newest `window` traces and their feedback (columns only, never the
messages): each trace's outcome is its newest verdict under the server's curation rules
(loop/curation_rules.py `outcome`), and traces are grouped by family or environment (see
`group_of`).

Cost per 1M tokens. A server keeps no serving ledger (the cost ledger records training, the
worker's and the cycles'), so this is an estimate, and the answer says so: the catalog's
price of the server's hardware (economics/catalog.py) times the seconds the tenant's
requests were in flight (the union of `[created_at - latency, created_at]`, so concurrent
requests, which share a batch, are not counted twice), over their prompt + completion tokens.
A trace without a latency (posted by a client, not served here) is left out of both sides.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from sqlalchemy import func, select

from flywheel.clock import utc_aware
from flywheel.economics.catalog import CatalogError, Hardware, load_catalog
from flywheel.economics.reports import per_million
from flywheel.loop.curation_rules import CurationConfig, outcome
from flywheel.serve.dashboard.schemas import ServingCost, Traffic, TrafficGroup
from flywheel.traces.results import StoredFeedback, StoredTrace
from flywheel.traces.store import feedback_of
from flywheel.traces.tables import FeedbackRow, TraceRow

MINUTES = 30  # of the per-minute series
_GROUP_KEYS = (("family", "family"), ("env", "env"), ("environment", "env"))


def no_traffic() -> Traffic:
    """The panel of a server without a trace store."""
    cost = ServingCost(usd_per_million_tokens=None, basis="estimate", hardware=None, usd_per_hour=None,
                       busy_seconds=0.0, tokens=0, note="this server keeps no trace store (flywheel serve --no-traces)")
    return Traffic(available=False, requests=0, with_feedback=0, prompt_tokens=0, completion_tokens=0, window=0,
                   outcomes={}, groups=[], models={}, per_minute=[], failures_per_minute=[], cost=cost)


def traffic(engine, tenant: str, curation: CurationConfig, *, hardware: str | None, window: int,
            now: datetime) -> Traffic:
    """The panel for `tenant` over the trace store's `engine`; `now`: aware UTC."""
    t, f = TraceRow.__table__, FeedbackRow.__table__
    with engine.connect() as conn:
        requests, prompt, completion = conn.execute(select(
            func.count(), func.coalesce(func.sum(t.c.prompt_tokens), 0),
            func.coalesce(func.sum(t.c.completion_tokens), 0)).where(t.c.tenant == tenant)).one()
        judged = conn.scalar(select(func.count(func.distinct(f.c.trace_id))).where(f.c.tenant == tenant))
        rows = conn.execute(select(t.c.id, t.c.seq, t.c.created_at, t.c.model, t.c.metadata, t.c.latency_ms,
                                   t.c.prompt_tokens, t.c.completion_tokens)
                            .where(t.c.tenant == tenant).order_by(t.c.seq.desc()).limit(window)).all()
        feedback = feedback_of(conn, [r.id for r in rows])
    verdicts = [(r, outcome(_judged(r, feedback.get(r.id, [])), curation)) for r in rows]
    return Traffic(available=True, requests=requests, with_feedback=judged, prompt_tokens=int(prompt),
                   completion_tokens=int(completion), window=len(rows),
                   outcomes=dict(Counter(v for _, v in verdicts)),
                   groups=_groups(verdicts, feedback), models=dict(Counter(r.model or "" for r in rows)),
                   per_minute=_per_minute([r.created_at for r, _ in verdicts], now),
                   failures_per_minute=_per_minute([r.created_at for r, v in verdicts if v == "fail"], now),
                   cost=serving_cost(rows, hardware))


def _judged(row, feedback: list[StoredFeedback]) -> StoredTrace:
    """The trace as far as `outcome` reads it (its feedback)."""
    return StoredTrace(id=row.id, seq=row.seq, idempotency_key="", created_at=utc_aware(row.created_at), source="",
                       messages=[], feedback=feedback)


def group_of(metadata: dict[str, Any] | None, feedback: list[StoredFeedback], model: str | None) -> tuple[str, str]:
    """(kind, name) of a trace's group: its metadata's `family`, else `env` / `environment`
    (the trace's own metadata first, then the OpenAI request's `metadata` it was served with),
    else the environment of its newest verifier, else its model."""
    meta = metadata or {}
    request = meta.get("request_metadata") if isinstance(meta.get("request_metadata"), dict) else {}
    for source in (meta, request):
        for key, kind in _GROUP_KEYS:
            value = source.get(key)
            if isinstance(value, (str, int)) and str(value).strip():
                return kind, str(value).strip()
    for fb in reversed(feedback):
        if fb.verifier is not None:
            return "env", fb.verifier.env
    return "model", model or "(no model)"


def _groups(verdicts: list, feedback: dict[str, list[StoredFeedback]]) -> list[TrafficGroup]:
    acc: dict[tuple[str, str], list[int]] = {}  # (kind, name) -> [requests, passes, failures]
    for row, verdict in verdicts:
        counts = acc.setdefault(group_of(row.metadata, feedback.get(row.id, []), row.model), [0, 0, 0])
        counts[0] += 1
        counts[1] += verdict == "pass"
        counts[2] += verdict == "fail"
    groups = [TrafficGroup(kind=kind, name=name, requests=n, passes=p, failures=fails,
                           failure_rate=fails / (p + fails) if p + fails else None)
              for (kind, name), (n, p, fails) in acc.items()]
    return sorted(groups, key=lambda g: (-g.failures, -g.requests, g.name))


def _per_minute(times: list[datetime], now: datetime) -> list[tuple[float, float]]:
    """[unix minute, count] for each of the last MINUTES minutes up to `now` (aware UTC); `times`
    naive UTC."""
    end = now.replace(second=0, microsecond=0)
    starts = [end - timedelta(minutes=MINUTES - 1 - i) for i in range(MINUTES)]
    counts = Counter(utc_aware(t).replace(second=0, microsecond=0) for t in times)
    return [(s.timestamp(), float(counts.get(s, 0))) for s in starts]


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end] intervals (seconds): overlapping requests count once.
    busy_seconds([(0, 2), (1, 3), (5, 6)]) == 4.0."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


@lru_cache(maxsize=1)
def _catalog():
    return load_catalog()  # the shipped one, or $FLYWHEEL_HARDWARE's


def _price(hardware: str | None) -> tuple[Hardware | None, str]:
    if hardware is None:
        return None, "no hardware named for this server (flywheel serve --hardware NAME, a catalog entry)"
    try:
        return _catalog().get(hardware), ""
    except CatalogError as exc:
        return None, str(exc)


def serving_cost(rows, hardware: str | None) -> ServingCost:
    """The estimate described in the module docstring, over rows with created_at (naive UTC),
    latency_ms and token counts."""
    served = [r for r in rows if r.latency_ms is not None]
    intervals = [(utc_aware(r.created_at).timestamp() - r.latency_ms / 1000, utc_aware(r.created_at).timestamp())
                 for r in served]
    busy = busy_seconds(intervals)
    tokens = sum((r.prompt_tokens or 0) + (r.completion_tokens or 0) for r in served)
    hw, problem = _price(hardware)
    if hw is None:
        return ServingCost(usd_per_million_tokens=None, basis="estimate", hardware=hardware, usd_per_hour=None,
                           busy_seconds=busy, tokens=tokens, note=problem)
    usd = busy * hw.usd_per_hour / 3600
    note = (f"estimated: {hw.name} at ${hw.usd_per_hour:g}/h x {busy:.1f} s in flight over {tokens:,} tokens of "
            f"{len(served)} served requests; the server keeps no serving ledger")
    return ServingCost(usd_per_million_tokens=per_million(usd, tokens), basis="estimate", hardware=hw.name,
                       usd_per_hour=hw.usd_per_hour, busy_seconds=busy, tokens=tokens, note=note)
