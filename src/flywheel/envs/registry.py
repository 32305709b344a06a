"""Environment registry: built-ins by name, anything else by import path `pkg.module:load`.

A loader is a function `load(**kwargs) -> Environment`.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from flywheel.envs.base import Environment

BUILTINS = {
    "arithmetic": "flywheel.envs.arithmetic:load",
    "calculator": "flywheel.envs.calculator:load",
    "reasoning_gym": "flywheel.envs.reasoning_gym:load",
    "code_repair": "flywheel.envs.code_repair:load",
    "replay": "flywheel.envs.replay:load",
}


class EnvLoadError(ValueError):
    """An environment name or import path cannot be loaded; the message says why."""


def list_envs() -> dict[str, str]:
    return dict(BUILTINS)


def load_env(name: str, **kwargs: Any) -> Environment:
    path = BUILTINS.get(name, name)
    module_name, sep, attr = path.partition(":")
    if not sep:
        raise EnvLoadError(f"unknown environment {name!r}: built-ins are {', '.join(BUILTINS)}; "
                           "others load by import path 'package.module:load'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise EnvLoadError(f"environment {name!r}: cannot import {module_name!r}: {e}") from None
    loader = getattr(module, attr, None)
    if loader is None:
        raise EnvLoadError(f"environment {name!r}: {module_name!r} has no {attr!r}")
    try:
        inspect.signature(loader).bind(**kwargs)
    except TypeError as e:
        raise EnvLoadError(f"environment {name!r}: bad settings {kwargs}: {e}") from None
    env = loader(**kwargs)
    if not isinstance(env, Environment):
        raise EnvLoadError(f"environment {name!r}: {path} returned {type(env).__name__}, not an Environment")
    return env
