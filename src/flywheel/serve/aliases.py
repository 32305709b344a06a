"""Production aliases of managed flywheels, as a server resolves them: (tenant, alias) -> the
model name the alias serves now, read from the flywheel rows every `poll_s` by a thread.

A switch (a promotion or a rollback bumps the flywheel's `generation`) is taken only after the
new target is loaded (`warm(tenant, model)`: ServedModels.get), so the first request after it
does not wait for a load, and a target that fails to load leaves the alias where it was (the
next poll tries again). Requests in flight keep the service they were given. For LoRA
targets (the default) nothing they use is unloaded: the adapters stay registered on the base
engine, so none fails over the switch. A full-weight target has an engine of its own, one of
ServedModels' `max_loaded`; loading a third closes the least recently used, and a request
still running on that one fails. An alias created since the last poll is looked up once when
first asked for.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from flywheel.jobs.flywheels import Flywheels

log = logging.getLogger("flywheel.aliases")
SUFFIX = ":production"


class ProductionAliases:
    def __init__(self, flywheels: Flywheels, warm: Callable[[str, str], Any], poll_s: float = 0.5):
        self.flywheels, self.warm, self.poll_s = flywheels, warm, poll_s
        self._table: dict[tuple[str, str], tuple[str, int]] = {}  # (tenant, alias) -> (target, generation)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, tenant: str, name: str) -> str | None:
        """The model `name` stands for now, or None when it is no alias of this tenant's."""
        if not name.endswith(SUFFIX):
            return None
        hit = self._table.get((tenant, name))
        if hit is None:
            row = self.flywheels.find_alias(tenant, name)
            if row is None:
                return None
            hit = self._table.setdefault((tenant, name), (row["production_model"], row["generation"]))
        return hit[0]

    def refresh(self) -> None:
        rows = self.flywheels.aliases()
        for key, (target, generation) in rows.items():
            old = self._table.get(key)
            if old is not None and old[1] == generation:
                continue
            if old is not None and old[0] != target:
                try:
                    self.warm(key[0], target)
                except Exception as exc:  # noqa: BLE001 - the alias stays on what works
                    log.warning("alias %s: %s does not load (%s); still serving %s", key[1], target, exc, old[0])
                    continue
                log.info("alias %s: now %s (was %s)", key[1], target, old[0])
            self._table[key] = (target, generation)
        for key in set(self._table) - set(rows):
            del self._table[key]

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flywheel-aliases", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - a failed read is retried at the next poll
                log.exception("alias refresh failed")

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
