"""`flywheel swe build|validate|evaluate|import`: SWE-bench-style instances without Docker."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from flywheel.cli.errors import user_errors

app = typer.Typer(help="SWE-bench-style instances: build them from real projects, import your own, validate "
                       "them, score predictions.", no_args_is_help=True)


def _instances(tasks: Path | None):
    from flywheel.envs.swe.instance import read_instances
    from flywheel.envs.swe.synthesize import shipped_files

    files = [tasks] if tasks else shipped_files()
    if not files:
        raise ValueError("no shipped instances: run `flywheel swe build` or pass --tasks FILE")
    return [inst for f in files for inst in read_instances(f)]


@app.command("build")
def build(project: list[str] = typer.Option([], "--project", help="a built-in project (repeatable; default: all)"),
          max_n: int = typer.Option(25, "--max", help="instances kept per project at most"),
          seed: int = typer.Option(0, "--seed", help="the order mutation sites are tried in"),
          out: Path = typer.Option(None, "--out", help="folder for <project>.jsonl (default: the shipped "
                                                       "instances folder)")) -> None:
    """Synthesize instances from the pinned projects (SWE-smith's method), validate them (gold
    resolves, the empty patch does not) and write those that pass."""
    with user_errors():
        from flywheel.envs.swe.harness import validate
        from flywheel.envs.swe.instance import write_instances
        from flywheel.envs.swe.sources import PROJECTS
        from flywheel.envs.swe.synthesize import INSTANCES_DIR, build_instances

        names = project or sorted(PROJECTS)
        unknown = [n for n in names if n not in PROJECTS]
        if unknown:
            raise ValueError(f"--project {unknown[0]!r}: not a built-in project ({', '.join(sorted(PROJECTS))})")
        folder = out or INSTANCES_DIR
        total = 0
        for name in names:
            instances, report = build_instances(PROJECTS[name], max_n, seed, log=typer.echo)
            checked = validate(instances, log=typer.echo)
            write_instances(folder / f"{name}.jsonl", checked.kept)
            total += len(checked.kept)
            typer.echo(f"{name}: {report.tests} passing tests, {report.sites} sites, tried {report.tried}, "
                       f"kept {len(checked.kept)} (dropped {len(checked.dropped)} by validation) in "
                       f"{report.seconds:.0f} s -> {folder / f'{name}.jsonl'}")
        typer.echo(f"swe_build: projects={len(names)} instances={total}")


@app.command("validate")
def validate_(tasks: Path = typer.Option(None, "--tasks", help="a SWE-bench JSONL file (default: the shipped "
                                                               "instances)")) -> None:
    """Run every instance's gold patch (must resolve) and the empty patch (must not)."""
    with user_errors():
        from flywheel.envs.swe.harness import validate

        instances = _instances(tasks)
        checked = validate(instances, log=typer.echo)
        typer.echo(checked.last_line(len({i.repo for i in instances})))
        if checked.dropped:
            raise typer.Exit(1)


@app.command("evaluate")
def evaluate_(predictions: Path = typer.Argument(..., help="SWE-bench predictions: instance_id, model_patch"),
              tasks: Path = typer.Option(None, "--tasks", help="the instances (default: the shipped ones)"),
              report: Path = typer.Option(None, "--report", help="write the report (JSON) here")) -> None:
    """Score predictions: each patch on a fresh workspace, FAIL_TO_PASS and PASS_TO_PASS by pytest in the sandbox."""
    with user_errors():
        from flywheel.envs.swe.harness import evaluate
        from flywheel.envs.swe.instance import read_predictions

        by_id = {i.instance_id: i for i in _instances(tasks)}
        preds = read_predictions(predictions)
        missing = [p.instance_id for p in preds if p.instance_id not in by_id]
        if missing:
            raise ValueError(f"{predictions}: instance_id {missing[0]!r} is not among the {len(by_id)} instances "
                             f"({len(missing)} unknown)")
        rows = []
        for p in preds:
            ev = evaluate(by_id[p.instance_id], p.model_patch)
            rows.append(ev.row())
            typer.echo(f"{p.instance_id}: {'resolved' if ev.resolved else 'not resolved'}"
                       + (f" ({ev.error})" if ev.error else ""))
        resolved = sum(r["resolved"] for r in rows)
        out = {"predictions": len(rows), "instances": len(by_id), "resolved": resolved,
               "resolved_pct": round(100 * resolved / len(rows), 2),
               "resolved_ids": [r["instance_id"] for r in rows if r["resolved"]],
               "unresolved_ids": [r["instance_id"] for r in rows if not r["resolved"]], "results": rows}
        if report:
            report.write_text(json.dumps(out, indent=1) + "\n")
        typer.echo(f"swe_evaluate: predictions={len(rows)} resolved={resolved} "
                   f"resolved_pct={out['resolved_pct']:.2f}")


@app.command("import")
def import_(file: Path = typer.Argument(..., help="SWE-bench JSONL rows"),
            repos: Path = typer.Option(..., "--repos", help="folder holding the git repositories"),
            out: Path = typer.Option(Path("swe-instances.jsonl"), "--out", help="where to write the instances")) -> None:
    """Take SWE-bench instances whose repositories are on disk; check every field and commit."""
    with user_errors():
        from flywheel.envs.swe.importer import import_instances
        from flywheel.envs.swe.instance import write_instances

        instances = import_instances(file, repos)
        write_instances(out, instances)
        typer.echo(f"imported {len(instances)} instance(s) from {len({i.repo for i in instances})} repositories "
                   f"-> {out}; next: flywheel swe validate --tasks {out}")
