"""Environment registry: built-ins by name, anything else by import path `pkg.module:load`
or by file `path/to/file.py:load`.

A loader is a function `load(**kwargs) -> Environment`; the settings (`--set k=v` on the
command line, `env.settings` in a config) are its keyword arguments. Import paths resolve
as `python -m` resolves them: from sys.path and, failing that, from the current directory
(the `flywheel` command's own sys.path does not hold it), so `examples.custom_env:load`
works from the repository root. A file path is loaded as a module of its own.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from flywheel.envs.base import Environment

BUILTINS = {
    "arithmetic": "flywheel.envs.arithmetic:load",
    "calculator": "flywheel.envs.calculator:load",
    "reasoning_gym": "flywheel.envs.reasoning_gym:load",
    "code_repair": "flywheel.envs.code_repair:load",
    "replay": "flywheel.envs.replay:load",
    "swe": "flywheel.envs.swe.env:load",
}

FORMS = "others load by import path 'package.module:load' or by file 'path/to/file.py:load'"


class EnvLoadError(ValueError):
    """An environment name or import path cannot be loaded; the message says why."""


def list_envs() -> dict[str, str]:
    return dict(BUILTINS)


def load_env(name: str, **kwargs: Any) -> Environment:
    path = BUILTINS.get(name, name)
    module_name, sep, attr = path.rpartition(":")  # the last colon: a Windows drive letter keeps its own
    if not sep or not module_name or not attr:
        raise EnvLoadError(f"unknown environment {name!r}: built-ins are {', '.join(BUILTINS)}; {FORMS}")
    if _is_file(module_name):
        module = _import_file(name, module_name)
    else:
        module = _import_module(name, module_name)
    loader = getattr(module, attr, None)
    if loader is None:
        found = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise EnvLoadError(f"environment {name!r}: {module_name!r} has no {attr!r}"
                           + (f" (its functions and classes: {', '.join(found)})" if found else ""))
    try:
        inspect.signature(loader).bind(**kwargs)
    except TypeError as e:
        raise EnvLoadError(f"environment {name!r}: bad settings {kwargs}: {e}") from None
    env = loader(**kwargs)
    if not isinstance(env, Environment):
        raise EnvLoadError(f"environment {name!r}: {path} returned {type(env).__name__}, not an Environment")
    return env


def _is_file(module_name: str) -> bool:
    return module_name.endswith(".py") or "/" in module_name or os.sep in module_name


def _import_module(name: str, module_name: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # not found anywhere on sys.path: look in the current directory, as `python -m` would
        cwd = os.getcwd()
        if e.name == module_name.split(".")[0] and not _on_path(cwd):
            sys.path.append(cwd)
            importlib.invalidate_caches()
            return _import_module(name, module_name)
        parts = module_name.split(".")
        missing_itself = e.name in {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        hint = (f" (looked on sys.path and in the current directory {cwd}; a file works too: "
                "'path/to/file.py:load')") if missing_itself else ""
        raise EnvLoadError(f"environment {name!r}: cannot import {module_name!r}: {e}{hint}") from None
    except ImportError as e:
        raise EnvLoadError(f"environment {name!r}: cannot import {module_name!r}: {e}") from None


def _on_path(folder: str) -> bool:
    return any(os.path.abspath(p or os.curdir) == folder for p in sys.path)


def _import_file(name: str, file: str) -> ModuleType:
    """The module of a Python file, loaded once per resolved path (kept in sys.modules under a
    name derived from the path, so classes defined there pickle and dataclasses work)."""
    path = Path(file).expanduser().resolve()
    if not path.is_file():
        raise EnvLoadError(f"environment {name!r}: no file {file!r} (from {os.getcwd()})")
    if path.suffix != ".py":
        raise EnvLoadError(f"environment {name!r}: {file!r} is not a .py file")
    stem = "".join(c if c.isalnum() else "_" for c in path.stem)
    module_name = f"_flywheel_env_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise EnvLoadError(f"environment {name!r}: cannot load {file!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        del sys.modules[module_name]
        raise EnvLoadError(f"environment {name!r}: cannot import {file!r}: {e}") from None
    except BaseException:
        del sys.modules[module_name]
        raise
    return module
