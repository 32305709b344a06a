"""Feedback judged on arrival by curation's rules (loop/feedback_check.py)."""

import pytest

from flywheel.loop.curation_rules import CurationConfig
from flywheel.loop.feedback_check import FeedbackRefused, check_feedback

TASK = {"prompt": "12+34=", "answer": "46"}


@pytest.mark.parametrize("body", [
    {"label": "wrong"}, {"label": " Thumbs_Down "}, {"label": "GOOD"}, {"score": 0.0},
    {"verifier": {"env": "arithmetic", "task": TASK}},
    {"label": 3},  # a wrong type is the store's to name
    {"verifier": {"env": "arithmetic", "task": {"answer": "2"}}},  # no prompt: the trace's own is replayed
])
def test_usable_feedback_passes(body):
    check_feedback(body, CurationConfig())


@pytest.mark.parametrize("body, field, says", [
    ({"label": "thumbs-down"}, "label", "unknown label 'thumbs-down'; one of bad, correct, fail, failure, good, pass"),
    ({"verifier": {"env": "no_such_env", "task": TASK}}, "verifier.env", "'no_such_env' is neither a built-in"),
    ({"verifier": {"env": "replay", "task": TASK}}, "verifier.env", "'replay' is neither a built-in"),
    ({"verifier": {"env": "arithmetic", "task": {"prompt": "12+34="}}}, "verifier.task.answer", "needs the answer"),
    ({"verifier": {"env": "arithmetic", "task": {"prompt": "1+1=", "answer": None}}}, "verifier.task.answer", "answer"),
    ({"verifier": {"env": "arithmetic", "task": {"prompt": 7, "answer": "2"}}}, "verifier.task", "'prompt' must be"),
])
def test_unusable_feedback_is_refused_naming_the_field(body, field, says):
    with pytest.raises(FeedbackRefused) as e:
        check_feedback(body, CurationConfig())
    assert e.value.field == field and says in str(e.value)


def test_the_operators_labels_and_environments_are_the_rules():
    cfg = CurationConfig(failure_labels=["thumbs-down"], success_labels=["thumbs-up"], environments=["my_env"])
    check_feedback({"label": "thumbs-down", "verifier": {"env": "my_env", "task": TASK}}, cfg)
    with pytest.raises(FeedbackRefused, match="one of thumbs-down, thumbs-up"):
        check_feedback({"label": "wrong"}, cfg)
