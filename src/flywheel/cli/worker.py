"""`flywheel worker`: take fine-tuning jobs from the service's queue and train them."""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from flywheel.cli.options import data_dir_option, resolve
from flywheel.cli.errors import user_errors


def parse_base_models(specs: list[str]) -> dict[str, Path]:
    """`NAME=FOLDER` pairs (what jobs may name as `model`); an error naming a bad one."""
    models = {}
    for spec in specs:
        name, sep, folder = spec.partition("=")
        if not sep or not name or not folder:
            raise ValueError(f"--base-model {spec!r}: expected NAME=FOLDER")
        if not (Path(folder) / "config.json").exists():
            raise ValueError(f"--base-model {spec!r}: {folder} is not a model folder (no config.json)")
        models[name] = Path(folder)
    return models


def worker(data_dir: Path | None = data_dir_option("the service's data directory, shared by its server and workers"),
           db: str = typer.Option(None, "--db", help="SQLAlchemy URL of the job store (default: DATA_DIR/jobs.db)"),
           base_model: list[str] = typer.Option([], "--base-model", help="NAME=FOLDER, a model jobs may start "
                                                                         "from (repeat); as the server's"),
           lease_s: float = typer.Option(30.0, min=1.0, help="a job whose worker is silent this long is taken "
                                                           "up by another"),
           threads: int = typer.Option(None, min=1, help="torch threads of each job's training process "
                                       "(default: chosen there from the CPUs it may use, less those other "
                                       "processes keep busy; OMP_NUM_THREADS also sets it)"),
           hardware: str = typer.Option("cpu-2core", help="catalog entry the cost ledger prices this worker at"),
           max_running: int = typer.Option(2, "--max-running-per-tenant", min=1,
                                           help="jobs of one tenant trained at once by all workers"),
           once: bool = typer.Option(False, "--once", help="run one job (or none) and exit")) -> None:
    """Take queued fine-tuning jobs one at a time and train them; SIGTERM puts the running job back
    in the queue at a checkpoint and exits."""
    data_dir = resolve(data_dir)
    with user_errors():
        from flywheel.jobs import JobStore
        from flywheel.jobs.store import data_file_url
        from flywheel.worker.job_worker import JobWorker

        store = JobStore(db or data_file_url(data_dir), data_dir / "files")
        w = JobWorker(store, parse_base_models(base_model), data_dir / "jobs", lease_s=lease_s, threads=threads,
                      hardware=hardware, max_running=max_running, log=typer.echo)
        signal.signal(signal.SIGTERM, lambda *_: w.stopping.set())
        typer.echo(f"worker {w.name}: waiting for jobs in {db or data_file_url(data_dir)}")
        try:
            if once:
                w.run_one()
            else:
                w.run()
        finally:
            store.close()
