"""`flywheel flywheels ...`: managed flywheels from the shell, over the SDK (flywheel.client),
against --base-url / FLYWHEEL_BASE_URL with FLYWHEEL_API_KEY (as `flywheel jobs`).

`create` takes the body of POST /v1/flywheels from a YAML or JSON file (--config) with a few
common settings as flags over it; a field the server refuses is reported at its line of the
file when the file gave it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from flywheel.cli.jobs import BASE_URL, _row, client

app = typer.Typer(help="Managed flywheels on a flywheel server: continuous, gated training cycles of your model, "
                       "served under its production alias.", no_args_is_help=True)


class ConfigFileError(Exception):
    pass


def _fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def read_config(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The body in `path` (JSON for a .json name, else YAML) and the 1-based line of each of
    its fields by dotted name ("gate.delta"; list items by index); ConfigFileError naming the
    file, and the line where the parser knows it."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read it: {e.strerror or e}") from None
    if path.suffix.lower() == ".json":
        try:
            body = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"{path}: line {e.lineno}: invalid JSON: {e.msg}") from None
    else:
        try:
            body = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}: line {mark.line + 1}" if mark is not None else str(path)
            raise ConfigFileError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigFileError(f"{path}: the top level must be a mapping of the body's fields, "
                              f"got {type(body).__name__}")
    try:  # JSON is YAML enough for line numbers; none when it is not
        lines = _lines(yaml.compose(text))
    except yaml.YAMLError:
        lines = {}
    return body, lines


def _lines(node, prefix: str = "") -> dict[str, int]:
    import yaml

    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        items = [(str(k.value), k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]
    elif isinstance(node, yaml.SequenceNode):
        items = [(str(i), v, v) for i, v in enumerate(node.value)]
    else:
        return out
    for name, at, value in items:
        key = f"{prefix}{name}"
        out[key] = at.start_mark.line + 1
        out.update(_lines(value, key + "."))
    return out


def _line_of(param: str | None, lines: dict[str, int], flags: set[str]) -> int | None:
    """The file's line of `param` (or of its nearest enclosing field), unless a flag set it."""
    if not param:
        return None
    parts = param.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in flags:
            return None
        if key in lines:
            return lines[key]
    return None


def _put(body: dict[str, Any], dotted: str, value: Any, flags: set[str]) -> None:
    node = body
    *parents, last = dotted.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value
    flags.add(dotted)


@app.command("create")
def create(model: str = typer.Option(None, help="the model to start from: a base model the server offers, or one "
                                                "of your fine-tuned models (or `model` in --config)"),
           suffix: str = typer.Option(None, help="names the production alias ft:<model>:<tenant>:<suffix>:production "
                                                 "(default flywheel)"),
           config: Path = typer.Option(None, "--config", dir_okay=False,
                                       help="a YAML or JSON file with the rest of the body of POST /v1/flywheels "
                                            "(traces, training, curation, eval, gate, trigger, budget_usd, metadata)"),
           order: str = typer.Option(None, "--order", help="the stages a cycle trains, in order: sft,rl,dpo "
                                                           "(training.order)"),
           lora_rank: int = typer.Option(None, "--lora-rank", min=1, help="train LoRA adapters of this rank "
                                                                           "(alpha twice the rank)"),
           full: bool = typer.Option(False, "--full", help="train every weight (no LoRA adapter)"),
           min_new_failures: int = typer.Option(None, "--min-new-failures", min=1,
                                                help="start a cycle once this many failed traces arrived "
                                                     "(trigger.min_new_failures)"),
           budget_usd: float = typer.Option(None, "--budget-usd", help="dollars a cycle's training may spend"),
           delta: float = typer.Option(None, "--delta", help="the least gain on the new failures the gate promotes "
                                                             "for (gate.delta; 0.05 = 5 points)"),
           epsilon: float = typer.Option(None, "--epsilon", help="the largest drop on a frozen suite the gate "
                                                                 "tolerates (gate.epsilon)"),
           base_url: str = BASE_URL) -> None:
    """Create a managed flywheel; prints its id and its production alias (the model name its
    clients call)."""
    from flywheel.client import FlywheelError

    if lora_rank is not None and full:
        _fail("--lora-rank and --full: choose one")
    body, lines = {}, {}
    if config is not None:
        try:
            body, lines = read_config(config)
        except ConfigFileError as e:
            _fail(str(e))
    flags: set[str] = set()
    if model is not None:
        _put(body, "model", model, flags)
    if suffix is not None:
        _put(body, "suffix", suffix, flags)
    if order is not None:
        _put(body, "training.order", [s.strip() for s in order.split(",") if s.strip()], flags)
    if lora_rank is not None:
        _put(body, "training.lora", {"rank": lora_rank, "alpha": 2 * lora_rank}, flags)
    elif full:
        _put(body, "training.lora", "full", flags)
    for dotted, value in (("trigger.min_new_failures", min_new_failures), ("budget_usd", budget_usd),
                          ("gate.delta", delta), ("gate.epsilon", epsilon)):
        if value is not None:
            _put(body, dotted, value, flags)
    if "model" not in body:
        _fail("no model: give --model (or `model` in --config)")
    with client(base_url) as fw:
        try:
            made = fw.flywheels.create(**body)
        except FlywheelError as e:
            line = _line_of(e.param, lines, flags)
            if line is None:
                raise
            _fail(f"{config}: line {line}: {e}" + (f" (param: {e.param})" if e.param else ""), 1)
    _row(made.id, made.production_model)


