"""A fine-tuning job's step events, once each across attempts, and the event of a resume.

Outside testers killed a worker at step ~80 of a job that checkpoints every 50 steps: once
resumed, steps 10-80 each appeared twice, 10-50 with one timestamp. Here two attempts are
played on a real JobStore from the files a training run writes (metrics.jsonl, checkpoints).
"""

from __future__ import annotations

import json

import pytest

from flywheel.jobs import JobStore
from flywheel.jobs.store import data_file_url
from flywheel.worker.job_worker import JobProgress
from flywheel.train.checkpoint import STATE_FILE

METHOD = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 1}}}


@pytest.fixture
def store(tmp_path):
    s = JobStore(data_file_url(tmp_path), tmp_path / "files")
    yield s
    s.close()


def trained(job_dir, steps, checkpoint=None):
    """What a training attempt leaves: metrics lines for `steps`, and a checkpoint."""
    train = job_dir / "train"
    train.mkdir(parents=True, exist_ok=True)
    with open(train / "metrics.jsonl", "a", encoding="utf-8") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 1.0 / step}) + "\n")
    if checkpoint is not None:
        ckpt = train / "checkpoints" / f"step_{checkpoint}"
        ckpt.mkdir(parents=True)
        (ckpt / STATE_FILE).write_bytes(b"state")


def attempt(store, job_id, job_dir, steps, checkpoint=None):
    job = store.get_job(None, job_id)
    progress = JobProgress(store, job, job_dir, total_steps=100, every=10)
    progress.begin()
    trained(job_dir, steps, checkpoint)
    progress.publish()
    return progress


def test_a_resumed_job_reports_each_step_once_and_says_where_it_resumed(store, tmp_path):
    job = store.create_job("t", model="tiny", method=METHOD, training_file="file-x", validation_file=None,
                           suffix=None, seed=0, meta=None)
    job_dir = tmp_path / "work" / job["id"]
    first = attempt(store, job["id"], job_dir, range(1, 81), checkpoint=50)  # killed at step 80
    assert first.last_step == 80
    second = attempt(store, job["id"], job_dir, range(51, 101))  # resumes from the checkpoint at 50
    assert second.last_step == 100
    events = store.list_events("t", job["id"], limit=100)[0][::-1]  # oldest first
    steps = [e["data"]["step"] for e in events if e["type"] == "metrics"]
    assert steps == list(range(10, 101, 10))
    resumed = [e for e in events if (e["data"] or {}).get("resumed_from_step") is not None]
    assert len(resumed) == 1 and resumed[0]["data"]["resumed_from_step"] == 50
    assert "resumed from its checkpoint at step 50" in resumed[0]["message"]


def test_a_killed_workers_unreported_steps_are_reported_by_the_next_attempt(store, tmp_path):
    """Attempt 1 wrote steps 1-60 but its worker died before reporting them."""
    job = store.create_job("t", model="tiny", method=METHOD, training_file="file-x", validation_file=None,
                           suffix=None, seed=0, meta=None)
    job_dir = tmp_path / "work" / job["id"]
    trained(job_dir, range(1, 61), checkpoint=50)
    second = attempt(store, job["id"], job_dir, range(51, 101))
    assert second.last_step == 100
    assert sorted(store.metric_steps(job["id"])) == list(range(10, 101, 10))
