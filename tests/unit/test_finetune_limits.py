"""Per-tenant limits of the fine-tuning service: unfinished jobs, upload size, tokens per job."""

from __future__ import annotations

import io
import json

import pytest

from flywheel.jobs import JobStore
from flywheel.jobs.limits import TenantLimits
from flywheel.jobs.store import data_file_url
from flywheel.models import TinySpec, build_tiny_model
from flywheel.errors import OpenAIError
from flywheel.finetuning.fine_tuning import FineTuning

ROW = {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}]}


@pytest.fixture
def make(tmp_path):
    base = build_tiny_model(tmp_path / "tiny", TinySpec(hidden=32, layers=1, heads=2, ffn=64))
    store = JobStore(data_file_url(tmp_path), tmp_path / "files")
    made = []
    yield lambda limits: made.append(FineTuning(store, {"tiny": base}, limits=limits)) or made[-1]
    for ft in made:
        ft.close()
    store.close()


def upload(ft, rows=1, tenant="t"):
    return ft.upload(tenant, "t.jsonl", "fine-tune", io.BytesIO((json.dumps(ROW) + "\n").encode() * rows))["id"]


def validated(ft, tenant: str, body: dict) -> dict:
    """The job created from `body`, once its files are checked."""
    job = ft.create_job(tenant, body)
    assert ft.validator.wait(60)
    return ft.jobs.get_job(tenant, job["id"])


def test_unfinished_jobs_past_the_limit_are_a_429(make):
    ft = make(TenantLimits(max_unfinished=2))
    f = upload(ft)
    for _ in range(2):
        ft.create_job("t", {"model": "tiny", "training_file": f})
    with pytest.raises(OpenAIError) as info:
        ft.create_job("t", {"model": "tiny", "training_file": f})
    assert info.value.status == 429 and info.value.code == "quota_exceeded"
    other = upload(ft, tenant="u")
    assert validated(ft, "u", {"model": "tiny", "training_file": other})["status"] == "queued"  # per tenant


def test_a_file_over_the_limit_is_a_413(make):
    ft = make(TenantLimits(max_file_bytes=100))
    with pytest.raises(OpenAIError) as info:
        upload(ft, rows=2)
    assert info.value.status == 413 and "the limit is 100" in str(info.value)


def test_a_job_over_the_token_limit_fails_validation_with_the_count(make):
    # the byte-level tiny tokenizer: the row's texts are "user\nWhat is 2 + 2?\nassistant\n4" = 31 tokens
    ft = make(TenantLimits(max_job_tokens=31 * 3 * 10 - 1))
    f = upload(ft, rows=10)
    job = validated(ft, "t", {"model": "tiny", "training_file": f, "hyperparameters": {"n_epochs": 3}})
    assert job["status"] == "failed" and job["error"]["code"] == "too_many_tokens"
    assert "930 tokens (3 epochs" in job["error"]["message"]
    assert validated(ft, "t", {"model": "tiny", "training_file": f, "hyperparameters": {"n_epochs": 2}})[
        "status"] == "queued"