@app.command("show")
def show(flywheel_id: str, base_url: str = BASE_URL) -> None:
    """The flywheel as the server returns it (JSON)."""
    with client(base_url) as fw:
        typer.echo(json.dumps(fw.flywheels.retrieve(flywheel_id).raw, indent=2))


@app.command("list")
def list_flywheels(base_url: str = BASE_URL, limit: int = typer.Option(20, min=1, max=100),
                   after: str = typer.Option(None, help="the page after this flywheel id")) -> None:
    """Your flywheels, newest first: id, status, model, production alias, production version."""
    with client(base_url) as fw:
        for f in fw.flywheels.list(after=after, limit=limit):
            _row(f.id, f.status, f.model, f.production_model, f.production_version)


def _cost(usd: float | None) -> str:
    return "-" if usd is None else f"${usd:.4f}"


@app.command("cycles")
def cycles(flywheel_id: str, base_url: str = BASE_URL) -> None:
    """The flywheel's cycles, newest first: number, status, outcome, why it started, the version
    it registered, its cost and the gate's reasons."""
    with client(base_url) as fw:
        found = fw.flywheels.cycles(flywheel_id).data
    if not found:
        typer.echo(f"{flywheel_id}: no cycles yet")
        return
    table = [("#", "status", "outcome", "reason", "version", "cost", "gate")]
    table += [(str(c.number), c.status, c.outcome or "-", c.reason, c.version or "-", _cost(c.estimated_cost),
               "; ".join(c.reasons) or (c.error or {}).get("message") or "-") for c in found]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        typer.echo("  ".join([cell.ljust(w) for cell, w in zip(row, widths)] + [row[-1]]))


@app.command("run")
def run(flywheel_id: str, base_url: str = BASE_URL) -> None:
    """Start a cycle now, whatever the trigger says; prints the cycle, its number, status and job."""
    with client(base_url) as fw:
        c = fw.flywheels.run_cycle(flywheel_id)
    _row(c.id, c.number, c.status, c.fine_tuning_job_id)


@app.command("rollback")
def rollback(flywheel_id: str, to: str = typer.Option(None, "--to", help="a version that was in production (vN); "
                                                                          "default: the one production replaced"),
             base_url: str = BASE_URL) -> None:
    """Put production back one promotion (or to --to); prints the production version and model."""
    with client(base_url) as fw:
        f = fw.flywheels.rollback(flywheel_id, to=to)
    _row(f.id, f.production_version, f.production["model"])
