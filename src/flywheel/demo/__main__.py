"""`python -m flywheel.demo [OPTIONS]`: the same command as `flywheel demo`."""

import typer

from flywheel.cli.demo import demo

typer.run(demo)
