"""`flywheel keys create|list|revoke`: API keys of the service's tenants, in its job store."""

from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from flywheel.cli.options import data_dir_option, resolve
from flywheel.cli.errors import user_errors

app = typer.Typer(help="API keys of the fine-tuning service's tenants (hashed at rest).", no_args_is_help=True)

DATA_DIR = data_dir_option("the service's data directory")
DB = typer.Option(None, "--db", help="SQLAlchemy URL of the job store (default: DATA_DIR/jobs.db)")


@contextlib.contextmanager
def _keys(data_dir: Path | None, db: str | None):
    data_dir = resolve(data_dir)
    with user_errors():
        from flywheel.jobs import JobStore
        from flywheel.jobs.keys import Keys
        from flywheel.jobs.store import data_file_url

        store = JobStore(db or data_file_url(data_dir), data_dir / "files")
        try:
            yield Keys(store.engine)
        finally:
            store.close()


@app.command("create")
def create(tenant: str = typer.Option(..., "--tenant"), name: str = typer.Option(None, help="a note on the key"),
           data_dir: Path | None = DATA_DIR, db: str = DB) -> None:
    """Make a key for TENANT and print it: it is shown only now (the store keeps its hash)."""
    with _keys(data_dir, db) as keys:
        key, row = keys.create(tenant, name)
    typer.echo(key)
    typer.echo(f"{row['id']} for tenant {tenant}: keep the key above, it cannot be shown again", err=True)


@app.command("list")
def list_keys(tenant: str = typer.Option(None, "--tenant"), data_dir: Path | None = DATA_DIR, db: str = DB) -> None:
    """Keys (id, tenant, first characters, state), never the keys themselves."""
    with _keys(data_dir, db) as keys:
        for k in keys.list(tenant):
            state = f"revoked {k['revoked_at']:%Y-%m-%d %H:%M}" if k["revoked_at"] else "active"
            typer.echo(f"{k['id']}  {k['tenant']}  {k['prefix']}...  {state}  {k['name'] or ''}")


@app.command("revoke")
def revoke(key_id: str, data_dir: Path | None = DATA_DIR, db: str = DB) -> None:
    """Revoke a key by its id (from `flywheel keys list`); requests with it get a 401."""
    with _keys(data_dir, db) as keys:
        from flywheel.jobs import NotFound

        try:
            keys.revoke(key_id)
        except NotFound as e:
            raise ValueError(str(e)) from None
    typer.echo(f"revoked {key_id}")
