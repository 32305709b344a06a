"""Pure functions over ledger records: cost per 1M tokens, cost per cycle, intelligence per
dollar, and the cumulative curve.

Stage families and the tokens each is priced per:

    serving   serve                    per token served (completion tokens returned)
    rollouts  rl_rollout               per token generated
    training  sft, rl_train, dpo       per token trained (tokens in the loss)
    eval      eval                     per token generated
    curation  curation                 no token count (cost only)
    other     any other stage          no token count (cost only)

Points are **accuracy percentage points** on the gated eval (the held-out new-failure set the
gate judges): 0.42 -> 0.57 accuracy is +15 points. A cycle's *realised* gain is its gain if
the gate promoted the candidate and 0 if it rejected it (production did not change, the money
was spent all the same). Intelligence per dollar = realised points / cycle cost in US dollars,
where a cycle's cost is the sum of the ledger records tagged with its id (serving traffic is
production cost, not cycle cost, unless tagged). Zero cost: undefined (None, with a note), never
infinity. Negative gain: kept negative and noted, never clipped to zero.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flywheel.economics.ledger import CostRecord, LedgerError

FAMILIES: dict[str, tuple[tuple[str, ...], str | None]] = {
    "serving": (("serve",), "tokens_served"),
    "rollouts": (("rl_rollout",), "tokens_generated"),
    "training": (("sft", "rl_train", "dpo"), "tokens_trained"),
    "eval": (("eval",), "tokens_generated"),
    "curation": (("curation",), None),
}
_STAGE_FAMILY = {stage: fam for fam, (stages, _) in FAMILIES.items() for stage in stages}


def family_of(stage: str) -> str:
    return _STAGE_FAMILY.get(stage, "other")


def token_field(family: str) -> str | None:
    return FAMILIES.get(family, ((), None))[1]


def per_million(usd: float, tokens: int) -> float | None:
    """US dollars per 1,000,000 tokens; None when there are no tokens to divide by."""
    return usd / tokens * 1e6 if tokens > 0 else None


@dataclass(frozen=True)
class FamilyCost:
    family: str
    usd: float
    device_hours: float
    tokens: int  # the family's token count (see FAMILIES); 0 where it has none
    records: int

    @property
    def usd_per_million(self) -> float | None:
        return per_million(self.usd, self.tokens)


def cost_by_family(records: Iterable[CostRecord]) -> list[FamilyCost]:
    """One row per family present, in FAMILIES order then 'other'."""
    acc: dict[str, list] = {}
    for r in records:
        fam = family_of(r.stage)
        row = acc.setdefault(fam, [0.0, 0.0, 0, 0])
        row[0] += r.usd
        row[1] += r.device_seconds / 3600.0
        tf = token_field(fam)
        row[2] += getattr(r, tf) if tf else 0
        row[3] += 1
    order = [*FAMILIES, "other"]
    return [FamilyCost(f, *acc[f]) for f in order if f in acc]


@dataclass(frozen=True)
class CycleCost:
    cycle: str
    usd: float
    device_hours: float
    usd_by_stage: dict[str, float]


def cost_by_cycle(records: Iterable[CostRecord]) -> list[CycleCost]:
    """Cost of each cycle id, in order of first appearance; untagged records are left out."""
    acc: dict[str, tuple[list[float], dict[str, float]]] = {}
    for r in records:
        if r.cycle is None:
            continue
        tot, stages = acc.setdefault(r.cycle, ([0.0, 0.0], {}))
        tot[0] += r.usd
        tot[1] += r.device_seconds / 3600.0
        stages[r.stage] = stages.get(r.stage, 0.0) + r.usd
    return [CycleCost(c, t[0], t[1], s) for c, (t, s) in acc.items()]


# ---------------------------------------------------------------- cycles and their eval outcomes


class CycleOutcome(BaseModel):
    """One line of a cycles file: the gated eval of a cycle's candidate vs the incumbent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cycle: str = Field(..., min_length=1)
    accuracy_before: float = Field(..., ge=0, le=1, description="incumbent on the gated eval, 0..1")
    accuracy_after: float = Field(..., ge=0, le=1, description="candidate on the gated eval, 0..1")
    promoted: bool = Field(True, description="did the gate promote the candidate")
    reason: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)

    @property
    def gain_points(self) -> float:
        """Candidate minus incumbent, in accuracy percentage points."""
        return 100.0 * (self.accuracy_after - self.accuracy_before)

    @property
    def realised_points(self) -> float:
        """Points production actually gained: the gain if promoted, else 0."""
        return self.gain_points if self.promoted else 0.0


def read_cycles(path: str | Path) -> list[CycleOutcome]:
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise LedgerError(f"{p}: no such cycles file") from None
    out = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(CycleOutcome.model_validate(json.loads(line)))
        except ValidationError as e:
            err = e.errors()[0]
            raise LedgerError(f"{p}:{lineno}: field {'.'.join(map(str, err['loc'])) or '(line)'}: {err['msg']}") from None
        except ValueError as e:
            raise LedgerError(f"{p}:{lineno}: not valid JSON: {e}") from None
    return out


@dataclass(frozen=True)
class IntelligencePerDollar:
    points: float
    usd: float
    value: float | None  # points per dollar; None where undefined
    note: str = ""


def intelligence_per_dollar(points: float, usd: float) -> IntelligencePerDollar:
    """Realised accuracy points per US dollar, with the edge cases spelled out."""
    if usd < 0:
        raise ValueError(f"cost cannot be negative: {usd}")
    if usd == 0:
        return IntelligencePerDollar(points, usd, None, "undefined: no cost recorded for this cycle")
    value = points / usd
    note = "negative: the cycle lost points" if points < 0 else ("no gain" if points == 0 else "")
    return IntelligencePerDollar(points, usd, value, note)


@dataclass(frozen=True)
class CycleRow:
    cycle: str
    usd: float
    outcome: CycleOutcome | None
    ipd: IntelligencePerDollar | None  # None when the cycle has no eval outcome
    usd_by_stage: dict[str, float] = field(default_factory=dict)

    @property
    def realised_points(self) -> float:
        return self.outcome.realised_points if self.outcome else 0.0


def cycle_rows(records: Sequence[CostRecord], outcomes: Sequence[CycleOutcome] = ()) -> list[CycleRow]:
    """Cycles in ledger order (then outcome-only cycles), each with cost and points per dollar."""
    costs = {c.cycle: c for c in cost_by_cycle(records)}
    by_id = {o.cycle: o for o in outcomes}
    order = list(costs) + [o.cycle for o in outcomes if o.cycle not in costs]
    rows = []
    for cid in order:
        cost = costs.get(cid)
        usd = cost.usd if cost else 0.0
        out = by_id.get(cid)
        ipd = intelligence_per_dollar(out.realised_points, usd) if out else None
        rows.append(CycleRow(cid, usd, out, ipd, dict(cost.usd_by_stage) if cost else {}))
    return rows


def cumulative_curve(rows: Sequence[CycleRow]) -> list[tuple[float, float]]:
    """(cumulative dollars, cumulative realised points) after each cycle, from (0, 0).
    A cycle without an eval outcome adds its cost and no points."""
    pts = [(0.0, 0.0)]
    for r in rows:
        usd, points = pts[-1]
        pts.append((usd + r.usd, points + r.realised_points))
    return pts
