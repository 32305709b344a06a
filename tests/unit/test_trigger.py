"""loop/trigger.py `due`, the one rule that starts cycles, worked by hand for each reason."""

from flywheel.loop.loop_config import TriggerConfig
from flywheel.loop.trigger import TriggerState, due

TWENTY = TriggerConfig(min_new_failures=20)
HOURLY = TriggerConfig(min_new_failures=20, every_s=3600)


def test_too_few_failures_start_nothing():
    assert due(TriggerState(failures=19, failures_since_wait=None, last_cycle_at=0.0), TWENTY, now=1e9) is None


def test_the_threshold_of_failures_since_the_last_decided_cycle_starts_one():
    assert due(TriggerState(20, None, 0.0), TWENTY, 1.0) == "20 new failures >= 20"


def test_an_unfinished_cycle_is_resumed_first():
    assert due(TriggerState(0, None, 0.0, pending=True), TWENTY, 1.0) == "resuming an unfinished cycle"
    assert due(TriggerState(50, 30, 0.0, pending=True), TWENTY, 1.0) == "resuming an unfinished cycle"


def test_after_a_wait_the_count_goes_on_but_only_failures_since_the_wait_start_the_next():
    assert due(TriggerState(35, 15, 0.0), TWENTY, 1.0) is None  # 35 >= 20, but only 15 since the wait
    assert due(TriggerState(40, 20, 0.0), TWENTY, 1.0) == \
        "40 new failures, 20 since the last cycle waited for more traffic >= 20"


def test_the_schedule_counts_from_the_last_cycle_on_the_callers_clock():
    assert due(TriggerState(0, None, last_cycle_at=100.0), HOURLY, now=3699.0) is None
    assert due(TriggerState(0, None, last_cycle_at=100.0), HOURLY, now=3700.0) == "schedule: every 3600 s"
    assert due(TriggerState(0, None, last_cycle_at=100.0), TWENTY, now=1e9) is None  # no schedule set


def test_failures_win_over_the_schedule():
    assert due(TriggerState(25, None, 0.0), HOURLY, 1e9) == "25 new failures >= 20"
