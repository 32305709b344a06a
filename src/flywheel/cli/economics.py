"""`flywheel economics report|hardware`: cost reports from the ledger, and the hardware catalog."""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import typer

app = typer.Typer(help="Cost per token, intelligence per dollar, hardware catalog.", no_args_is_help=True)


@contextlib.contextmanager
def _user_errors():
    # Local on purpose: cli/errors.py imports the model and training stacks, which this
    # command never needs. Catalog and ledger errors are ValueErrors.
    try:
        yield
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


@app.command("report")
def report(
    ledger: Path | None = typer.Option(None, help="cost ledger (JSONL); default: <data dir>/ledger.jsonl "
                                                  "($FLYWHEEL_DATA_DIR, else ./flywheel-data)"),
    cycles: Path | None = typer.Option(None, help="cycles JSONL: cycle, accuracy_before, accuracy_after, promoted"),
    out: Path = typer.Option(Path("economics-report"), help="folder for the PNG plots and index.html"),
    project: str = typer.Option("", help="comma-separated catalog entries to project onto, e.g. H100,B200"),
    mfu: float = typer.Option(0.4, min=0.0001, max=1.0, help="assumed utilisation for projections"),
    params: int | None = typer.Option(None, min=1, help="model parameters for records that lack them"),
    catalog: Path | None = typer.Option(None, help="hardware catalog YAML (default: $FLYWHEEL_HARDWARE or shipped)"),
    skip_corrupt: bool = typer.Option(False, help="skip corrupt ledger lines with a warning instead of failing"),
) -> None:
    """Print cost tables and write plots + a self-contained HTML page."""
    with _user_errors():
        from flywheel.economics.catalog import catalog_path, load_catalog
        from flywheel.economics.ledger import LedgerWarning, read_ledger
        from flywheel.economics.render import print_report, write_report
        from flywheel.economics.reports import read_cycles
        from flywheel.economics.tables import build_report
        from flywheel.locations import data_dir

        ledger = ledger or data_dir() / "ledger.jsonl"
        cat = load_catalog(catalog)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", LedgerWarning)
            records = read_ledger(ledger, skip_corrupt=skip_corrupt)
        for w in caught:
            print(f"warning: {w.message}", file=sys.stderr)
        outcomes = read_cycles(cycles) if cycles is not None else []
        targets = [cat.get(name) for name in project.split(",") if name.strip()]
        sources = {"ledger": str(ledger), "catalog": f"{catalog_path(catalog)} (as of {cat.as_of or '?'})"}
        if cycles is not None:
            sources["cycles"] = str(cycles)
        rep = build_report(records, outcomes, catalog=cat, targets=targets, mfu=mfu, params=params, sources=sources)
        print_report(rep)
        paths = write_report(rep, out)
        plots = sorted(n for n in paths if n.endswith(".png"))
        typer.echo(f"wrote {paths['index.html']}" + (f" and {', '.join(plots)}" if plots else " (no data to plot)"))


@app.command("hardware")
def hardware(catalog: Path | None = typer.Option(None, help="hardware catalog YAML")) -> None:
    """List the hardware catalog and the file it came from."""
    with _user_errors():
        from flywheel.economics.catalog import catalog_path, load_catalog
        from flywheel.economics.render import print_table
        from flywheel.economics.tables import Table

        cat = load_catalog(catalog)
        def note(h) -> str:
            parts = [f"{h.system.devices}/rack" if h.system else "", "projection" if h.projection else ""]
            return ", ".join(p for p in parts if p)

        rows = [[h.name, h.kind, f"{h.usd_per_hour:,.3f}", f"{h.peak_tflops:,.4g}",
                 f"{h.memory_bandwidth_gb_s:,.0f}", f"{h.memory_gb:,.0f}", note(h)] for h in cat]
        print_table(Table(
            f"Hardware catalog {catalog_path(catalog)} (as of {cat.as_of or '?'})",
            ["name", "kind", "USD/h", "TFLOP/s", "GB/s", "GB", "note"], rows,
            "Per device (one GPU; the CPU machine as a whole). USD per device-hour; peak dense TFLOP/s "
            "at each entry's precision (bf16 for GPUs, fp32 for the CPU); memory GB/s and GB. "
            "Sources: docs/economics.md."))
