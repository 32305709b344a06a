"""`flywheel dpo CONFIG [key=value ...]`: direct preference optimisation."""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.errors import user_errors


def dpo(ctx: typer.Context, config: Path = typer.Argument(..., help="YAML config (see configs/)")) -> None:
    """DPO from OpenAI-format preference pairs with a frozen reference; extra arguments are overrides."""
    with user_errors():
        from flywheel.config import DPOConfig, load_config
        from flywheel.train.dpo import run_dpo

        result = run_dpo(load_config(config, DPOConfig, ctx.args))
        typer.echo(f"final model: {result.final_model}")
