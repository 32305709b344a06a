"""The dashboard's charted numbers of a job's metrics event (serve/dashboard/data.py)."""

from flywheel.serve.dashboard.data import numbers


def test_a_metrics_event_charts_loss_reward_kl_and_throughput():
    event = {"step": 20, "total_steps": 40, "train_loss": 0.5, "train_reward_mean": 0.25,
             "metrics": {"loss": 0.5, "kl_ref": 0.01, "tokens_per_s": 900, "lr": 1e-4, "stopped": True}}
    assert numbers(event) == {"train_loss": 0.5, "train_reward_mean": 0.25, "kl_ref": 0.01, "tokens_per_s": 900.0}


def test_an_event_from_before_the_metrics_row_and_no_event_chart_what_they_have():
    assert numbers({"step": 3, "train_loss": 2.0}) == {"train_loss": 2.0}
    assert numbers(None) == {}
    assert numbers({"step": 1, "metrics": "not a row"}) == {}
