"""FailureCounter: how many traces after a cursor have failed, kept up to date incrementally.

The daemon polls this every few seconds to decide whether `min_new_failures` have come in
since the last cycle. Recounting means reading every trace since the cursor, with its
feedback, at each poll; this reads only the feedback stored since the previous poll.

A trace's outcome is the verdict of its latest feedback that has one (curation_rules.outcome:
latest by created_at, ties to the later stored, i.e. the higher feedback seq). So per trace it
keeps that feedback's (created_at, seq, verdict); new feedback replaces it when it sorts
later, and the count of "fail" verdicts follows. Memory: one small tuple per trace with a
verdict since the cursor.

On SQLite seq follows commit order, so nothing is skipped. On PostgreSQL a feedback row
whose transaction commits after a later seq was read stays uncounted until the cursor moves
(the next cycle recounts from scratch): a trigger may fire one poll late, a cycle never
misses the row (curation reads every trace).
"""

from __future__ import annotations

from datetime import datetime

from flywheel.loop.curation_rules import CurationConfig, Verdict, verdict


class FailureCounter:
    def __init__(self, cfg: CurationConfig, cursor: int = 0):
        self.cfg = cfg
        self.cursor = cursor  # count traces with seq > cursor
        self.count = 0
        self._feedback_seq = 0  # feedback read up to here
        self._latest: dict[str, tuple[datetime, int, Verdict]] = {}  # trace id -> latest verdict

    def update(self, store) -> int:
        """Read the feedback stored since the last update; returns the failure count."""
        for seq, fb in store.feedback_after(self._feedback_seq, after_trace_seq=self.cursor):
            self._feedback_seq = seq
            v = verdict(fb, self.cfg)
            if v is None:
                continue
            old = self._latest.get(fb.trace_id)
            if old is not None and (fb.created_at, seq) < old[:2]:
                continue  # an older judgement arriving late changes nothing
            self.count += (v == "fail") - (old is not None and old[2] == "fail")
            self._latest[fb.trace_id] = (fb.created_at, seq, v)
        return self.count
