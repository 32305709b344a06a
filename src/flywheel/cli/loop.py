"""`flywheel loop run|cycle|status`: the continuous flywheel from the command line."""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import typer

from flywheel.cli.errors import user_errors
from flywheel.cli.options import set_threads, threads_option

app = typer.Typer(help="The continuous flywheel: serve, take traces, run gated training cycles.",
                  no_args_is_help=True)

CONFIG_HELP = "loop config YAML (see configs/loop.yaml)"


def _load(config: Path, overrides: list[str]):
    from flywheel.config import load_config
    from flywheel.loop.loop_config import LoopConfig, check_stages

    cfg = load_config(config, LoopConfig, overrides)
    check_stages(cfg)
    return cfg


@app.command("cycle", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def cycle(ctx: typer.Context, config: Path = typer.Argument(..., help=CONFIG_HELP),
          threads: int = threads_option()) -> None:
    """Run one cycle now (or finish the unfinished one): curate, train, gate, promote or reject.
    Extra arguments are dotted overrides of the config, e.g. train.order=[sft]."""
    with user_errors():
        cfg = _load(config, ctx.args)  # a bad config is refused before torch and the loop are imported
        from flywheel.cli.train import stop_on_signals
        from flywheel.loop.cycle import CycleError, LoopStores, run_cycle
        from flywheel.loop.store_lock import StoreLocked, hold_store

        set_threads(threads)
        stop_on_signals()
        try:
            with hold_store(cfg.root, "flywheel loop cycle"), LoopStores(cfg) as fw:
                st = run_cycle(fw, log=typer.echo)
        except (CycleError, StoreLocked) as e:
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(2) from None
    if not st.done:
        typer.echo(f"{st.id}: stopped after stage {st.stage!r}; run the command again to resume")
        raise typer.Exit(3)
    typer.echo(f"{st.id}: {st.outcome}" + (f" {st.version}" if st.version else "") + f", ${st.usd:.4f}")


@app.command("run", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run(ctx: typer.Context, config: Path = typer.Argument(..., help=CONFIG_HELP),
        threads: int = threads_option()) -> None:
    """Serve the production model, take traces and feedback, and run cycles when triggered,
    until SIGTERM / Ctrl-C (a cycle in progress stops after its current step and resumes next time).
    Extra arguments are dotted overrides of the config, e.g. trigger.min_new_failures=50."""
    with user_errors():
        cfg = _load(config, ctx.args)  # a bad config is refused before torch and the loop are imported
        from flywheel.daemon.loop_daemon import LoopDaemon
        from flywheel.loop.cycle import CycleError
        from flywheel.loop.store_lock import StoreLocked

        set_threads(threads)
        daemon = LoopDaemon(cfg, log=lambda m: typer.echo(f"{time.strftime('%H:%M:%S')} {m}"))

        def on_signal(signum, frame):
            typer.echo(f"{signal.Signals(signum).name}: stopping (a cycle in progress resumes on the next run)")
            daemon.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        try:
            daemon.run()
        except (CycleError, StoreLocked) as e:  # nothing in production, unreadable anchor data, a held store
            print(f"error: {e}", file=sys.stderr)
            raise typer.Exit(2) from None
    typer.echo("stopped")


def _status_data_dir(config: Path | None, data_dir: Path | None) -> tuple[Path, str]:
    """The folder `loop status` reads, absolute, and where it came from: --data-dir, else the
    config's data_dir, else $FLYWHEEL_DATA_DIR (locations.py), else ./flywheel-data."""
    from flywheel.locations import data_dir as default_data_dir, data_dir_source

    if data_dir is not None:
        return data_dir.resolve(), "--data-dir"
    if config is not None:
        with user_errors():
            return Path(_load(config, []).data_dir).resolve(), f"the data_dir of {config}"
    return default_data_dir().resolve(), data_dir_source()


@app.command("status")
def status(config: Path | None = typer.Argument(None, help=CONFIG_HELP + "; its data_dir is the one shown"),
           data_dir: Path | None = typer.Option(None, "--data-dir", help="the loop's data_dir (default: the config's, "
                                                "else $FLYWHEEL_DATA_DIR, else ./flywheel-data)"),
           as_json: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """The daemon's state, the production model, the cycles so far and the disk each uses
    (its folder under cycles/, and its candidate's model in the registry: pruned or kept).
    Its first line names the data_dir it read and where that came from."""
    from flywheel.loop.curation import dropped_summary
    from flywheel.loop.cycle import WAITING, CycleError, read_states
    from flywheel.loop.retention import human_bytes, tree_bytes
    from flywheel.process import pid_alive
    from flywheel.daemon.loop_daemon import STATUS_FILE

    data_dir, source = _status_data_dir(config, data_dir)
    status_path = data_dir / STATUS_FILE
    daemon = json.loads(status_path.read_text()) if status_path.exists() else None
    if daemon is not None and daemon.get("state") not in ("stopped",) and not pid_alive(daemon["pid"]):
        daemon["state"] = f"not running (pid {daemon['pid']} gone; last state {daemon['state']!r})"
    try:
        states = read_states(data_dir / "cycles")
    except CycleError as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
    cycles = [{k: getattr(st, k) for k in ("id", "stage", "outcome", "version", "incumbent", "new_failures",
                                            "usd", "started_at", "finished_at", "warnings")}
              | {"scores": st.scores, "reasons": st.decision.get("reasons", []),
                 "dropped": dropped_summary(st.curation)} for st in states]
    production, versions = None, {}
    if (data_dir / "registry" / "registry.db").exists():
        from flywheel.registry import Registry

        with Registry(data_dir / "registry") as reg:
            prod = reg.production()
            production = prod.id if prod else None
            versions = {v.id: v for v in reg.list()}
    for c in cycles:
        v = versions.get(c["version"])
        c["disk"] = {"cycle_bytes": tree_bytes(data_dir / "cycles" / c["id"]),
                     "model_bytes": tree_bytes(v.path) if v else None, "model_pruned": bool(v and v.pruned)}
    disk = {"total_bytes": tree_bytes(data_dir), "registry_bytes": tree_bytes(data_dir / "registry"),
            "cycles_bytes": tree_bytes(data_dir / "cycles")}
    if as_json:
        typer.echo(json.dumps({"data_dir": str(data_dir), "data_dir_from": source, "daemon": daemon,
                               "production": production, "disk": disk, "cycles": cycles}, indent=2))
        return
    typer.echo(f"data_dir: {data_dir} (from {source}; a loop config, --data-dir DIR or $FLYWHEEL_DATA_DIR reads "
               "another)")
    if daemon is None:
        typer.echo(f"daemon: never ran with data_dir {data_dir}")
    elif daemon["state"] == "stopped" or daemon["state"].startswith("not running"):
        typer.echo(f"daemon: {daemon['state']} (pid {daemon['pid']}); it last served {daemon.get('serving')}")
    else:
        typer.echo(f"daemon: {daemon['state']} (pid {daemon['pid']}), serving {daemon.get('serving')} "
                   f"at {daemon.get('url')}; {daemon.get('new_failures', 0)} new failures "
                   f"[{daemon.get('trigger', '')}]")
        if daemon.get("waiting"):
            typer.echo(f"  {WAITING}: {daemon['waiting']}")
    typer.echo(f"production: {production or 'none'}")
    typer.echo(f"disk: {human_bytes(disk['total_bytes'])} in {data_dir} (registry {human_bytes(disk['registry_bytes'])}"
               f", cycles {human_bytes(disk['cycles_bytes'])})")
    for c in cycles:
        new = {who: s.get("new_failures") for who, s in c["scores"].items()}
        gate = f" new failures {new.get('incumbent', float('nan')):.3f} -> {new.get('candidate', float('nan')):.3f}" \
            if all(v is not None for v in new.values()) and new else ""
        d = c["disk"]
        model = "" if d["model_bytes"] is None else " + model pruned" if d["model_pruned"] else \
            f" + model {human_bytes(d['model_bytes'])}"
        typer.echo(f"  {c['id']}: {c['outcome'] or c['stage']}{' ' + c['version'] if c['version'] else ''} "
                   f"from {c['incumbent']},{gate} ${c['usd'] or 0:.4f}; disk {human_bytes(d['cycle_bytes'])}{model}")
        if c["reasons"] and c["outcome"] in ("rejected", WAITING):
            typer.echo("      " + "; ".join(c["reasons"]))
        for line in ([c["dropped"]] if c["dropped"] else []) + [f"warning: {w}" for w in c["warnings"]]:
            typer.echo("      " + line)
