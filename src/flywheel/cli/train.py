"""`flywheel sft|dpo|rl CONFIG [key=value ...]`: one training run from a YAML config.

SIGTERM or Ctrl-C asks the run to stop at its next step: it checkpoints, says "interrupted
at step N", writes no final model and exits with code 3; the same command with resume=true
continues exactly from there. A second Ctrl-C exits at once.
"""

from __future__ import annotations

import signal
from pathlib import Path

import typer

from flywheel.cli.errors import user_errors
from flywheel.cli.options import set_threads

CONFIG = typer.Argument(..., help="YAML config (see configs/)")
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


def stop_on_signals(say=typer.echo) -> None:
    """SIGTERM and the first SIGINT ask running training loops to stop after their step
    (train.stop); a second SIGINT raises KeyboardInterrupt as usual."""
    from flywheel.train.stop import request_stop

    def on_signal(signum, _frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        say(f"{signal.Signals(signum).name}: stopping after the current step (Ctrl-C again to exit at once)")
        request_stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _run(kind: str, ctx: typer.Context, config: Path) -> None:
    with user_errors():
        from flywheel.config import DPOConfig, RLConfig, SFTConfig, load_config

        classes = {"sft": SFTConfig, "dpo": DPOConfig, "rl": RLConfig}
        cfg = load_config(config, classes[kind], ctx.args)
        set_threads(cfg.threads)  # the config's `threads`, else the chosen default (train/rl.py splits it for RL)
        stop_on_signals()
        if kind == "sft":
            from flywheel.train.sft import run_sft as run
        elif kind == "dpo":
            from flywheel.train.dpo import run_dpo as run
        else:
            from flywheel.train.rl import run_rl as run
        result = run(cfg)
    if result.interrupted:
        raise typer.Exit(3)
    typer.echo(f"final model: {result.final_model}")


def sft(ctx: typer.Context, config: Path = CONFIG) -> None:
    """Supervised fine-tuning; extra arguments are dotted overrides, e.g. train.steps=100 resume=true."""
    _run("sft", ctx, config)


def dpo(ctx: typer.Context, config: Path = CONFIG) -> None:
    """DPO from OpenAI-format preference pairs with a frozen reference; extra arguments are dotted
    overrides, e.g. beta=0.1 resume=true."""
    _run("dpo", ctx, config)


def rl(ctx: typer.Context, config: Path = CONFIG) -> None:
    """GRPO-family RL; extra arguments are dotted overrides, e.g. train.steps=50 algo.eps_high=0.28."""
    _run("rl", ctx, config)
