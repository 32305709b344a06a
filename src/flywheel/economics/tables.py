"""The economics report as data: numbers from reports.py / projection.py, formatted into
plain tables that both the terminal (rich) and the HTML page render. No I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from flywheel.economics.catalog import Catalog, Hardware
from flywheel.economics.ledger import CostRecord
from flywheel.economics.projection import DEFAULT_MFU, Projection, measured_mfu, project
from flywheel.economics.reports import (FAMILIES, CycleOutcome, CycleRow, FamilyCost, cost_by_family,
                                        cumulative_curve, cycle_rows, token_field)

DASH = "—"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


def usd(x: float | None) -> str:
    if x is None:
        return DASH
    if x == 0:
        return "$0.00"
    return f"${x:,.2f}" if abs(x) >= 1 else f"${x:,.4f}" if abs(x) >= 1e-4 else f"${x:.2e}"


def num(x: float | None, fmt: str = ",.0f") -> str:
    return DASH if x is None else format(x, fmt)


@dataclass
class EconomicsReport:
    records: list[CostRecord]
    families: list[FamilyCost]
    cycles: list[CycleRow]
    curve: list[tuple[float, float]]
    projections: list[Projection]
    mfu: float
    measured_mfu: float | None
    sources: dict[str, str] = field(default_factory=dict)  # what was read: ledger, cycles, catalog
    eval_name: str = "gated eval"  # what the cycles' accuracies (hence points) are measured on

    @property
    def total_usd(self) -> float:
        return sum(r.usd for r in self.records)

    def summary_lines(self) -> list[str]:
        hours = sum(r.device_seconds for r in self.records) / 3600.0
        lines = [f"{len(self.records)} ledger records, {usd(self.total_usd)} in all, {hours:,.3f} device-hours"]
        split = self.cost_split_line()
        lines += [split] if split else []
        lines += [f"{k}: {v}" for k, v in self.sources.items()]
        if self.measured_mfu is not None:
            lines.append(f"measured MFU on the recorded hardware (model FLOPs / peak): {self.measured_mfu:.2%}")
        return lines

    def cost_split_line(self) -> str:
        """Where the total goes when not all of it is cycles' cost: the cycles (what points per
        dollar divide by) and, by stage, the records tagged with no cycle (serving traffic,
        evaluations outside a cycle). Empty when there are no cycles or nothing outside them."""
        outside: dict[str, float] = {}
        for r in self.records:
            if r.cycle is None:
                outside[r.stage] = outside.get(r.stage, 0.0) + r.usd
        if not self.cycles or not outside:
            return ""
        cycles = sum(c.usd for c in self.cycles)
        parts = ", ".join(f"{stage} {usd(v)}" for stage, v in sorted(outside.items(), key=lambda kv: -kv[1]))
        return (f"of which {usd(cycles)} in the {len(self.cycles)} cycles (what points per dollar divide by) and "
                f"{usd(sum(outside.values()))} outside any cycle: {parts}")

    def tables(self) -> list[Table]:
        out = [self.family_table()]
        if self.cycles:
            out.append(self.cycle_table())
        if self.projections:
            out.append(self.projection_table())
        return out

    def family_table(self) -> Table:
        rows = []
        for f in self.families:
            stages = ", ".join(FAMILIES[f.family][0]) if f.family in FAMILIES else "(other stages)"
            tf = token_field(f.family)
            rows.append([f.family, stages, str(f.records), num(f.device_hours, ",.4f"), usd(f.usd),
                         f"{f.tokens:,} {tf.removeprefix('tokens_')}" if tf else DASH, usd(f.usd_per_million)])
        return Table("Cost per 1M tokens by stage family",
                     ["family", "stages", "records", "device-hours", "USD", "tokens", "USD / 1M tokens"], rows,
                     "USD = devices x seconds x catalog price / 3600 (frozen in each record).")

    def cycle_table(self) -> Table:
        rows = []
        for r, (cum_usd, cum_pts) in zip(self.cycles, self.curve[1:]):
            o = r.outcome
            ev = f"{o.accuracy_before:.1%} → {o.accuracy_after:.1%}" if o else DASH
            ipd = r.ipd
            rows.append([r.cycle, usd(r.usd), ev, num(o.gain_points, "+.1f") if o else DASH,
                         ("yes" if o.promoted else "no") if o else DASH,
                         num(r.realised_points, "+.1f") if o else DASH,
                         num(ipd.value, ",.2f") if ipd else DASH,
                         (ipd.note if ipd else "no eval outcome for this cycle"),
                         usd(cum_usd), num(cum_pts, "+.1f")])
        return Table("Cycles: intelligence per dollar",
                     ["cycle", "cost", self.eval_name, "gain (pts)", "promoted", "realised (pts)", "pts / $",
                      "note", "cum. USD", "cum. pts"], rows,
                     f"Points = accuracy percentage points on the {self.eval_name}; realised = gain if promoted, "
                     "else 0. pts / $ = realised points / cycle cost (the ledger records tagged with the cycle).")

    def projection_table(self) -> Table:
        rows = []
        for p in self.projections:
            fam = {f.family: f for f in p.families}
            rows.append([p.target.name + (" *" if p.target.projection else ""), f"{p.mfu:.2f}",
                         num(p.estimated_device_hours, ".3g"), usd(p.estimated_usd), usd(p.measured_usd),
                         num(p.ratio, ".3g") + "x" if p.ratio is not None else DASH,
                         usd(fam["rollouts"].estimated_usd_per_million) if "rollouts" in fam else DASH,
                         usd(fam["serving"].estimated_usd_per_million) if "serving" in fam else DASH])
        first = self.projections[0]
        note = ("ESTIMATE, not a measurement: FLOPs = 2 x params per generated/served token + 6 x params "
                "per trained token; device-hours = FLOPs / (peak x assumed MFU) / 3600; est. USD = "
                "device-hours x catalog price. 'measured' is what the same records cost as recorded.")
        if any(p.target.projection for p in self.projections):
            note += " * = projected hardware (not generally available; price is a placeholder)."
        if first.unprojected_records:
            note += (f" {first.unprojected_records} records ({usd(first.unprojected_usd)}) have no parameter "
                     "count or no tokens and are left out.")
        return Table(f"Projection on other hardware (ESTIMATE, assumed MFU {self.mfu:.2f})",
                     ["target", "MFU", "est. device-h", "est. USD", "measured", "est./meas.",
                      "est. $/1M rollout", "est. $/1M served"], rows, note)


def build_report(records: Sequence[CostRecord], outcomes: Sequence[CycleOutcome] = (), *,
                 catalog: Catalog | None = None, targets: Sequence[Hardware] = (), mfu: float = DEFAULT_MFU,
                 params: int | None = None, sources: dict[str, str] | None = None,
                 eval_name: str = "gated eval") -> EconomicsReport:
    """`eval_name`: what the outcomes' accuracies are measured on (a column header and the
    cumulative plot's axis say it)."""
    records = list(records)
    cycles = cycle_rows(records, outcomes)
    return EconomicsReport(
        records=records, families=cost_by_family(records), cycles=cycles, curve=cumulative_curve(cycles),
        projections=[project(records, t, mfu=mfu, params=params) for t in targets], mfu=mfu,
        measured_mfu=measured_mfu(records, catalog, params=params) if catalog is not None else None,
        sources=dict(sources or {}), eval_name=eval_name)
