"""Model versions: `Registry` (versions with lineage, one production version, promote /
rollback / reject with history, `production_marker()`), stored as folders plus a SQLite index."""

from flywheel.registry.registry import Registry, default_root
from flywheel.registry.storage import (
    HistoryEntry,
    InvalidModelFolder,
    ProductionMarker,
    RegistryError,
    StatusError,
    Version,
    VersionNotFound,
)

__all__ = ["HistoryEntry", "InvalidModelFolder", "ProductionMarker", "Registry", "RegistryError", "StatusError",
           "Version", "VersionNotFound", "default_root"]
