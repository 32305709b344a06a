"""`flywheel traces ...`: import traces from JSONL files, summarise the trace store, and score
traces no verifier grades with a judge model (`judge`, loop/judging.py)."""

from __future__ import annotations

import contextlib
import sys
from datetime import datetime
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


@app.command("judge")
def judge(
    judge_url: str = typer.Option(..., "--judge-url", help="base URL of the judge's OpenAI-compatible API, "
                                                           "e.g. http://127.0.0.1:8000/v1 (a `flywheel serve`)"),
    judge_model: str = typer.Option(..., "--judge-model", help="the model name to ask for there"),
    api_key: str | None = typer.Option(None, "--api-key", envvar="FLYWHEEL_JUDGE_API_KEY",
                                       help="the judge server's API key ($FLYWHEEL_JUDGE_API_KEY)"),
    config: Path | None = typer.Option(None, "--config", exists=True, dir_okay=False,
                                       help="a loop config whose curation section (curation.judge: mode, rubric, "
                                            "thresholds) to use; the options below override it"),
    mode: str | None = typer.Option(None, "--mode", help="ranking (a group side by side, RULER-style), rubric "
                                                         "(each answer alone) or verdict (each answer alone, "
                                                         "scored P(yes) / (P(yes) + P(no)) from the judge's "
                                                         "top_logprobs: for judges too small to write JSON); "
                                                         "default: curation.judge.mode"),
    rubric: str | None = typer.Option(None, "--rubric", help="what a good answer is, as the judge is told"),
    singletons: str | None = typer.Option(None, "--singletons", help="ranking mode, an answer no other shares a "
                                                                     "prompt with: rubric or skip"),
    rejudge: bool = typer.Option(False, "--rejudge", help="judge again traces that already have judge feedback"),
    since: datetime | None = typer.Option(None, "--since", help="only traces created at or after this (UTC)"),
    tenant: str | None = typer.Option(None, "--tenant", help="only this tenant's traces (default: every tenant's, "
                                                             "each group within one tenant)"),
    db: str | None = typer.Option(None, "--db", help=DB_HELP),
) -> None:
    """Score traces that no verifier grades and no user judged with a judge model; store each score
    as feedback with source "judge" (curation makes DPO pairs of it with curation.judge's
    thresholds). Groups the judge could not answer are skipped and counted, never scored.
    Exit 1 when every group was skipped."""
    import json

    from flywheel.config import ConfigError, load_config, validate
    from flywheel.loop.curation_rules import CurationConfig
    from flywheel.loop.judging import HTTPJudge, run_judge
    from flywheel.loop.loop_config import LoopConfig
    from flywheel.traces import TraceStore

    given = {k: v for k, v in (("mode", mode), ("rubric", rubric), ("singletons", singletons)) if v is not None}
    if rejudge:
        given["rejudge"] = True
    try:
        base = load_config(config, LoopConfig).curation if config else CurationConfig()
        cfg = validate({**base.model_dump(), "judge": {**base.judge.model_dump(), **given}}, CurationConfig,
                       where="judge options")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    client = HTTPJudge(judge_url, judge_model, api_key)
    try:
        with _store_errors(), TraceStore(db) as store:
            report = run_judge(store, client, cfg, since=since, tenant=tenant,
                               log=lambda m: typer.echo(m, err=True))
    finally:
        client.close()
    typer.echo(json.dumps(report.to_dict(), indent=2, sort_keys=True))
    if report.groups and not report.judged_groups:
        raise typer.Exit(1)
