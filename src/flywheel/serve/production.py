"""The hook between the model registry and serving: follow the production version.

The registry (flywheel.registry.registry) is not imported here. It hands serving a
`ProductionLookup`: a callable returning the production version as `(label, model_dir)`,
or None when there is none yet; `registry_lookup(registry)` makes one from a Registry. `ProductionFollower` polls it on its own thread and, when
the label changes, loads the new folder and switches the service to it, off the request
path (requests in flight finish on the old version). A promotion can also call
`follower.check_now()` (or `service.switch(...)` directly) to switch without waiting.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

ProductionLookup = Callable[[], "tuple[str, str | Path] | None"]


def registry_lookup(registry) -> ProductionLookup:
    """A `ProductionLookup` over a `flywheel.loop.Registry` (duck-typed: `production_marker()`,
    `production()`): one primary-key read per poll, the version row only when the marker moved."""
    seen: dict[str, object] = {}

    def lookup() -> tuple[str, Path] | None:
        marker = registry.production_marker()
        if seen.get("marker") != marker:
            version = registry.production()
            seen["marker"], seen["found"] = marker, (version.id, version.path) if version is not None else None
        return seen["found"]  # type: ignore[return-value]

    return lookup


class ProductionFollower:
    def __init__(self, service, lookup: ProductionLookup, interval_s: float = 2.0, **load_kw):
        self.service = service
        self.lookup = lookup
        self.interval_s = interval_s
        self.load_kw = load_kw
        self.errors = 0
        self._lock = threading.Lock()  # one load at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_now(self) -> bool:
        """Switch if the registry's production version is not the served one; True if it switched."""
        with self._lock:
            found = self.lookup()
            if found is None:
                return False
            label, model_dir = found
            if str(label) == self.service.version:
                return False
            self.service.switch(model_dir, str(label), **self.load_kw)
            return True

    def start(self) -> "ProductionFollower":
        self._thread = threading.Thread(target=self._run, name="flywheel-production-follower", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_now()
            except Exception:  # a bad folder must not stop serving the current version
                self.errors += 1
                log.exception("could not switch to the registry's production version")
