"""finetuning/job_validation.py: a job's files are checked after its create call returns; jobs a
stopped server left validating are checked by the next; a check that cannot run fails the job
saying why, never leaves it validating."""

from __future__ import annotations

import io
import json

import pytest

from flywheel.jobs import JobRequest, JobStore
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.finetuning.fine_tuning import FineTuning

ROW = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}
BODY = {"model": "tiny", "training_file": None, "method": {"type": "supervised", "supervised": {}}}


@pytest.fixture
def world(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    made = []

    def fine_tuning() -> FineTuning:
        made.append(FineTuning(store, {"tiny": base}))
        return made[-1]

    yield store, fine_tuning
    for ft in made:
        ft.close()
    store.close()


def test_a_job_left_validating_by_a_stopped_server_is_checked_by_the_next(world):
    store, fine_tuning = world
    first = fine_tuning()
    file_id = first.upload("t", "t.jsonl", "fine-tune", io.BytesIO((json.dumps(ROW) + "\n").encode() * 4))["id"]
    req = JobRequest.parse({**BODY, "training_file": file_id})
    job = store.create_job("t", model="tiny", method=req.method(), training_file=file_id, validation_file=None,
                           suffix=None, seed=0, meta=None)  # the row a server wrote before it stopped
    nxt = fine_tuning()
    nxt.start()
    assert nxt.validator.wait(60)
    job = store.get_job("t", job["id"])
    assert job["status"] == "queued" and job["method"]["supervised"]["hyperparameters"]["n_epochs"] >= 1


def test_a_check_that_cannot_run_fails_the_job_saying_why(world):
    store, fine_tuning = world
    ft = fine_tuning()
    file_id = ft.upload("t", "t.jsonl", "fine-tune", io.BytesIO((json.dumps(ROW) + "\n").encode()))["id"]
    store.file_path("t", file_id).unlink()  # its bytes gone from disk under the checker
    job = ft.create_job("t", {**BODY, "training_file": file_id})
    assert ft.validator.wait(60)
    job = store.get_job("t", job["id"])
    assert job["status"] == "failed" and job["error"]["code"] == "validation_error"
    assert "FileNotFoundError" in job["error"]["message"]
