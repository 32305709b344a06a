"""When a cycle starts: one rule for `flywheel loop run` (service daemon) and managed flywheels.

A cycle is due, in this order, when
1. an unfinished cycle waits to be resumed;
2. `min_new_failures` failed traces arrived since the last cycle:
   - after a cycle that decided (promoted, rejected, ...), counted since its cursor;
   - after a cycle that waited for more traffic (too few held-out new failures to decide), counted
     since that wait: the failures before it still count for the next cycle's suite, but they
     alone do not start it again;
3. `every_s` seconds passed since the last cycle started (since the loop began, for the first).

Pure: the callers count failures (loop/failure_counter.py) and read their clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from flywheel.loop.loop_config import TriggerConfig


@dataclass(frozen=True)
class TriggerState:
    failures: int  # failed traces since the last cycle that decided (or since production last changed)
    failures_since_wait: int | None  # those since the last cycle, when it waited for more traffic; else None
    last_cycle_at: float  # when the last cycle started (or the loop began), on the caller's clock
    pending: bool = False  # an unfinished cycle is there to resume


def due(state: TriggerState, config: TriggerConfig, now: float) -> str | None:
    """Why a cycle starts at `now` (the clock of `state.last_cycle_at`), or None."""
    threshold = config.min_new_failures
    if state.pending:
        return "resuming an unfinished cycle"
    if state.failures_since_wait is None and state.failures >= threshold:
        return f"{state.failures} new failures >= {threshold}"
    if state.failures_since_wait is not None and state.failures_since_wait >= threshold:
        return (f"{state.failures} new failures, {state.failures_since_wait} since the last cycle waited for more "
                f"traffic >= {threshold}")
    if config.every_s is not None and now - state.last_cycle_at >= config.every_s:
        return f"schedule: every {config.every_s:g} s"
    return None
