"""Turn the core's input errors into one clear line and exit code 2, not a traceback."""

from __future__ import annotations

import contextlib
import sys

import typer


@contextlib.contextmanager
def user_errors():
    from flywheel.config import ConfigError
    from flywheel.envs.registry import EnvLoadError
    from flywheel.models import ChatTemplateError, ModelLoadError
    from flywheel.train.sft_data import DataError
    from flywheel.errors import TrainError
    from flywheel.envs.swe.sources import SourceError

    try:
        yield
    except (ConfigError, EnvLoadError, ModelLoadError, DataError, TrainError, ChatTemplateError, SourceError,
            ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(2) from None
