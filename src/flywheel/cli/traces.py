"""`flywheel traces ...`: import traces from JSONL files and summarise the trace store."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import typer

app = typer.Typer(help="Import and inspect traces (served requests, agent episodes, feedback).",
                  no_args_is_help=True)

DB_HELP = ("SQLAlchemy URL of the trace database (default: SQLite at <data dir>/traces.db: $FLYWHEEL_DATA_DIR, "
           "else ./flywheel-data)")


@contextlib.contextmanager
def _store_errors():
    from sqlalchemy.exc import SQLAlchemyError

    from flywheel.traces import SchemaVersionError, TraceStoreError

    try:
        yield
    except (TraceStoreError, SchemaVersionError, SQLAlchemyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None


@app.command("import")
def import_(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="JSONL file, one trace per line"),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
    source: str | None = typer.Option(None, "--source", help="source of records that name none "
                                                              "(default: import:<file name>)"),
    batch_size: int = typer.Option(500, "--batch-size", min=1, help="records per transaction"),
) -> None:
    """Store the traces of FILE; report each bad line as FILE:LINE: reason (exit 1 if any)."""
    from flywheel.traces import TraceStore, import_jsonl

    with _store_errors(), TraceStore(db) as store:
        report = import_jsonl(store, file, source=source, batch_size=batch_size)
    for line, reason in report.errors:
        print(f"{file}:{line}: {reason}", file=sys.stderr)
    typer.echo(f"{file}: {report.added} added, {report.duplicates} already stored, "
               f"{len(report.errors)} rejected ({report.lines} lines)")
    if report.errors:
        raise typer.Exit(1)


@app.command("stats")
def stats(db: str | None = typer.Option(None, "--db", help=DB_HELP)) -> None:
    """Counts of traces and feedback, by source and by model."""
    from flywheel.traces import TraceStore

    with _store_errors(), TraceStore(db) as store:
        s = store.stats()
    span = f"{s.first:%Y-%m-%d %H:%M:%S} .. {s.last:%Y-%m-%d %H:%M:%S} UTC" if s.first else "-"
    lines = [
        f"database        {s.url} (schema revision {s.schema_revision})",
        f"traces          {s.traces}",
        f"with feedback   {s.traces_with_feedback}",
        f"feedback        {s.feedback}",
        f"tokens          {s.prompt_tokens} prompt, {s.completion_tokens} completion",
        f"created         {span}",
    ]
    lines += [f"source          {name}: {n}" for name, n in s.by_source.items()]
    lines += [f"model           {name or '(none)'}: {n}" for name, n in s.by_model.items()]
    typer.echo("\n".join(lines))
