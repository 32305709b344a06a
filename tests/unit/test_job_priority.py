"""A fine-tuning job's training process runs as background work (worker/job_run.py): nice 10
and SCHED_BATCH, so the server wins a contended core; a process already nicer stays so."""

from __future__ import annotations

import subprocess
import sys

PROBE = ("import os; from flywheel.worker.job_run import background_priority; background_priority(); "
         "print(os.nice(0), getattr(os, 'SCHED_BATCH', None) in (None, os.sched_getscheduler(0)))")


def test_training_runs_at_background_priority():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["10", "True"]


def test_a_nicer_process_is_not_raised():
    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "15"
