"""Economics: hardware catalog, cost ledger, cost per token, intelligence per dollar, projections.

    catalog.py     hardware.yaml (shipped) or a user file -> Catalog of Hardware entries
    ledger.py      CostRecord, Ledger (JSONL, atomic appends, `with ledger.stage(...)`)
    reports.py     pure math: cost per 1M tokens per stage family, cost per cycle,
                   intelligence per dollar, cumulative curve
    projection.py  FLOPs-per-token projection onto another catalog entry (an estimate)
    tables.py      the report as tables; render.py / plots.py show it (rich, PNG, HTML)

docs/economics.md has the formulas and where every catalog number comes from.
"""

from flywheel.economics.catalog import Catalog, CatalogError, Hardware, load_catalog
from flywheel.economics.ledger import (CostRecord, Ledger, LedgerError, LedgerWarning,
                                       compute_usd, make_record, read_ledger)
from flywheel.economics.projection import Projection, project
from flywheel.economics.reports import (CycleOutcome, cost_by_cycle, cost_by_family, cumulative_curve,
                                        cycle_rows, intelligence_per_dollar, per_million, read_cycles)

__all__ = [
    "Catalog", "CatalogError", "Hardware", "load_catalog",
    "CostRecord", "Ledger", "LedgerError", "LedgerWarning", "compute_usd", "make_record",
    "read_ledger",
    "Projection", "project",
    "CycleOutcome", "cost_by_cycle", "cost_by_family", "cumulative_curve", "cycle_rows",
    "intelligence_per_dollar", "per_million", "read_cycles",
]
