"""`--data-dir` of the service and loop commands, with one default: $FLYWHEEL_DATA_DIR, else
./flywheel-data (flywheel/locations.py; $FLYWHEEL_DATA, the older name, still works)."""

from __future__ import annotations

from pathlib import Path

import typer

DEFAULT_HELP = "default: $FLYWHEEL_DATA_DIR, else ./flywheel-data"


def data_dir_option(help: str) -> typer.models.OptionInfo:
    return typer.Option(None, "--data-dir", help=f"{help} ({DEFAULT_HELP})")


def resolve(data_dir: Path | None) -> Path:
    """The --data-dir given, else the environment's, else ./flywheel-data."""
    from flywheel.locations import data_dir as chosen

    return chosen(data_dir)
