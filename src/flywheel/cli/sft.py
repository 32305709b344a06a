"""`flywheel sft CONFIG [key=value ...]`: supervised fine-tuning."""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.errors import user_errors


def sft(ctx: typer.Context,
        config: Path = typer.Argument(..., help="YAML config (see configs/)")) -> None:
    """Supervised fine-tuning; extra arguments are dotted overrides, e.g. train.steps=100 resume=true."""
    with user_errors():
        from flywheel.config import SFTConfig, load_config
        from flywheel.train.sft import run_sft

        cfg = load_config(config, SFTConfig, ctx.args)
        result = run_sft(cfg)
        typer.echo(f"final model: {result.final_model}")
