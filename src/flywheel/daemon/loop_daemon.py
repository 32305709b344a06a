"""`flywheel loop run`: serve the production model, take traces and feedback, run cycles.

One process, three activities:
- serving: the OpenAI-compatible app on `serve.host:port`, following the registry's
  production version (a promotion switches it without failing requests in flight), recording
  every response as a trace in the loop's store, and taking POST /v1/traces + feedback;
- triggering: every `trigger.poll_s` it counts failed traces since the last cycle's cursor
  (incrementally: a poll reads only the feedback stored since the last, failure_counter.py);
  `min_new_failures` of them (or `every_s` since the last cycle) start a cycle. A cycle that
  found too few held-out new failures to decide (gate.min_new_failures) trains nothing and
  waits for more traffic: the count is not reset (it still runs from the last cycle that
  decided, and the next cycle's suite holds those failures too), and the next cycle starts
  once `min_new_failures` more have arrived since the wait (loop/trigger.py `due`);
- cycles: run on this thread (cycle.py); an unfinished one is resumed first.

`stop()` (the CLI's SIGTERM / SIGINT handler) asks training loops to stop after their step,
the cycle to stop between stages (its state stays resumable), and the server to drain.
The daemon writes `<data_dir>/loop-status.json` (atomically) at every change, which
`flywheel loop status` reads.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from flywheel.files import atomic_write
from flywheel.loop.cycle import WAITING, CycleError, LoopStores, pending_cycle, run_cycle
from flywheel.loop.failure_counter import FailureCounter
from flywheel.loop.loop_config import LoopConfig
from flywheel.loop.store_lock import hold_store
from flywheel.loop.trigger import TriggerState, due
from flywheel.train.stop import clear_stop, request_stop

STATUS_FILE = "loop-status.json"


@dataclass
class LoopStatus:
    pid: int
    started_at: float
    state: str = "starting"  # starting | idle | cycle <id> | stopping | stopped
    url: str | None = None
    serving: str | None = None  # version id served now
    cycles_run: int = 0
    last_cycle: dict[str, Any] = field(default_factory=dict)
    new_failures: int = 0  # failed traces since the last cycle that decided (a wait does not reset it)
    trigger: str = ""
    waiting: str = ""  # set while the last cycle waits for more traffic: why, and when the next starts
    updated_at: float = 0.0


class LoopDaemon:
    def __init__(self, cfg: LoopConfig, log: Callable[[str], None] = print):
        self.cfg = cfg
        self.log = log
        self._stop = threading.Event()
        self.status = LoopStatus(pid=os.getpid(), started_at=time.time())
        self.url: str | None = None
        self.ready = threading.Event()

    def stop(self) -> None:
        self._stop.set()
        request_stop()

    def _write_status(self, **changes: Any) -> None:
        for k, v in changes.items():
            setattr(self.status, k, v)
        self.status.updated_at = time.time()
        path = self.cfg.root / STATUS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, (json.dumps(self.status.__dict__, indent=2, sort_keys=True) + "\n").encode())

    def run(self) -> None:
        """Until `stop()`. Raises StoreLocked, before touching anything, if another loop process
        holds the store."""
        clear_stop()
        with hold_store(self.cfg.root, "flywheel loop run"), LoopStores(self.cfg) as fw:
            serving = self._start_serving(fw) if self.cfg.serve.enabled else None
            try:
                self.ready.set()
                last_cycle_at = time.monotonic()
                counter: FailureCounter | None = None
                since_wait: FailureCounter | None = None
                threshold = self.cfg.trigger.min_new_failures
                while not self._stop.is_set():
                    changed = fw.observe_production()  # a promotion or rollback by hand shows here
                    if changed:
                        self.log(changed)
                    states = fw.states()
                    prod = fw.registry.production()
                    # failures since the last cycle that decided, of the version in production now
                    decided = [s for s in states if s.outcome != WAITING]
                    cursor = max(decided[-1].trace_cursor if decided else 0,
                                 fw.since_cursor(prod.id) if prod is not None else 0)
                    if counter is None or counter.cursor != cursor:  # a cycle moved the cursor
                        counter = FailureCounter(self.cfg.curation, cursor)
                    waited = states[-1] if states and states[-1].outcome == WAITING \
                        and states[-1].trace_cursor >= cursor else None
                    if waited is not None and (since_wait is None or since_wait.cursor != waited.trace_cursor):
                        since_wait = FailureCounter(self.cfg.curation, waited.trace_cursor)
                    # since the wait first, then all: feedback stored between the two reads is in
                    # `failures` too, so `failures` never lags the `fresh` that triggers a cycle
                    fresh = since_wait.update(fw.traces) if waited is not None else None
                    failures = counter.update(fw.traces)
                    why = due(TriggerState(failures, fresh, last_cycle_at, pending=pending_cycle(fw) is not None),
                              self.cfg.trigger, time.monotonic())
                    waiting = "" if waited is None else (
                        f"{waited.id}: {waited.decision.get('reasons', [WAITING])[0]}; the next cycle starts "
                        f"after {threshold} more failures ({fresh} so far)")
                    self._write_status(state="idle", new_failures=failures, serving=self._served(serving),
                                       waiting=waiting,
                                       trigger=f"min_new_failures={threshold}"
                                               + (f", every_s={self.cfg.trigger.every_s:g}" if self.cfg.trigger.every_s else ""))
                    if why and prod is not None:
                        self.log(f"cycle: {why}")
                        self._write_status(state=f"cycle ({why})")
                        try:
                            st = run_cycle(fw, log=self.log)
                        except CycleError as e:
                            self.log(f"cycle error: {e}")
                            self._stop.wait(self.cfg.trigger.poll_s)
                            continue
                        last_cycle_at = time.monotonic()
                        if st.done:
                            self._write_status(cycles_run=self.status.cycles_run + 1, last_cycle={
                                "id": st.id, "outcome": st.outcome, "version": st.version, "usd": st.usd,
                                "reasons": st.decision.get("reasons", [])})
                        if st.outcome == WAITING:
                            self.log(f"{WAITING}: the next cycle starts after {threshold} more failed traces")
                        if serving is not None:
                            serving.switch_now()  # rather than at the next poll
                        continue
                    self._stop.wait(self.cfg.trigger.poll_s)
            finally:
                self._write_status(state="stopping")
                if serving is not None:
                    serving.close()
                self._write_status(state="stopped")

    # ---- serving

    def _start_serving(self, fw):
        # serving needs the `serve` extra (FastAPI, uvicorn): a daemon with serving off runs without it
        from flywheel.serve.builder import serve_loop

        serving = serve_loop(fw, self.cfg.serve.host, self.cfg.serve.port)
        self.url = serving.url
        self._write_status(url=self.url, serving=serving.version)
        self.log(f"serving {serving.version} on {self.url}")
        return serving

    @staticmethod
    def _served(serving) -> str | None:
        return None if serving is None else serving.version
