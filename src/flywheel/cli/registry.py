"""`flywheel registry ...`: the model registry (register, list, show, promote, rollback, reject,
history). `flywheel model` builds models; `flywheel models` is this command's old name.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Callable

import typer

app = typer.Typer(help="Registered model versions: lineage, promotion to production, rollback.",
                  no_args_is_help=True)

REGISTRY_HELP = ("registry folder, or a SQLAlchemy URL of its database "
                 "(default: <--data-dir>/registry, else $FLYWHEEL_DATA_DIR/registry, else ./flywheel-data/registry)")
RegistryOpt = typer.Option(None, "--registry", help=REGISTRY_HELP)
DataDirOpt = typer.Option(None, "--data-dir", help="a loop's data_dir (its config's): the registry in it")


def _location(registry: str | None, data_dir: Path | None) -> str | None:
    if registry is not None and data_dir is not None:
        print("error: give --registry or --data-dir, not both", file=sys.stderr)
        raise typer.Exit(2)
    return str(data_dir / "registry") if data_dir is not None else registry


@contextlib.contextmanager
def _registry(location: str | None, data_dir: Path | None = None):
    """Open the registry; report refusals as one line naming the registry, and exit code 2."""
    from sqlalchemy.exc import SQLAlchemyError

    from flywheel.database import SchemaVersionError
    from flywheel.registry import Registry, RegistryError
    from flywheel.registry.registry import default_root

    location = _location(location, data_dir)
    where = location if location is not None else str(default_root().resolve())
    try:
        with Registry(location) as registry:
            where = str(registry.root) if "://" not in where else registry.url
            yield registry
    except (RegistryError, SchemaVersionError, SQLAlchemyError, OSError) as e:
        print(f"error: {e} (registry {where})", file=sys.stderr)
        raise typer.Exit(2) from None


def _change_production(location: str | None, data_dir: Path | None, change: Callable,
                       said: Callable[[str | None, str], str]) -> None:
    """Run `change(registry)` (a promote or rollback) and say what it did: `said(was, now)`,
    or that `now` was in production already."""
    with _registry(location, data_dir) as reg:
        before = reg.production_marker()
        v = change(reg)
    typer.echo(f"{v.id} is already in production (nothing changed)" if before.version == v.id
               else said(before.version, v.id))


def _compact(d: dict, prefix: str = "") -> str:
    """`k=v, ...` with floats to 4 significant digits; nested dicts flatten to `k.sub=v`."""
    parts = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            parts.append(_compact(v, f"{name}.") if v else f"{name}=-")
        else:
            parts.append(f"{name}={v:.4g}" if isinstance(v, float) else f"{name}={v}")
    return ", ".join(parts) or "-"


def _scores(eval_scores: dict) -> dict:
    """The accuracies, less the per-task outcomes (shown apart, by size)."""
    return {k: v for k, v in eval_scores.items() if k != "outcomes"}


def _outcomes(eval_scores: dict) -> str:
    """`incumbent: add 200 tasks, ...; candidate: ...`: what the per-task outcomes cover."""
    kept = eval_scores.get("outcomes")
    if not isinstance(kept, dict) or not kept:
        return "-"
    return "; ".join(f"{who}: " + ", ".join(f"{suite} {rec.get('n', '?')} tasks" for suite, rec in suites.items())
                     for who, suites in kept.items() if isinstance(suites, dict)) or "-"


def _when(t) -> str:
    return f"{t:%Y-%m-%d %H:%M:%S}"


@app.command("list")
def list_(registry: str | None = RegistryOpt, data_dir: Path | None = DataDirOpt,
          status: str | None = typer.Option(None, help="only this status (candidate, production, archived, "
                                                       "rejected)")) -> None:
    """One line per version, oldest first; the production version is marked with *, and a
    version whose model files were pruned (only its record is left) says so in its status."""
    with _registry(registry, data_dir) as reg:
        versions = reg.list(status=status)
    if not versions:
        typer.echo(f"no versions registered in {reg.root}" if status is None else f"no {status} versions")
        return
    rows = [("", "ID", "STATUS", "PARENT", "CYCLE", "CREATED (UTC)", "USD", "EVAL")]
    for v in versions:
        usd = f"{v.usd:.4g}" if isinstance(v.usd, (int, float)) else "-"
        shown = f"{v.status} (pruned)" if v.pruned else v.status
        rows.append(("*" if v.status == "production" else "", v.id, shown, v.parent or "-", v.cycle or "-",
                     _when(v.created_at), usd, _compact(_scores(v.eval_scores))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])


@app.command("show")
def show(id: str = typer.Argument(..., help="version id, e.g. v3"), registry: str | None = RegistryOpt,
         data_dir: Path | None = DataDirOpt,
         as_json: bool = typer.Option(False, "--json", help="print the whole record as JSON")) -> None:
    """Everything recorded about one version, with its lineage and file check."""
    with _registry(registry, data_dir) as reg:
        v = reg.get(id)
        lineage = [x.id for x in reg.lineage(id)]
        problems = reg.verify(id)
    if as_json:
        typer.echo(json.dumps({**v.to_dict(), "lineage": lineage, "problems": problems}, indent=2))
        return
    lines = [
        f"id           {v.id}",
        f"status       {v.status}" + (f" ({'; '.join(v.reasons)})" if v.reasons else ""),
        f"path         {v.path}",
        f"lineage      {' <- '.join(lineage)}",
        f"cycle        {v.cycle or '-'}",
        f"created      {_when(v.created_at)} UTC",
        f"source       {v.source} ({v.storage})",
        f"files        {len(v.files)}, {v.size} bytes, "
        + ("intact" if not problems else problems[0] if v.pruned else "PROBLEMS: " + "; ".join(problems)),
        f"data counts  {_compact(v.data_counts)}",
        f"eval scores  {_compact(_scores(v.eval_scores))}",
        f"outcomes     {_outcomes(v.eval_scores)}",
        f"cost         {_compact(v.cost)}",
        f"config       {json.dumps(v.config, sort_keys=True) if v.config else '-'}",
        f"notes        {v.notes or '-'}",
    ]
    typer.echo("\n".join(lines))


@app.command("register")
def register(model_dir: Path = typer.Argument(..., help="Hugging Face model folder (config.json + weights)"),
             registry: str | None = RegistryOpt, data_dir: Path | None = DataDirOpt,
             parent: str | None = typer.Option(None, "--parent", help="version it was trained from"),
             cycle: str | None = typer.Option(None, "--cycle", help="cycle that produced it"),
             notes: str = typer.Option("", "--notes"),
             link: bool = typer.Option(False, "--link", help="hard-link the files instead of copying them")) -> None:
    """Store a copy of MODEL_DIR as a new candidate version."""
    with _registry(registry, data_dir) as reg:
        v = reg.register(model_dir, parent=parent, cycle=cycle, notes=notes, link=link)
    typer.echo(f"registered {v.id} (candidate) from {v.source} -> {v.path}")


@app.command("promote")
def promote(id: str = typer.Argument(...), registry: str | None = RegistryOpt, data_dir: Path | None = DataDirOpt,
            reason: str = typer.Option("", "--reason", help="why (kept in the history)")) -> None:
    """Make ID the production version; the current one is archived."""
    _change_production(registry, data_dir, lambda reg: reg.promote(id, reason),
                       lambda was, now: f"promoted {now} to production" + (f" (was {was})" if was else ""))


@app.command("rollback")
def rollback(registry: str | None = RegistryOpt, data_dir: Path | None = DataDirOpt,
             to: str | None = typer.Option(None, "--to", help="version to restore (default: the one the "
                                                              "current production replaced)"),
             reason: str = typer.Option("", "--reason")) -> None:
    """Put an earlier production version back into production."""
    _change_production(registry, data_dir, lambda reg: reg.rollback(to, reason),
                       lambda was, now: f"rolled back production from {was} to {now}")


@app.command("reject")
def reject(id: str = typer.Argument(...), registry: str | None = RegistryOpt, data_dir: Path | None = DataDirOpt,
           reason: list[str] = typer.Option(..., "--reason", help="why (repeat for several)")) -> None:
    """Mark ID rejected; it can no longer be promoted."""
    with _registry(registry, data_dir) as reg:
        v = reg.reject(id, reason)
    typer.echo(f"rejected {v.id}: {'; '.join(v.reasons)}")


@app.command("history")
def history(registry: str | None = RegistryOpt, data_dir: Path | None = DataDirOpt) -> None:
    """Promotions, rollbacks and rejections, oldest first."""
    with _registry(registry, data_dir) as reg:
        entries = reg.history()
    if not entries:
        typer.echo("no promotions yet")
    for e in entries:
        change = f"{e.previous or '-'} -> {e.version}" if e.action != "reject" else e.version
        typer.echo(f"{_when(e.at)}  #{e.generation:<3} {e.action:<8} {change}  {e.reason}".rstrip())
