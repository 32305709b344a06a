"""`flywheel serve`: the OpenAI-compatible HTTP server over a local model, with trace capture."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from flywheel.cli.errors import user_errors
from flywheel.cli.options import data_dir_option, resolve, set_threads, threads_option


def serve(model: Path = typer.Option(None, "--model", help="a local model folder, served as it is (one version)"),
          follow: bool = typer.Option(False, "--follow", help=(
              "serve the production version of DATA_DIR's registry (instead of --model) and switch to each "
              "version promoted or rolled back, without failing requests in flight")),
          host: str = typer.Option("127.0.0.1", help="interface to listen on"),
          port: int = typer.Option(8000, min=0, max=65535),
          name: str = typer.Option("flywheel", "--name", help="the model name clients put in `model`"),
          version: str = typer.Option(None, "--version-label",
                                      help="version label reported as system_fingerprint (default: the folder name)"),
          traces_db: str = typer.Option(None, "--traces-db",
                                        help="SQLAlchemy URL of the trace store (default: DATA_DIR/traces.db)"),
          no_traces: bool = typer.Option(False, "--no-traces", help="do not record traces"),
          ingest_workers: int = typer.Option(
              None, min=0, help="processes that decode and validate POST /v1/traces batches "
                                "(default: the CPU count, at most 4; 0: the server's own process)"),
          max_batch: int = typer.Option(64, min=1, help="most sample rows (sum of n) per forward batch"),
          batch_window_ms: float = typer.Option(2.0, min=0.0, help="how long a batch waits for more requests"),
          default_max_tokens: int = typer.Option(512, min=1, help="budget of chat requests that set none"),
          dtype: str = typer.Option("float32"), device: str = typer.Option("cpu"),
          threads: int = threads_option(),
          fine_tuning_on: bool = typer.Option(False, "--fine-tuning", help="serve the fine-tuning API (/v1/files, "
                                                                         "/v1/fine_tuning/jobs; docs/api.md)"),
          data_dir: Path | None = data_dir_option("the trace store; with --fine-tuning also the job store, files "
                                                  "and job folders, shared with `flywheel worker`"),
          jobs_db: str = typer.Option(None, "--jobs-db", help="SQLAlchemy URL of the job store "
                                                             "(default: DATA_DIR/jobs.db)"),
          base_model: list[str] = typer.Option([], "--base-model", help="with --fine-tuning: NAME=FOLDER, another "
                                                                        "model jobs may start from (repeat)"),
          hardware: str = typer.Option("cpu-2core", help="with --fine-tuning: the catalog entry (flywheel economics "
                                                          "hardware) /dashboard prices serving at"),
          log_level: str = typer.Option("info")) -> None:
    """Serve a model over /v1/chat/completions, /v1/completions and /v1/models; record every response as a
    trace; take traces and feedback from other stacks on POST /v1/traces and /v1/traces/{id}/feedback."""
    if no_traces and traces_db:
        print("error: --traces-db and --no-traces exclude each other", file=sys.stderr)
        raise typer.Exit(2)
    if (model is None) == (not follow):
        print("error: serve a model folder (--model DIR) or follow the registry's production version (--follow), "
              "one of the two", file=sys.stderr)
        raise typer.Exit(2)
    try:
        import uvicorn  # noqa: F401 - the serve extra

        from flywheel.serve.builder import ServerConfig, build_server
        from flywheel.serve.ingest_pool import default_ingest_workers
    except ImportError as e:
        print(f"error: {e.name} is missing; install the serve extra: pip install 'flywheel[serve]'", file=sys.stderr)
        raise typer.Exit(2) from None
    with user_errors():
        from flywheel.traces import TraceStore

        set_threads(threads)
        data_dir = resolve(data_dir)
        store = None if no_traces else TraceStore(traces_db or f"sqlite:///{(data_dir / 'traces.db').resolve()}",
                                                  default_source="serve")
        registry = _registry(data_dir) if follow else None
        fine_tuning, tenant_of = _fine_tuning(data_dir, jobs_db, name, model or registry, base_model, host) \
            if fine_tuning_on else (None, None)
        server = build_server(ServerConfig(
            model=model, follow=registry, name=name, version=version, host=host, port=port, trace_store=store,
            ingest_workers=default_ingest_workers() if ingest_workers is None else ingest_workers,
            max_batch=max_batch, window_s=batch_window_ms / 1000, default_max_tokens=default_max_tokens,
            dtype=dtype, device=device, fine_tuning=fine_tuning, log_level=log_level,
            **({"tenant_of": tenant_of} if tenant_of else {})), log=typer.echo)
        if fine_tuning is not None:
            from flywheel.economics.catalog import load_catalog
            from flywheel.serve.dashboard.data import DashboardConfig

            server.app.state.dashboard = DashboardConfig(hardware=load_catalog().get(hardware).name)
            typer.echo(f"dashboard: http://{host}:{port}/dashboard (docs/dashboard.md)")
    where = "traces off" if store is None else f"traces -> {store.url}"
    typer.echo(f"serving {name} ({server.version}) on http://{host}:{port}/v1 ({where})")
    typer.echo(server.service.template_note())
    try:
        server.serve_forever()
    finally:
        if store is not None:
            store.close()
        if registry is not None:
            registry.close()


def _registry(data_dir: Path):
    from flywheel.registry.registry import Registry

    return Registry(data_dir / "registry")


def _fine_tuning(data_dir: Path, jobs_db: str | None, name: str, served, base_model: list[str], host: str):
    """(the fine-tuning core over DATA_DIR's job store, the tenant rule: API keys when any exist,
    else one tenant on loopback only)."""
    from flywheel.cli.worker import parse_base_models
    from flywheel.finetuning.fine_tuning import FineTuning
    from flywheel.jobs import JobStore
    from flywheel.jobs.keys import Keys
    from flywheel.jobs.store import data_file_url
    from flywheel.serve.auth import KeyAuth

    jobs = JobStore(jobs_db or data_file_url(data_dir), data_dir / "files")
    served_path = served if isinstance(served, Path) else served.production().path
    ft = FineTuning(jobs, {name: served_path, **parse_base_models(base_model)})
    keys = Keys(jobs.engine)
    tenant_of = None
    if keys.any():
        tenant_of = KeyAuth(keys)
        typer.echo("API keys required (flywheel keys list); each key's tenant sees only its own objects")
    elif host not in ("127.0.0.1", "localhost", "::1"):
        print(f"error: no API keys exist, so the server would be open to anyone on {host}; make one with "
              f"`flywheel keys create --tenant NAME --data-dir {data_dir}`, or serve on 127.0.0.1", file=sys.stderr)
        raise typer.Exit(2)
    else:
        typer.echo("single tenant, no API keys, loopback only (flywheel keys create --tenant NAME adds keys)")
    typer.echo(f"fine-tuning API on: jobs in {jobs_db or data_file_url(data_dir)}; start workers with "
               f"`flywheel worker --data-dir {data_dir} --base-model {name}={served_path}`")
    return ft, tenant_of
