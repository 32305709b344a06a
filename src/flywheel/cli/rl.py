"""`flywheel rl CONFIG [key=value ...]`: reinforcement learning on an environment."""

from __future__ import annotations

from pathlib import Path

import typer

from flywheel.cli.errors import user_errors


def rl(ctx: typer.Context, config: Path = typer.Argument(..., help="YAML config (see configs/)")) -> None:
    """GRPO-family RL; extra arguments are dotted overrides, e.g. train.steps=50 algo.eps_high=0.28."""
    with user_errors():
        from flywheel.config import RLConfig, load_config
        from flywheel.train.rl import run_rl

        result = run_rl(load_config(config, RLConfig, ctx.args))
        typer.echo(f"final model: {result.final_model}")
