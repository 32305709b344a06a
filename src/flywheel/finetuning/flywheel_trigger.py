"""What starts a managed flywheel's cycles: a thread of the server that looks at every active
flywheel every `poll_s` and queues a cycle (jobs/flywheels.py `queue_cycle`: at most one
unfinished per flywheel, so several servers polling start it once) when the loop's rule
(loop/trigger.py `due`, the daemon's too) says so. Its failures are those of the flywheel's
scope after its cursor (the trace seq its last cycle read up to, or where production last
changed), counted by the loop's FailureCounter (curation's verdict rule), which reads only what
is new at each poll; a cycle that waited for more traffic moved the cursor too, so they are
also the failures since that wait. The schedule counts from its last cycle's queueing (from
its creation for the first).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime

from flywheel.clock import utc_naive, utc_now
from flywheel.jobs.flywheel_request import FlywheelSpec
from flywheel.jobs.flywheels import Flywheels
from flywheel.loop.curation_rules import CurationConfig
from flywheel.loop.cycle import WAITING
from flywheel.loop.failure_counter import FailureCounter
from flywheel.loop.loop_config import TriggerConfig
from flywheel.loop.trigger import TriggerState, due
from flywheel.traces.scope import ScopedTraces, TraceScope

log = logging.getLogger("flywheel.flywheels")


class FlywheelTrigger:
    def __init__(self, flywheels: Flywheels, trace_store, poll_s: float = 2.0):
        self.flywheels, self.traces, self.poll_s = flywheels, trace_store, poll_s
        self._counters: dict[str, tuple[int, FailureCounter]] = {}  # flywheel id -> (its cursor, counter)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> list[str]:
        """Queue the cycles that are due; the ids of the flywheels that got one."""
        started = []
        for fw in self.flywheels.active():
            try:
                reason = self._due(fw)
                if reason is not None and self.flywheels.queue_cycle(fw["id"], reason) is not None:
                    log.info("flywheel %s: cycle queued (%s)", fw["id"], reason)
                    started.append(fw["id"])
            except Exception:  # noqa: BLE001 - one flywheel's trouble holds up no other's
                log.exception("flywheel %s: trigger check failed", fw["id"])
        return started

    def _due(self, fw: dict) -> str | None:
        spec = FlywheelSpec.model_validate(fw["spec"])
        cursor, counter = self._counters.get(fw["id"], (None, None))
        if counter is None or cursor != fw["cursor"]:
            counter = FailureCounter(CurationConfig(**spec.curation.model_dump(exclude_none=True)), fw["cursor"])
            self._counters[fw["id"]] = (fw["cursor"], counter)
        scope = TraceScope(fw["tenant"], tuple(spec.trace_models))
        failures = counter.update(ScopedTraces(self.traces, scope))
        trigger = spec.trigger
        last = self.flywheels.cycles(fw["tenant"], fw["id"])[:1]
        waited = bool(last) and last[0]["outcome"] == WAITING
        state = TriggerState(failures, failures if waited else None,
                             _seconds(last[0]["created_at"] if last else fw["created_at"]))
        return due(state, TriggerConfig(min_new_failures=trigger.min_new_failures, every_s=trigger.every_seconds),
                   _seconds(utc_naive(utc_now())))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flywheel-trigger", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a bad poll must not end the trigger
                log.exception("flywheel trigger poll failed")
                time.sleep(self.poll_s)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def _seconds(naive_utc: datetime) -> float:
    return (naive_utc - datetime(1970, 1, 1)).total_seconds()
