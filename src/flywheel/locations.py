"""Where flywheel keeps files when nobody says: the cache and the data folder, each named by
one environment variable.

- cache (built once, safe to delete: the demo's base model, synthesized code_repair tasks):
  $FLYWHEEL_CACHE_DIR, else $XDG_CACHE_HOME/flywheel, else ~/.cache/flywheel;
- data (what a loop, a server and its workers keep: registry/, traces.db, jobs.db, cycles/):
  $FLYWHEEL_DATA_DIR, else ./flywheel-data; a `--data-dir` or a config's `data_dir` wins.
The older names, $FLYWHEEL_CACHE and $FLYWHEEL_DATA, still work with a FutureWarning (shown to
users by default, unlike a DeprecationWarning); the new name wins when both are set.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Mapping

CACHE_VAR, OLD_CACHE_VAR = "FLYWHEEL_CACHE_DIR", "FLYWHEEL_CACHE"
DATA_VAR, OLD_DATA_VAR = "FLYWHEEL_DATA_DIR", "FLYWHEEL_DATA"
DEFAULT_DATA = Path("flywheel-data")


def from_env(name: str, old: str, env: Mapping[str, str] | None = None) -> str | None:
    """$name, else $old with a FutureWarning naming the new variable; None when neither is set."""
    env = os.environ if env is None else env
    if env.get(name):
        return env[name]
    if env.get(old):
        warnings.warn(f"${old} is deprecated; set ${name} instead", FutureWarning, stacklevel=3)
        return env[old]
    return None


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """$FLYWHEEL_CACHE_DIR, else $XDG_CACHE_HOME/flywheel, else ~/.cache/flywheel."""
    env = os.environ if env is None else env
    chosen = from_env(CACHE_VAR, OLD_CACHE_VAR, env)
    if chosen:
        return Path(chosen).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "flywheel"


def data_dir(given: str | Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """`given` (a --data-dir), else $FLYWHEEL_DATA_DIR, else ./flywheel-data (relative, as given)."""
    if given is not None:
        return Path(given)
    chosen = from_env(DATA_VAR, OLD_DATA_VAR, env)
    return Path(chosen).expanduser() if chosen else DEFAULT_DATA


def data_dir_source(given: str | Path | None = None, env: Mapping[str, str] | None = None) -> str:
    """Where data_dir(given, env) came from, for a message: "--data-dir", "$FLYWHEEL_DATA_DIR",
    "$FLYWHEEL_DATA" or "the default"."""
    env = os.environ if env is None else env
    if given is not None:
        return "--data-dir"
    if env.get(DATA_VAR):
        return f"${DATA_VAR}"
    return f"${OLD_DATA_VAR}" if env.get(OLD_DATA_VAR) else "the default"
