"""Options many commands share, each with its one default:
- `--data-dir` of the service and loop commands: $FLYWHEEL_DATA_DIR, else ./flywheel-data
  (flywheel/locations.py; $FLYWHEEL_DATA, the older name, still works);
- `--threads` on every command that runs torch: the CPUs this process may use, less those
  other processes keep busy (flywheel/threads.py)."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_HELP = "default: $FLYWHEEL_DATA_DIR, else ./flywheel-data"
THREADS_HELP = ("torch threads (default: the CPUs this process may use, by affinity and cgroup quota, less "
                "those other processes keep busy at start; OMP_NUM_THREADS also sets it)")


def data_dir_option(help: str) -> typer.models.OptionInfo:
    return typer.Option(None, "--data-dir", help=f"{help} ({DEFAULT_HELP})")


def resolve(data_dir: Path | None) -> Path:
    """The --data-dir given, else the environment's, else ./flywheel-data."""
    from flywheel.locations import data_dir as chosen

    return chosen(data_dir)


def threads_option(default: int | None = None) -> typer.models.OptionInfo:
    return typer.Option(default, "--threads", min=1, help=THREADS_HELP)


def set_threads(threads: int | None) -> int:
    """Set this process's torch threads (`threads`, else the chosen default) and say so on
    stderr (stdout may be a command's answer, as `$(flywheel model demo-base)` is); returns it."""
    from flywheel.threads import use_threads

    return use_threads(threads, log=lambda m: typer.echo(m, err=True))
